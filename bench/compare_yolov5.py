#!/usr/bin/env python
"""Side by side with the PyPI ``yolov5`` package: seconds per training epoch, per validation pass,
and standalone val.py speed, with identical settings, measured back to back in one run.

    python bench/compare_yolov5.py --yolov5-python /work/yolov5-venv/bin/python
    python bench/compare_yolov5.py --yolov5-python /work/yolov5-venv/bin/python --epochs 1 --n-train 64 --n-val 32
    python bench/compare_yolov5.py --yolov5-python /work/yolov5-venv/bin/python --epochs 3 --rounds 2

How it runs offline (facts from shared/notes/running-yolov5-offline.md):
  * yolov5 (7.0.14) lives in its own venv, never in this repo's: create it with
        python -m venv /work/yolov5-venv
        /work/yolov5-venv/bin/pip install torch torchvision yolov5 "setuptools<81" "numpy<2.4"
    (setuptools<81: yolov5 imports pkg_resources; numpy<2.4: its metrics call np.trapz) and
    pass its interpreter as --yolov5-python. This repo never imports yolov5; tests never run this.
  * Every yolov5 process gets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (it pickles whole models),
    YOLOV5_CONFIG_DIR / YOLO_CONFIG_DIR pointing at a folder in the work dir holding a TrueType
    file named Arial.ttf (a copy of matplotlib's DejaVuSans.ttf from that venv: yolov5 otherwise
    downloads the font in check_dataset) and MPLCONFIGDIR in the work dir. Nothing is downloaded:
    both tools train from scratch (yolov5: --cfg yolov5n.yaml --weights '').
  * Each tool gets its own copy of the built-in shapes dataset in the work dir (both write label
    caches next to the labels; --n-train/--n-val take the first N images of each split).

Identical settings: same images, model yaml (yolov5<size>), hyperparameters (this repo's
hyp.scratch-low.yaml, which holds YOLOv5's values; ours gets close_mosaic 0 so it keeps mosaic to
the end as YOLOv5 does), image size, batch, workers, epochs, seed, CPU, no plots, validation
after every epoch (val batch 32 = YOLOv5's 2 x batch), autoanchor on in both.

Method: each tool runs inside a small timing shim (written to the work dir, run with that tool's
interpreter) that calls the tool's own entry point unchanged and records wall-clock stamps:
  ours    yolotrain.utils.engine.loop's train_one_epoch and evaluate_model are wrapped (loop.py calls both by
          those module-level names; evaluate_model is utils/eval/evaluate.py's, the validation pass)
  yolov5  its Callbacks 'on_train_epoch_start' / 'on_train_epoch_end' hooks, and yolov5.val.run
so "train s/epoch" is the batch loop of one epoch and "val s/epoch" the validation pass after it
(YOLOv5's extra validation of best.pt after training is reported separately, not averaged in).
With two or more epochs the steady figure is the mean over epochs 2..E (epoch 1 starts the
loader workers). Standalone val.py is timed inside its process from argument parsing to the
result (load checkpoint, data, inference, NMS, metrics), on each tool's own last.pt, with each
tool's own pre-process / inference / NMS split. yolov5's val is called as its main() does, but
with plots=False (its CLI has no --noplots). With --rounds R both tools run R times, in
alternating order, each round on a fresh dataset copy, and every figure is the best of its R
measurements (a busy machine only ever adds time).

Timing runs must be alone on the machine (two trainings on 2 cores slow each other 3-14x); the
tools run one after the other here, and figures from a busy machine are only indicative.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from yolotrain.utils.core.cli import IMGSZ, SEED, ArgumentParser, Range  # noqa: E402

# Run by either interpreter: sys.argv = [shim, mode, events.json, ROOT, *tool args]. Records
# (what, start, end, extra) stamps around the tool's own functions and writes them as JSON.
SHIM = r'''
import json, sys, time
mode, events_path, root, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
events, t_process = [], time.perf_counter()

def stamp(what, start, extra=None):
    events.append({"what": what, "start": start - t_process, "end": time.perf_counter() - t_process,
                   "extra": extra})

def wrap(module, name, what):
    inner = getattr(module, name)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            stamp(what, t)
    setattr(module, name, timed)

def save(extra):
    with open(events_path, "w") as f:
        json.dump({"events": events, "extra": extra}, f)

if mode == "ours-train":
    sys.path.insert(0, root)
    sys.argv = ["train.py", *argv]
    import torch
    from yolotrain.app import train
    from yolotrain.utils.engine import loop
    wrap(loop, "train_one_epoch", "train")  # called by name from loop.run_epochs
    wrap(loop, "evaluate_model", "val")  # ... and from loop.validate
    rc = train.cli(argv)
    save({"threads": torch.get_num_threads()})
    sys.exit(rc)
elif mode == "yolov5-train":
    sys.argv = ["train.py", *argv]
    import torch
    import yolov5.train as yt
    import yolov5.val as yv
    from yolov5.utils.callbacks import Callbacks
    wrap(yv, "run", "val")
    cb, starts = Callbacks(), []
    cb.register_action("on_train_epoch_start", "bench", lambda *a, **k: starts.append(time.perf_counter()))
    cb.register_action("on_train_epoch_end", "bench", lambda *a, **k: stamp("train", starts[-1]))
    yt.main(yt.parse_opt(), callbacks=cb)
    save({"threads": torch.get_num_threads()})
elif mode == "ours-val":
    sys.path.insert(0, root)
    sys.argv = ["val.py", *argv]
    import torch
    from yolotrain.app import val
    t = time.perf_counter()
    r = val.main(val.parse_opt(argv))[0]
    stamp("val.py", t)
    save({"threads": torch.get_num_threads(), "images": r.images, "speed_ms": list(r.speed_ms),
          "map50": r.metrics.map50, "map": r.metrics.map})
elif mode == "yolov5-val":
    sys.argv = ["val.py", *argv]
    import torch
    import yolov5.val as yv
    t = time.perf_counter()
    opt = yv.parse_opt()
    out = yv.run(**{**vars(opt), "plots": False})
    stamp("val.py", t)
    save({"threads": torch.get_num_threads(), "speed_ms": [float(v) for v in out[-1]],
          "map50": float(out[0][2]), "map": float(out[0][3])})
else:
    raise SystemExit(f"unknown mode {mode}")
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--yolov5-python", required=True, help="python of the venv that has the yolov5 package")
    p.add_argument("--model", default="n", help="model size: yolov5<size>.yaml in both tools")
    p.add_argument("--epochs", type=Range(int, min=1), default=2, help="training epochs for each tool")
    p.add_argument("--imgsz", type=IMGSZ, default=320)
    p.add_argument("--batch-size", type=Range(int, min=1), default=16)
    p.add_argument("--val-batch-size", type=Range(int, min=1), default=32,
                   help="standalone val.py batch (training val uses 2 x batch)")
    p.add_argument("--workers", type=Range(int, min=0), default=8,
                   help="max loader workers (both cap it at the core count)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--n-train", type=Range(int, min=0), default=0, help="use the first N training images (0: all)")
    p.add_argument("--n-val", type=Range(int, min=0), default=0, help="use the first N validation images (0: all)")
    p.add_argument("--rounds", type=Range(int, min=1), default=1,
                   help="run both tools this many times, alternating their order; report each figure's best")
    p.add_argument("--work-dir", default=None, help="where datasets, runs and logs go (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the default temp work dir")
    p.add_argument("--only", choices=("ours", "yolov5"), default=None, help="run one tool only (debugging)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="run ours with --channels-last or --no-channels-last (memory format; same recipe, different "
                        "rounding; default: ours' default for the device, NHWC on CPU)")
    return p


# ---------------------------------------------------------------------------------------------- set-up


def private_dataset(dst: Path, n_train: int, n_val: int) -> tuple[Path, dict[int, str]]:
    """Copy the built-in shapes dataset (generated on first use) to ``dst``; return its root and names."""
    from yolotrain.utils.data.config import load_data_config, prepare_dataset
    from yolotrain.utils.core.logging import setup_logging

    setup_logging(verbose=False)
    data = load_data_config(ROOT / "data" / "shapes.yaml")
    prepare_dataset(data)
    for split, n in (("train", n_train), ("val", n_val)):
        images = sorted((data.root / "images" / split).glob("*.jpg"))
        images = images[:n] if n else images
        (dst / "images" / split).mkdir(parents=True, exist_ok=True)
        (dst / "labels" / split).mkdir(parents=True, exist_ok=True)
        for im in images:
            shutil.copy2(im, dst / "images" / split / im.name)
            label = data.root / "labels" / split / (im.stem + ".txt")
            if label.exists():
                shutil.copy2(label, dst / "labels" / split / label.name)
    return dst, dict(enumerate(data.names))


def write_yaml(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(obj, sort_keys=False))
    return path


def hyp_files(work: Path) -> tuple[Path, Path]:
    """The same hyperparameters for both: ours with close_mosaic 0 (YOLOv5 has no such phase)."""
    hyp = yaml.safe_load((ROOT / "hyps" / "hyp.scratch-low.yaml").read_text())
    ours = write_yaml(work / "ours" / "hyp.yaml", {**hyp, "close_mosaic": 0.0})
    theirs = write_yaml(work / "yolov5" / "hyp.yaml", {k: v for k, v in hyp.items() if k != "close_mosaic"})
    return ours, theirs


def yolov5_env(work: Path, yolov5_python: str) -> dict[str, str]:
    """Environment that keeps yolov5 offline and inside the work dir."""
    config = work / "yolov5-config"
    config.mkdir(parents=True, exist_ok=True)
    font = subprocess.run([yolov5_python, "-c", "import matplotlib, os; print(os.path.join("
                           "matplotlib.get_data_path(), 'fonts', 'ttf', 'DejaVuSans.ttf'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shutil.copy(font, config / "Arial.ttf")
    (work / "mpl").mkdir(exist_ok=True)
    env = base_env()
    env.update(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", YOLOV5_CONFIG_DIR=str(config), YOLO_CONFIG_DIR=str(config),
               MPLCONFIGDIR=str(work / "mpl"), YOLO_OFFLINE="1")
    return env


def base_env() -> dict[str, str]:
    """This environment without torchrun's variables, unbuffered (the logs are read afterwards)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------------------------------------- running


