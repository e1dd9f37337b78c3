"""YOLOv10 (the v10Detect head, YOLOv10's loss) through the unchanged engine: one tiny epoch trains, its
checkpoint rebuilds from its own yaml, and val.py scores it end-to-end (no NMS)."""
from __future__ import annotations

import csv
import math
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_env

pytestmark = pytest.mark.slow  # a subprocess training run

ARGS = ["--cfg", "models/yolov10n.yaml", "--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers",
        "0", "--seed", "3", "--epochs", "1", "--noplots"]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.run(args, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_yolov10n_trains_one_epoch_and_validates_end_to_end(tiny_data, tmp_path):
    _run([sys.executable, "train.py", "--data", str(tiny_data), "--project", str(tmp_path), "--name", "v10", *ARGS])
    run = tmp_path / "v10"
    rows = list(csv.DictReader(open(run / "results.csv")))
    losses = {k.strip(): float(v) for k, v in rows[-1].items() if k.strip().endswith("_loss")}
    assert set(losses) >= {"train/box_loss", "train/cls_loss", "train/dfl_loss"}
    assert all(math.isfinite(v) and v > 0 for k, v in losses.items() if k.startswith("train/"))
    ckpt = torch.load(run / "weights" / "last.pt", weights_only=True)
    assert ckpt["model_yaml"]["head"][-1][2] == "v10Detect" and ckpt["model_yaml"]["scale"] == "n"
    p = _run([sys.executable, "val.py", "--weights", str(run / "weights" / "last.pt"), "--data", str(tiny_data),
              "--imgsz", "64", "--batch-size", "4", "--workers", "0", "--noplots"])
    assert re.search(r"^Results: mAP50 [0-9.]+  mAP50-95 [0-9.]+$", p.stdout, re.M)
