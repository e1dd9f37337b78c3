"""bench/gpu_train.py on the CPU: its figures from batch stamps, its flags, its report, and smoke runs.

The smoke runs train at toy sizes (--device cpu: not GPU figures), so they check that every
variant and worker count runs and reports numbers, not what the numbers are. The two-tool run needs
Ultralytics 8.4.190 in another interpreter, named by YOLOTRAIN_ULTRALYTICS_PYTHON; it is skipped
without one.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_train
from bench.gpu_train import Contender, ULTRALYTICS
from tests.helpers import ROOT, run_env

pytestmark = pytest.mark.bench  # `pytest bench/tests` (CI's second step), not the product's suite

TINY = ["--device", "cpu", "--models", "yolov8n", "--imgsz", "64", "--batch-size", "4", "--steps", "4", "--warmup",
        "1", "--n-val", "8", "--epochs", "1", "--workers", "0", "1", "--ref-seconds", "0.1"]
VARIANTS = {"base": "", "cos": "--cos-lr"}
CELL = re.compile(r"(\d+\.\d) \((\d+\.\d)%\)")  # a curve cell: img/s (data wait)


# ---------------------------------------------------------------------------------------------- figures


def test_step_figures_time_the_steps_after_warmup_but_not_the_last():
    # step k runs from asks[k] to the next ask (the last: the epoch's end); the first (warm-up) and last are untimed
    ep = {"asks": [0.0, 1.0, 3.0, 6.0], "gots": [0.5, 1.2, 3.1, 6.1], "end": 10.0}
    cut_short = {"asks": [20.0, 21.0, 22.0], "gots": [20.1, 21.1, 22.1], "end": None}
    out = gpu_train.step_figures([ep, cut_short], warmup=1, batch=4)
    assert out["timed_steps"] == 2
    assert out["train_img_s"] == pytest.approx(8 / 5.0)  # steps 1 and 2: 2 s + 3 s
    assert out["data_wait"] == pytest.approx((0.2 + 0.1) / 5.0)


def test_the_feeds_share_counts_only_its_time_inside_the_timed_waits():
    """Ours queues each next batch's copy and drawing inside the wait for it: that part of the timed waits."""
    ep = {"asks": [0.0, 1.0, 3.0, 6.0], "gots": [0.5, 1.2, 3.1, 6.1], "end": 10.0}
    feeds = [(0.1, 0.4), (1.05, 1.15), (2.95, 3.05), (4.0, 5.0)]  # warm-up, inside, half inside, in a step
    out = gpu_train.step_figures([ep], warmup=1, batch=4, feeds=feeds)
    assert out["feed_wait"] == pytest.approx((0.1 + 0.05) / 5.0)
    assert gpu_train.step_figures([ep], warmup=1, batch=4)["feed_wait"] is None  # Ultralytics: none recorded


def test_the_ahead_share_counts_only_its_time_inside_the_timed_steps():
    """Ours fetches the next batch from inside the step (DeviceFeed.ahead): that part of the timed steps' own
    time, not of their waits, and not of the untimed warm-up or last step."""
    ep = {"asks": [0.0, 1.0, 3.0, 6.0], "gots": [0.5, 1.2, 3.1, 6.1], "end": 10.0}
    aheads = [(0.6, 0.9), (1.1, 1.5), (2.0, 2.5), (3.1, 3.3), (7.0, 8.0)]  # warm-up, half in a wait, in, in, last
    out = gpu_train.step_figures([ep], warmup=1, batch=4, aheads=aheads)
    assert out["ahead_share"] == pytest.approx((0.3 + 0.5 + 0.2) / 5.0)
    assert gpu_train.step_figures([ep], warmup=1, batch=4)["ahead_share"] is None  # Ultralytics: none recorded


def test_step_figures_without_timed_steps_say_so():
    ep = {"asks": [0.0, 1.0], "gots": [0.1, 1.1], "end": 2.0}
    with pytest.raises(SystemExit, match="no timed steps"):
        gpu_train.step_figures([ep], warmup=1, batch=4)


def test_val_figures_count_the_validation_after_each_epoch_from_epoch_two():
    epochs = [{"end": 10.0}, {"end": 20.0}, {"end": 30.0}]
    vals = [{"start": 11.0, "end": 13.0, "n": 8}, {"start": 21.0, "end": 22.0, "n": 8},
            {"start": 31.0, "end": 35.0, "n": 8},
            {"start": 40.0, "end": 100.0, "n": 8}]  # Ultralytics' final validation of best.pt: left out
    assert gpu_train.val_figures(vals, epochs) == pytest.approx(16 / 5.0)
    assert gpu_train.val_figures(vals[:1], epochs[:1]) == pytest.approx(8 / 2.0)  # one epoch: its own
    assert math.isnan(gpu_train.val_figures([], epochs))