def run_shim(python: str, mode: str, args: list[str], env: dict[str, str], folder: Path) -> dict:
    """Run one tool under the timing shim in ``folder``; returns its stamps (and log path) or exits with its log."""
    shim = folder / "shim.py"
    if not shim.exists():
        shim.write_text(SHIM)
    events, log = folder / f"{mode}.json", folder / f"{mode}.log"
    cmd = [python, str(shim), mode, str(events), str(ROOT), *args]
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, cwd=folder, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t
    if rc or not events.exists():
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"{mode} failed (exit {rc}); log: {log}")
    out = json.loads(events.read_text())
    out["wall"], out["log"] = wall, str(log)
    return out


def epoch_times(run: dict) -> tuple[list[float], list[float], float]:
    """Per-epoch train and val seconds, and the validation after training (YOLOv5's best.pt pass).

    The val counted for epoch k is the first validation (ours: evaluate_model, yolov5: val.run)
    that starts after epoch k's training ended and before epoch k + 1's began.
    """
    ev = sorted(run["events"], key=lambda e: e["start"])
    trains = [e for e in ev if e["what"] == "train"]
    vals = [e for e in ev if e["what"] == "val"]
    per_val, used = [], set()
    for k, tr in enumerate(trains):
        nxt = trains[k + 1]["start"] if k + 1 < len(trains) else float("inf")
        match = [i for i, v in enumerate(vals) if tr["end"] <= v["start"] < nxt and i not in used]
        if match:
            used.add(match[0])
            per_val.append(vals[match[0]]["end"] - vals[match[0]]["start"])
    extra = sum(v["end"] - v["start"] for i, v in enumerate(vals) if i not in used)
    return [e["end"] - e["start"] for e in trains], per_val, extra


