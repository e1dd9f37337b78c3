"""The anchor-free family (YOLOv8 / YOLO11 heads with DFL and task-aligned assignment) through the
unchanged engine: torchrun training, a mid-epoch kill resumed bit-exactly, val.py equal on 1 and 2
ranks, and the checkpoint rebuilt from its own yaml."""
from __future__ import annotations

import csv
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_env

pytestmark = pytest.mark.slow  # subprocess training runs

ARGS = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0", "--seed", "7",
        "--epochs", "3", "--noplots"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run(args, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _train(launcher: list[str], data, project, name: str, cfg: str, extra=(), script=("train.py",)):
    return _run([*launcher, *script, "--data", str(data), "--cfg", cfg, "--project", str(project), "--name", name,
                 *ARGS, *extra])


@pytest.mark.dist
def test_yolov8n_trains_under_torchrun_and_val_py_agrees_on_one_and_two_ranks(tiny_data, tmp_path):
    _train(TORCHRUN, tiny_data, tmp_path, "v8", "models/yolov8n.yaml")
    run = tmp_path / "v8"
    header = next(csv.reader(open(run / "results.csv")))
    assert [h for h in header if h.endswith("_loss")] == ["train/box_loss", "train/cls_loss", "train/dfl_loss",
                                                          "val/box_loss", "val/cls_loss", "val/dfl_loss"]
    ckpt = torch.load(run / "weights" / "last.pt", weights_only=True)
    assert ckpt["world_size"] == 2 and "anchors" not in ckpt["model_yaml"] and ckpt["model_yaml"]["scale"] == "n"
    assert (run / "hyp.yaml").read_text().count("box: 7.5") == 1  # the family's own recipe by default
    results = []
    for launcher in ([sys.executable], TORCHRUN):
        p = _run([*launcher, "val.py", "--weights", str(run / "weights" / "last.pt"), "--data", str(tiny_data),
                  "--batch-size", "2", "--workers", "0", "--noplots"])
        results.append(re.findall(r"^Results: .*$", p.stdout, re.M)[-1])
    assert results[0] == results[1]


def test_yolov8n_mid_epoch_kill_resumes_bit_exactly(tiny_data, tmp_path):
    straight = tmp_path / "straight"
    _train([sys.executable], tiny_data, tmp_path, "straight", "models/yolov8n.yaml")
    p = subprocess.run([sys.executable, "tests/scripts/die_after_save.py", "--die-at", "2:2", "--data",
                        str(tiny_data), "--cfg", "models/yolov8n.yaml", "--project", str(tmp_path), "--name", "killed",
                        *ARGS, "--save-interval", "1e-9"], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 137, p.stdout[-2000:] + p.stderr[-2000:]
    last = tmp_path / "killed" / "weights" / "last.pt"
    assert torch.load(last, weights_only=True)["batches_done"] == 2
    resumed = _run([sys.executable, "train.py", "--resume", str(last)])
    assert "Resuming" in resumed.stdout
    a = torch.load(straight / "weights" / "last.pt", weights_only=True)
    b = torch.load(last, weights_only=True)
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key])
    assert a["metrics"] == b["metrics"]


def test_yolo11n_trains_and_its_checkpoint_rebuilds(tiny_data, tmp_path):
    _train([sys.executable], tiny_data, tmp_path, "y11", "models/yolo11n.yaml", extra=["--epochs", "1"])
    p = _run([sys.executable, "val.py", "--weights", str(tmp_path / "y11" / "weights" / "best.pt"), "--data",
              str(tiny_data), "--workers", "0", "--noplots"])
    assert re.search(r"^Results: mAP50 [0-9.]+  mAP50-95 [0-9.]+$", p.stdout, re.M)