@pytest.mark.parametrize("recorded, expected", [
    ({"quantize": 16}, "fp16 autocast"),  # 8.4 in training under AMP on CUDA: fp32 weights under autocast
    ({"quantize": None}, "fp32"),
    ({"quantize": 32}, "fp32"),
    ({"quantize": 8}, "quantize=8"),
    ({"half": True}, "fp16 weights"),  # before 8.4: the model itself in half
    ({"half": False}, "fp32"),
    ({"quantize": None, "half": True}, "fp32"),  # quantize is the one 8.4's validator reads
    ({}, "fp32"),
])
def test_ultralytics_val_precision_reads_quantize_or_half(recorded, expected):
    assert gpu_train.ultralytics_val_precision(recorded) == expected


def test_ultralytics_validation_precision_comes_from_the_validations_in_training():
    epochs = [{"end": 10.0}, {"end": 20.0}]
    vals = [{"start": 11.0, "end": 12.0, "n": 8, "precision": {"quantize": 16}},
            {"start": 21.0, "end": 22.0, "n": 8, "precision": {"quantize": 16}},
            {"start": 30.0, "end": 31.0, "n": 8, "precision": {"quantize": None}}]  # best.pt's, after training
    assert gpu_train.val_precision(ULTRALYTICS, {"epochs": epochs, "vals": vals}) == "fp16 autocast"


# ---------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize("name", ["yolov5n", "yolov5su", "yolov8m", "yolo11x", "yolo26n", "yolo26l", "yolov10n",
                                  "yolov10b"])
def test_models_accept_every_family(name):
    assert gpu_train.build_parser().parse_args(["--models", name]).models == [name]


@pytest.mark.parametrize("name", ["yolo26b", "yolov10", "yolov9n", "yolov8nu"])
def test_models_refuse_unknown_names(name, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_train.build_parser().parse_args(["--models", name])
    assert e.value.code == 2 and name in capsys.readouterr().err


def test_ours_variants_split_their_flags_and_default_to_one_plain_run():
    p = gpu_train.build_parser()
    opt = p.parse_args(["--ours-variant", 'a=--cos-lr --name "x y"', "--ours-variant", "b=", "--workers", "2", "4"])
    assert opt.ours_variant == [Contender("a", "ours", ("--cos-lr", "--name", "x y")), Contender("b", "ours", ())]
    assert opt.workers == [2, 4]
    plain = p.parse_args([])
    assert [c.label for c in gpu_train.contenders(plain, p)] == ["ours", ULTRALYTICS]
    only = p.parse_args(["--only", "ours", "--ours-variant", "c=--cos-lr"])
    assert gpu_train.contenders(only, p) == [Contender("c", "ours", ("--cos-lr",))]


@pytest.mark.parametrize("variants, message", [
    (["a=", "a=--cos-lr"], "names must differ"),
    (["a=--no-such-flag"], "train.py refuses them"),
    (["a=--workers 2"], "--workers, which gpu_train.py sets"),
    (["a=--img 64 --batch 8"], "--imgsz, --batch-size, which gpu_train.py sets"),
])
def test_bad_ours_variants_stop_before_anything_runs(variants, message, capsys):
    p = gpu_train.build_parser()
    opt = p.parse_args([a for v in variants for a in ("--ours-variant", v)])
    with pytest.raises(SystemExit) as e:
        gpu_train.contenders(opt, p)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("text", ["noequals", "=--cos-lr", "ultralytics=", "a b=", "a='unclosed"])
def test_ours_variant_refuses_bad_names_and_quoting(text):
    p = gpu_train.build_parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--ours-variant", text])


def test_cache_and_variant_flags_reach_both_tools():
    opt = gpu_train.build_parser().parse_args(["--cache", "disk", "--imgsz", "64"])
    ours = gpu_train.ours_args("yolo26n", opt, 3, "0", Path("d.yaml"), Path("p"), ("--cache", "ram", "--cos-lr"))
    assert ours[-5:] == ["--cache", "disk", "--cache", "ram", "--cos-lr"]  # the variant's own --cache comes last
    assert ours[ours.index("--workers") + 1] == "3" and ours[ours.index("--cfg") + 1].endswith("models/yolo26n.yaml")
    ultra = gpu_train.ultralytics_args("yolov10n", opt, 3, "0", Path("d.yaml"), Path("p"))
    assert {"cache=disk", "workers=3", "model=yolov10n.yaml", "amp=True"} <= set(ultra)


# ---------------------------------------------------------------------------------------------- report


def _figures(img_s: float, wait: float, workers: int, tool: str = "ours") -> dict:
    return {"train_img_s": img_s, "data_wait": wait, "timed_steps": 10, "val_img_s": float("nan"),
            "peak_gpu_mib": 100.0, "peak_rss_mib": 900.0, "train_gflops_per_img": 1.0, "achieved_tflops": 0.5,
            "mfu_vendor": None, "mfu_matmul": 0.1, "amp": True, "workers": workers, "ran_on": "cuda:0",
            "val_precision": "fp16 autocast" if tool == ULTRALYTICS else "fp16 weights", "tool": tool, "flags": []}


def test_report_prints_the_worker_curve_with_ratios_and_the_full_table_at_the_most_workers():
    res = {w: {"a": _figures(100.0 * w, 0.1, w), "b": _figures(150.0 * w, 0.05, w),
               ULTRALYTICS: _figures(50.0 * w, 0.2, min(w, 4), ULTRALYTICS)} for w in (2, 8)}
    text = gpu_train.report("yolov8n", res, torch.device("cuda", 0))
    rows = {int(line.split()[0]): line for line in text.splitlines() if re.match(r"\s+\d+ ", line)}
    assert CELL.findall(rows[2]) == [("200.0", "10.0"), ("300.0", "5.0"), ("100.0", "20.0")]
    assert re.findall(r"\d+\.\d\dx", rows[8]) == ["2.00x", "3.00x"]
    assert "ultralytics used other loader worker counts than asked: 4 for 8" in text
    assert "every figure at --workers 8" in text and "a/ultra" in text and "b/ultra" in text
    assert "ultralytics: train fp16 AMP, validation fp16 autocast" in text


# ---------------------------------------------------------------------------------------------- smoke runs


def _bench(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess,
                                                                                         dict]:
    """Run the script at toy sizes on the built-in shapes (--photo-cache points nowhere); its output and json."""
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_train.py"), *TINY, "--photo-cache", str(tmp_path / "none"),
           "--workdir", str(tmp_path / "work"), "--json", str(out),
           *[a for name, flags in VARIANTS.items() for a in ("--ours-variant", f"{name}={flags}")], *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env or run_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p, json.loads(out.read_text())


def _curve(stdout: str) -> tuple[list[str], dict[int, str]]:
    """The yolov8n worker curve: its column labels and its rows by worker count."""
    lines = stdout.splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith("yolov8n: train img/s (data wait)"))
    labels = lines[at + 1].split()[1:]
    rows = {}
    for line in lines[at + 2:]:
        if not re.match(r"\s+\d+ ", line):
            break
        rows[int(line.split()[0])] = line
    return labels, rows