def steady(xs: list[float]) -> float:
    """Mean over epochs 2.. when there are several (epoch 1 starts workers), else the one value."""
    return mean(xs[1:]) if len(xs) > 1 else (xs[0] if xs else float("nan"))


def train_args(tool: str, opt: argparse.Namespace, data_yaml: Path, hyp: Path, project: Path) -> list[str]:
    common = ["--data", str(data_yaml), "--hyp", str(hyp), "--imgsz", str(opt.imgsz),
              "--batch-size", str(opt.batch_size), "--epochs", str(opt.epochs), "--device", "cpu",
              "--workers", str(opt.workers), "--seed", str(opt.seed), "--project", str(project),
              "--name", "train", "--exist-ok"]
    if tool == "yolov5":
        return [*common, "--cfg", f"yolov5{opt.model}.yaml", "--weights", "", "--noplots"]
    return [*common, "--cfg", str(ROOT / "models" / f"yolov5{opt.model}.yaml"), "--noplots", *_ours_extra(opt)]


def _ours_extra(opt: argparse.Namespace) -> list[str]:
    """Implementation switches of ours that leave the recipe alone (YOLOv5 has no such flags)."""
    return [] if opt.channels_last is None else ["--channels-last" if opt.channels_last else "--no-channels-last"]


def val_args(tool: str, opt: argparse.Namespace, weights: Path, data_yaml: Path, out: Path) -> list[str]:
    """Standalone val.py arguments; results go under ``out``, and no plots (yolov5 is called with plots=False)."""
    args = ["--weights", str(weights), "--data", str(data_yaml), "--imgsz", str(opt.imgsz),
            "--batch-size", str(opt.val_batch_size), "--device", "cpu", "--workers", str(opt.workers)]
    args += ["--project", str(out), "--exist-ok"]
    return args if tool == "yolov5" else [*args, "--noplots", *_ours_extra(opt)]


