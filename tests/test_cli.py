"""Numeric flags are checked at parse time: one line naming the flag, the value and the range, exit 2."""
from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, check_defaults, check_numeric_flags, run, run_env
from yolotrain.utils.core import cli as shared
from yolotrain.utils.core.cli import ArgumentParser, Range

BENCH = ("cache_memory", "compare_yolov5", "loader_speed", "metrics_speed", "model_table", "scan_speed",
         "train_speed", "val_speed", "infer_speed", "compare_ultralytics", "photo_dataset")


def _bench_parser(name: str) -> argparse.ArgumentParser:
    """A bench script's parser; the scripts are not a package, so load each by path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module.build_parser()


def _parser(cli: str) -> argparse.ArgumentParser:
    if cli == "train":
        from yolotrain.app import train
        return train.build_parser()
    if cli == "val":
        from yolotrain.app import val
        return val.build_parser()
    if cli == "detect":
        from yolotrain.app import detect
        return detect.build_parser()
    if cli == "export":
        from yolotrain.app import export
        return export.build_parser()
    if cli == "tune":
        from yolotrain.app import tune
        return tune.build_parser()
    if cli == "coco":
        from yolotrain.app import coco
        return coco.build_parser()
    return _bench_parser(cli)


# ---------------------------------------------------------------- the checker itself
def test_range_parses_and_refuses():
    assert Range(int, min=1)("3") == 3 and Range(float, min=0, max=1)("1") == 1.0
    for rng, text in ((Range(int, min=1), "0"), (Range(int, min=1), "1.5"), (Range(float, min=0), "nan"),
                      (Range(float, min=0), "inf"), (Range(float, min=0, max=1), "-0.1"), (Range(int), "x")):
        with pytest.raises(argparse.ArgumentTypeError, match=f"got '{text}'"):
            rng(text)
    with pytest.raises(argparse.ArgumentTypeError) as e:
        Range(int, min=1)("0")
    assert str(e.value) == "must be an integer >= 1, got '0'"
    assert repr(Range(float, min=0, max=1)) == "Range(float, min=0, max=1)"
    assert Range(int, min=32, note="the largest model stride").__name__ == \
        "an integer >= 32 (the largest model stride)"


def test_checker_finds_unchecked_numeric_flags():
    p = ArgumentParser()
    p.add_argument("--ok", type=Range(int, min=1), default=1)
    p.add_argument("--plain-int", type=int)
    p.add_argument("--plain-float", default=0.5)
    p.add_argument("--list", nargs="+", type=str, default=[0])
    p.add_argument("--bad-default", type=Range(int, min=1), default=0)
    p.add_argument("--switch", action="store_true")
    p.add_argument("--word", default="x")
    assert check_numeric_flags(p) == ["--plain-int", "--plain-float", "--list"]
    assert check_defaults(p) == ["--bad-default"]


# ---------------------------------------------------------------- every CLI uses it
@pytest.mark.parametrize("cli", ["train", "val", "detect", "export", "tune", "coco", *BENCH])
def test_every_numeric_flag_is_range_checked(cli):
    parser = _parser(cli)
    assert isinstance(parser, ArgumentParser), f"{cli}: use yolotrain.utils.core.cli.ArgumentParser for one-line errors"
    assert check_numeric_flags(parser) == [], f"{cli}: numeric flags without a Range type"
    assert check_defaults(parser) == [], f"{cli}: defaults outside their Range"


@pytest.mark.parametrize("cli, argv, flag, value", [
    ("train", ["--epochs", "0"], "--epochs", "0"),
    ("train", ["--epochs", "-2"], "--epochs", "-2"),
    ("train", ["--imgsz", "0"], "--imgsz", "0"),
    ("train", ["--img", "16"], "--imgsz", "16"),
    ("train", ["--batch-size", "0"], "--batch-size", "0"),
    ("train", ["--workers", "-1"], "--workers", "-1"),
    ("train", ["--save-interval", "nan"], "--save-interval", "nan"),
    ("train", ["--seed", "-1"], "--seed", "-1"),
    ("train", ["--freeze", "-1"], "--freeze", "-1"),
    ("val", ["--weights", "x.pt", "--batch-size", "0"], "--batch-size", "0"),
    ("val", ["--weights", "x.pt", "--conf-thres", "1.5"], "--conf-thres", "1.5"),
    ("val", ["--weights", "x.pt", "--iou-thres", "-0.1"], "--iou-thres", "-0.1"),
    ("val", ["--weights", "x.pt", "--max-det", "0"], "--max-det", "0"),
])
def test_bad_value_is_one_line_and_exit_2(cli, argv, flag, value, capsys):
    parser = _parser(cli)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ERROR: argument {flag}") and f"'{value}'" in lines[0], lines[0]


def test_defaults_and_aliases_still_parse():
    from yolotrain.app import train
    from yolotrain.app import val

    assert train.build_parser().parse_args(["--img-size", "64", "--local_rank", "1"]).imgsz == 64
    opt = val.build_parser().parse_args(["--weights", "x.pt"])
    assert opt.imgsz is None and opt.conf_thres == 0.001


# ---------------------------------------------------------------- shared flag groups
SHARED = {  # yolotrain.utils.core.cli group -> the CLIs that take it
    shared.add_device_flags: ("train", "val", "detect", "export"),
    shared.add_workers_flag: ("train", "val", "detect"),
    shared.add_cache_flags: ("train", "val"),
    shared.add_channels_last_flag: ("train", "val"),
    shared.add_run_folder_flags: ("train", "val", "detect"),
    shared.add_local_rank_flag: ("train", "val", "detect"),
}
PER_CLI_DEFAULT = {"--device": {"export": "cpu"},  # the defaults that differ; every other one is the same everywhere
                   "--project": {c: str(ROOT / "runs" / c) for c in ("train", "val", "detect")}}


def _group_flags(group) -> list[str]:
    p = ArgumentParser()
    group(p, ROOT / "runs" / "x") if group is shared.add_run_folder_flags else group(p)
    return [a.option_strings[0] for a in p._actions if a.option_strings and a.dest != "help"]


def _signature(parser: argparse.ArgumentParser, flag: str) -> tuple:
    """What a flag accepts and gives: names, destination, type, arity, choices and action (not its default)."""
    a = parser._option_string_actions[flag]
    kind = repr(a.type) if isinstance(a.type, Range) else a.type
    choices = None if a.choices is None else tuple(a.choices)
    return tuple(a.option_strings), a.dest, kind, a.nargs, a.const, choices, type(a).__name__


@pytest.mark.parametrize("group", SHARED, ids=lambda g: g.__name__)
def test_shared_flag_groups_are_identical_in_every_cli(group):
    users, parsers = SHARED[group], {c: _parser(c) for c in ("train", "val", "detect", "export")}
    for flag in _group_flags(group):
        assert sorted(c for c, p in parsers.items() if flag in p._option_string_actions) == sorted(users), flag
        assert len({_signature(parsers[c], flag) for c in users}) == 1, flag
        defaults = {c: parsers[c]._option_string_actions[flag].default for c in users}
        expected = {c: PER_CLI_DEFAULT.get(flag, {}).get(c, defaults[users[0]]) for c in users}
        assert defaults == expected, flag


# ---------------------------------------------------------------- as users run them
@pytest.mark.parametrize("argv, line", [
    (["train.py", "--epochs", "0"], "ERROR: argument --epochs: must be an integer >= 1, got '0'"),
    (["val.py", "--weights", "x.pt", "--conf-thres", "1.5"],
     "ERROR: argument --conf-thres: must be a number from 0 to 1, got '1.5'"),
])
@pytest.mark.slow
def test_cli_refuses_before_anything_starts(argv, line, tmp_path):
    t0 = time.time()
    p = subprocess.run([sys.executable, *argv, "--project", str(tmp_path / "runs")], cwd=ROOT, env=run_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [line] and p.stdout == ""
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists()  # no run folder: nothing started
    assert time.time() - t0 < 60


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_every_rank_refuses(tmp_path):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "train.py", "--batch-size", "0", "--project", str(tmp_path / "runs")],
                       cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert out.count("ERROR: argument --batch-size: must be an integer >= 1, or -1 for AutoBatch, got '0'") == 2, out[-3000:]
    # torchrun's launcher prints its own ChildFailedError report; no frame may come from our code
    ours = [f'File "{ROOT / name}' for name in ("train.py", "val.py", "utils", "models")]
    assert not any(frame in out for frame in ours)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- python -m yolotrain <tool>
def test_the_module_entry_point_runs_each_tool_under_its_own_name(capsys, monkeypatch):
    from yolotrain import __main__ as entry
    from yolotrain.app import coco, convert, detect, export, shards, train, tune, val, weights

    assert {name: entry.tool_cli(name) for name in entry.TOOLS} == {
        "train": train.cli, "val": val.cli, "detect": detect.cli, "export": export.cli, "tune": tune.cli,
        "convert": convert.cli, "weights": weights.cli, "coco": coco.cli, "shards": shards.cli}
    monkeypatch.setattr(sys, "argv", ["x"])
    assert entry.main(["val", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m yolotrain val ")
    assert entry.main([]) == 2 and "tools:" in capsys.readouterr().out
    assert entry.main(["trian"]) == 2 and "unknown tool 'trian'" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter: what one tool's start imports
def test_one_tool_imports_that_tool_alone():
    """``python val.py --help`` imports the val tool, not train, tune, the search package, the Python API or optuna
    (yolotrain/__init__ and ``python -m yolotrain`` import on first use); ``from yolotrain import YOLO`` still
    works and lists its names."""
    p = run([sys.executable, "-X", "importtime", "val.py", "--help"])
    imported = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "yolotrain.app.val" in imported
    others = ("yolotrain.app.train", "yolotrain.app.tune", "yolotrain.model", "yolotrain.app.search", "optuna")
    assert not {m for m in imported if any(m == o or m.startswith(o + ".") for o in others)}
    import yolotrain

    assert {"YOLO", "convert_coco", "UserError"} <= set(dir(yolotrain)) and yolotrain.YOLO.__name__ == "YOLO"


def test_every_command_a_message_names_exists():
    """The commands and files the product's messages and docstrings tell users to run are there: ``python -m
    yolotrain <tool>`` a tool of TOOLS, ``python -m <module>`` an importable module, ``python <script>.py`` a
    script of the checkout, ``pip install -r <file>`` a requirements file."""
    import importlib.util
    import re

    from yolotrain.__main__ import TOOLS

    text = "\n".join(p.read_text() for p in (ROOT / "yolotrain").rglob("*.py"))
    tools = set(re.findall(r"python -m yolotrain (\w+)", text))
    modules = {m for m in re.findall(r"python -m ([\w.]+)", text) if m != "yolotrain"}
    scripts = set(re.findall(r"python ([\w/]+\.py)", text))
    files = set(re.findall(r"-r (requirements[\w-]*\.txt)", text))
    named = set(re.findall(r"tool_command\([\"'](\w+)[\"']\)", text))  # a tool named as this form runs it
    assert tools and scripts and files and named  # the scan found what it looks for
    assert tools <= set(TOOLS), tools - set(TOOLS)
    assert named <= set(TOOLS), named - set(TOOLS)
    def runnable(module: str) -> bool:  # python -m runs a module, or a package's __main__
        spec = importlib.util.find_spec(module)
        return spec is not None and (spec.submodule_search_locations is None
                                     or importlib.util.find_spec(f"{module}.__main__") is not None)

    assert [m for m in modules if not runnable(m)] == []
    assert [s for s in scripts if not (ROOT / s).is_file()] == []
    assert [f for f in files if not (ROOT / f).is_file()] == []


def test_a_message_names_a_tool_as_this_form_of_yolotrain_runs_it(monkeypatch):
    """The checkout's scripts and python -m yolotrain; an installed package's console command."""
    from yolotrain.__main__ import TOOLS
    from yolotrain.utils.core import cli

    checkout = {t: cli.tool_command(t) for t in TOOLS}
    assert checkout["val"] == "python val.py" and checkout["shards"] == "python -m yolotrain shards"
    assert all((ROOT / c.split()[1]).is_file() for c in checkout.values() if c.endswith(".py"))
    monkeypatch.setattr(cli, "CHECKOUT", False)
    assert [cli.tool_command(t) for t in TOOLS] == [f"yolotrain {t}" for t in TOOLS]


@pytest.mark.parametrize("argv, says", [
    (["--nosave"], "last.pt and best.pt are always written"),
    (["--label-smoothing", "0.1"], "label_smoothing: EPS in the --hyp file"),
    (["--image-weights"], "class-weighted image sampling is not available"),
    (["--quad"], "--multi-scale"),
])
def test_yolov5_flags_refused_with_what_to_type(argv, says, capsys):
    """YOLOv5's train.py flags this trainer lacks stop the parse with one line naming the flag and the
    alternative (exit 2); the Python API raises the same line; --help and the namespace do not show them."""
    from yolotrain.app import train

    with pytest.raises(SystemExit) as e:
        train.build_parser().parse_args(["--epochs", "1", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"ERROR: {argv[0]} is not a flag here: ")
    assert says in err
    parser = train.build_parser()
    parser.raise_errors = True
    with pytest.raises(shared.UserError, match=re.escape(says)):
        parser.parse_args(argv)
    assert argv[0] not in parser.format_help() and not hasattr(parser.parse_args([]), argv[0][2:].replace("-", "_"))


def test_a_hyperparameter_given_as_an_api_option_names_the_hyp_file():
    """Ultralytics' habit lr0=... is refused with where the key goes; a misspelt option still gets its suggestion."""
    from yolotrain import options
    from yolotrain.app import train

    with pytest.raises(shared.UserError, match=r"'lr0' is a hyperparameter, not an option: put 'lr0: 0.02' in a copy "
                                               r"of the hyp file and pass hyp="):
        options.to_argv(train.build_parser(), {"lr0": 0.02}, "train.py")
    with pytest.raises(shared.UserError, match="unknown option 'epoch'. Did you mean 'epochs'"):
        options.to_argv(train.build_parser(), {"epoch": 3}, "train.py")
    assert options.to_argv(train.build_parser(), {"epochs": 3, "batch": 8}, "train.py") == ["--epochs", "3",
                                                                                          "--batch-size", "8"]
