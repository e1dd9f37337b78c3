"""YOLOv10 (the v10Detect head, YOLOv10's loss) through the unchanged engine: one tiny epoch trains, its
checkpoint rebuilds from its own yaml, and val.py scores it end-to-end (no NMS)."""
from __future__ import annotations

import csv
import math
import re

import pytest

from tests.helpers import TINY, load, train_here, val_here

pytestmark = pytest.mark.slow  # a training run


def test_yolov10n_trains_one_epoch_and_validates_end_to_end(tiny_data, tmp_path, capsys, restore_logger):
    result = train_here("--data", tiny_data, "--project", tmp_path, "--name", "v10", "--cfg", "models/yolov10n.yaml",
                        *TINY, "--epochs", "1", "--noplots")
    rows = list(csv.DictReader(open(result.save_dir / "results.csv")))
    losses = {k.strip(): float(v) for k, v in rows[-1].items() if k.strip().endswith("_loss")}
    assert set(losses) >= {"train/box_loss", "train/cls_loss", "train/dfl_loss"}
    assert all(math.isfinite(v) and v > 0 for k, v in losses.items() if k.startswith("train/"))
    ckpt = load(result.last)
    assert ckpt["model_yaml"]["head"][-1][2] == "v10Detect" and ckpt["model_yaml"]["scale"] == "n"
    capsys.readouterr()
    val_here("--weights", result.last, "--data", tiny_data, "--imgsz", "64", "--batch-size", "4", "--workers", "0",
             "--noplots")
    assert re.search(r"^Results: mAP50 [0-9.]+  mAP50-95 [0-9.]+$", capsys.readouterr().out, re.M)