def run_tool(tool: str, opt: argparse.Namespace, work: Path, names: dict[int, str], round_: int) -> dict:
    """Train then validate standalone with one tool (fresh dataset copy and run folder); return its figures."""
    base = work / tool / f"round{round_}"
    root, _ = private_dataset(base / "shapes", opt.n_train, opt.n_val)
    data_yaml = write_yaml(base / "data.yaml", {"path": str(root), "train": "images/train", "val": "images/val",
                                                "names": names})
    hyp = work / tool / "hyp.yaml"
    if tool == "ours":
        python, env = sys.executable, base_env()
    else:
        python, env = opt.yolov5_python, yolov5_env(work, opt.yolov5_python)
    n_val = len(list((root / "images" / "val").glob("*.jpg")))
    tr = run_shim(python, f"{tool}-train", train_args(tool, opt, data_yaml, hyp, base / "runs"), env, base)
    train_s, val_s, after = epoch_times(tr)
    if len(train_s) != opt.epochs or len(val_s) != opt.epochs:
        raise SystemExit(f"{tool}: expected {opt.epochs} timed epochs and validations, got {len(train_s)} and "
                         f"{len(val_s)}; log: {tr['log']}")
    weights = base / "runs" / "train" / "weights" / "last.pt"
    va = run_shim(python, f"{tool}-val", val_args(tool, opt, weights, data_yaml, base / "val-runs"), env, base)
    (ev,) = [e for e in va["events"] if e["what"] == "val.py"]
    first_epoch = min(e["start"] for e in tr["events"] if e["what"] == "train")
    return {"train_s": train_s, "val_s": val_s, "after_s": after, "setup_s": first_epoch, "total_s": tr["wall"],
            "train_threads": tr["extra"]["threads"], "valpy_s": ev["end"] - ev["start"], "valpy_wall": va["wall"],
            "valpy_speed": va["extra"]["speed_ms"], "valpy_map": va["extra"]["map"],
            "valpy_map50": va["extra"]["map50"], "n_train": len(list((root / "images" / "train").glob("*.jpg"))),
            "n_val": n_val, "val_threads": va["extra"]["threads"]}


def best_of(rounds: list[dict]) -> dict:
    """One tool's figures over several rounds: the best (smallest) time of each, per epoch where listed.

    On a shared machine every disturbance only adds time, so the best round is the closest to
    the undisturbed figure; counts, accuracy and threads come from the first round.
    """
    out = dict(rounds[0])
    for key in ("train_s", "val_s", "valpy_speed"):
        out[key] = [min(vals) for vals in zip(*(r[key] for r in rounds))]
    for key in ("after_s", "setup_s", "total_s", "valpy_s", "valpy_wall"):
        out[key] = min(r[key] for r in rounds)
    out["rounds"] = len(rounds)
    return out


# ---------------------------------------------------------------------------------------------- report