def _check_figures(results: dict, labels: list[str]) -> None:
    for workers in ("0", "1"):
        for label in labels:
            r = results["yolov8n"][workers][label]
            for key in ("train_img_s", "val_img_s", "peak_rss_mib", "train_gflops_per_img", "mfu_matmul"):
                assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, (workers, label, key)
            assert 0 <= r["data_wait"] < 1 and r["timed_steps"] == 2


@pytest.mark.slow
def test_ours_smoke_runs_every_variant_at_every_worker_count(tmp_path):
    p, fig = _bench(["--only", "ours"], tmp_path)
    labels, rows = _curve(p.stdout)
    assert labels == list(VARIANTS) and sorted(rows) == [0, 1]
    for line in rows.values():
        assert len(CELL.findall(line)) == len(VARIANTS) and "x" not in line  # no Ultralytics: no ratio
    assert "CPU RUN" in p.stdout and "every figure at --workers 1" in p.stdout
    assert "cos: train " in p.stdout and "flags --cos-lr" in p.stdout
    _check_figures(fig["results"], list(VARIANTS))
    assert {fig["results"]["yolov8n"][w]["base"]["workers"] for w in ("0", "1")} == {0, 1}
    assert fig["results"]["yolov8n"]["1"]["cos"]["flags"] == ["--cos-lr"]


def _ultralytics_python() -> str | None:
    """YOLOTRAIN_ULTRALYTICS_PYTHON when that interpreter can import ultralytics (found, not imported)."""
    python = os.environ.get("YOLOTRAIN_ULTRALYTICS_PYTHON")
    if not python:
        return None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('ultralytics') is None)"
    ok = subprocess.run([python, "-c", probe], capture_output=True).returncode == 0
    return python if ok else None


@pytest.mark.slow
@pytest.mark.skipif(_ultralytics_python() is None,
                    reason="set YOLOTRAIN_ULTRALYTICS_PYTHON to a python that can import ultralytics")
def test_both_tools_smoke_compares_every_variant_with_ultralytics(tmp_path):
    p, fig = _bench(["--ultralytics-python", _ultralytics_python()], tmp_path)
    labels, rows = _curve(p.stdout)
    assert labels == [*VARIANTS, ULTRALYTICS] and sorted(rows) == [0, 1]
    for line in rows.values():
        assert len(CELL.findall(line)) == len(VARIANTS) + 1
        assert len(re.findall(r"\d+\.\d\dx", line)) == len(VARIANTS)
    _check_figures(fig["results"], [*VARIANTS, ULTRALYTICS])
    ultra = fig["results"]["yolov8n"]["1"][ULTRALYTICS]
    assert ultra["workers"] == 0 and ultra["val_precision"] == "fp32"  # on CPU: no loader workers, no fp16
    assert "ultralytics used other loader worker counts than asked: 0 for 1" in p.stdout
