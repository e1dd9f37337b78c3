"""The anchor-free family (YOLOv8 / YOLO11 heads with DFL and task-aligned assignment) through the
unchanged engine: torchrun training, val.py equal on 1 and 2 ranks, and the checkpoint rebuilt from its own
yaml. (A killed yolov8n run resuming bit-exactly: tests/test_resume.py, whose runs train the default yolov8n.)"""
from __future__ import annotations

import csv
import re

import pytest
import torch

from tests.helpers import PYTHON, TINY, TORCHRUN, load, run, run_train, train_here, val_here

pytestmark = pytest.mark.slow  # training runs

ARGS = [*TINY, "--epochs", "3", "--noplots"]


@pytest.mark.dist
def test_yolov8n_trains_under_torchrun_and_val_py_agrees_on_one_and_two_ranks(tiny_data, tmp_path):
    run_train(TORCHRUN, tiny_data, tmp_path, "v8", "--cfg", "models/yolov8n.yaml", *ARGS)
    run_dir = tmp_path / "v8"
    header = next(csv.reader(open(run_dir / "results.csv")))
    assert [h for h in header if h.endswith("_loss")] == ["train/box_loss", "train/cls_loss", "train/dfl_loss",
                                                          "val/box_loss", "val/cls_loss", "val/dfl_loss"]
    ckpt = load(run_dir / "weights" / "last.pt")
    assert ckpt["world_size"] == 2 and "anchors" not in ckpt["model_yaml"] and ckpt["model_yaml"]["scale"] == "n"
    assert (run_dir / "hyp.yaml").read_text().count("box: 7.5") == 1  # the family's own recipe by default
    results = []
    for launcher in ([PYTHON], TORCHRUN):
        p = run([*launcher, "val.py", "--weights", run_dir / "weights" / "last.pt", "--data", tiny_data,
                 "--batch-size", "2", "--workers", "0", "--noplots"])
        results.append(re.findall(r"^Results: .*$", p.stdout, re.M)[-1])
    assert results[0] == results[1]


def test_yolo11n_trains_and_its_checkpoint_rebuilds(tiny_data, tmp_path, capsys, restore_logger):
    result = train_here("--data", tiny_data, "--cfg", "models/yolo11n.yaml", "--project", tmp_path, "--name", "y11",
                        *ARGS, "--epochs", "1")
    assert torch.load(result.best, weights_only=True)["model_yaml"]["scale"] == "n"
    val_here("--weights", result.best, "--data", tiny_data, "--workers", "0", "--noplots")
    assert re.search(r"^Results: mAP50 [0-9.]+  mAP50-95 [0-9.]+$", capsys.readouterr().out, re.M)