def report(res: dict[str, dict], opt: argparse.Namespace) -> str:
    """Both tools' figures and the ratio yolov5 time / our time (> 1: ours is faster)."""
    o, y = res.get("ours"), res.get("yolov5")
    any_ = o or y
    rows: list[tuple[str, str, Any, Any, bool]] = [  # label, unit format, ours, yolov5, time-like (ratio)
        ("train s/epoch (steady)", "{:.1f}", steady, "train_s", True),
        ("train img/s (steady)", "{:.1f}", None, "train_ips", False),
        ("val s/epoch (steady)", "{:.2f}", steady, "val_s", True),
        ("val img/s (in training)", "{:.1f}", None, "val_ips", False),
        ("set-up s (start -> epoch 1)", "{:.1f}", None, "setup_s", True),
        ("whole training run s", "{:.1f}", None, "total_s", True),
        ("val.py s (load -> results)", "{:.2f}", None, "valpy_s", True),
        ("val.py img/s", "{:.1f}", None, "valpy_ips", False),
        ("val.py ms/img pre-process", "{:.2f}", None, "pre", True),
        ("val.py ms/img inference", "{:.2f}", None, "inf", True),
        ("val.py ms/img NMS", "{:.2f}", None, "nms", True),
        ("val.py mAP50-95 (sanity)", "{:.4f}", None, "valpy_map", None),
        ("torch threads (train, val.py)", "{}", None, "threads", None),
    ]

    def value(r: dict | None, key: str, agg) -> Any:
        if r is None:
            return None
        derived = {"train_ips": r["n_train"] / steady(r["train_s"]), "val_ips": r["n_val"] / steady(r["val_s"]),
                   "valpy_ips": r["n_val"] / r["valpy_s"], "pre": r["valpy_speed"][0], "inf": r["valpy_speed"][1],
                   "nms": r["valpy_speed"][2], "threads": f"{r['train_threads']}, {r['val_threads']}"}
        v = derived[key] if key in derived else r[key]
        return agg(v) if agg else v

    lines = [f"yolov5{opt.model}, {any_['n_train']} train / {any_['n_val']} val images, {opt.imgsz}px, batch "
             f"{opt.batch_size}, {opt.epochs} epoch(s), workers {opt.workers}, seed {opt.seed}, CPU; "
             f"best of {any_['rounds']} round(s)" + ("" if opt.channels_last is None else
                                                     f"; ours with --{'' if opt.channels_last else 'no-'}channels-last"),
             f"{'':<31}{'ours':>10}{'yolov5':>10}{'yolov5/ours':>13}", "-" * 64]
    for label, fmt, agg, key, time_like in rows:
        a, b = value(o, key, agg), value(y, key, agg)
        cell = lambda v: fmt.format(v) if v is not None else "-"  # noqa: E731
        ratio = ""
        if a is not None and b is not None and time_like is not None and min(a, b) >= 0.01:  # not 0.00 ms
            ratio = f"{(b / a) if time_like else (a / b):.2f}x"  # both read as: how much faster ours is
        lines.append(f"{label:<31}{cell(a):>10}{cell(b):>10}{ratio:>13}")
    for name, r in res.items():
        lines.append(f"{name} (best per epoch): train s {[round(x, 1) for x in r['train_s']]}, val s "
                     f"{[round(x, 2) for x in r['val_s']]}, validation after training {r['after_s']:.1f}s")
    lines.append("yolov5/ours: time ratios as yolov5 time / our time and rates as our rate / yolov5 rate, "
                 "so > 1 means ours is faster.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    opt = parse_args(argv)
    if not Path(opt.yolov5_python).is_file():
        raise SystemExit(f"--yolov5-python {opt.yolov5_python}: not found (see this script's docstring)")
    work = Path(opt.work_dir) if opt.work_dir else Path(tempfile.mkdtemp(prefix="compare_yolov5_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir: {work}", flush=True)
    try:
        hyp_files(work)
        from yolotrain.utils.data.config import load_data_config

        names = dict(enumerate(load_data_config(ROOT / "data" / "shapes.yaml").names))
        tools = [t for t in ("ours", "yolov5") if opt.only in (None, t)]
        runs: dict[str, list[dict]] = {t: [] for t in tools}
        for r in range(opt.rounds):  # alternate the order, so neither tool always runs first
            for tool in (tools if r % 2 == 0 else tools[::-1]):
                runs[tool].append(run_tool(tool, opt, work, names, r))
        res = {t: best_of(rs) for t, rs in runs.items()}
        print()
        print(report(res, opt))
        (work / "results.json").write_text(json.dumps(runs, indent=1))
    finally:
        if opt.work_dir is None and not opt.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
