"""train.py's defaults by purpose: the quick demo on the built-in set, YOLOv5's and Ultralytics' sizes on a
user's data; a resumed run keeps what it recorded; the checkpoint records the size it trained at."""
from __future__ import annotations


import pytest
import torch

from tests.helpers import train_here, val_here
from yolotrain.utils.engine.config import DEMO_DATA, SIZE_DEFAULTS, size_defaults


def test_the_built_in_demo_keeps_its_quick_sizes():
    out = size_defaults({"data": str(DEMO_DATA), "imgsz": None, "epochs": None})
    assert (out["imgsz"], out["epochs"], out["sized_for"]) == (256, 8, "demo")


def test_your_data_trains_at_640_for_100_epochs(tmp_path):
    out = size_defaults({"data": str(tmp_path / "my.yaml"), "imgsz": None, "epochs": None})
    assert (out["imgsz"], out["epochs"], out["sized_for"]) == (640, 100, "your data") == \
        (*SIZE_DEFAULTS["your data"].values(), "your data")


def test_given_values_stand_and_only_the_missing_one_is_filled(tmp_path):
    both = size_defaults({"data": str(tmp_path / "my.yaml"), "imgsz": 416, "epochs": 7})
    assert (both["imgsz"], both["epochs"], both["sized_for"]) == (416, 7, None)
    one = size_defaults({"data": str(DEMO_DATA), "imgsz": 160, "epochs": None})
    assert (one["imgsz"], one["epochs"], one["sized_for"]) == (160, 8, "demo")


def test_a_resumed_run_keeps_its_recorded_sizes(tmp_path):
    """The merge puts the checkpoint's arguments over the parser's Nones: nothing is left to fill."""
    saved = {"data": str(tmp_path / "my.yaml"), "imgsz": 320, "epochs": 15}
    merged = size_defaults({**{"imgsz": None, "epochs": None}, **saved})
    assert (merged["imgsz"], merged["epochs"]) == (320, 15)


@pytest.mark.slow
def test_the_checkpoint_records_the_size_trained_at_and_val_py_uses_it(tiny_data, tmp_path, capsys, restore_logger):
    """--imgsz 60 trains at 64 (the stride's multiple): last.pt says 64, and val.py scores at 64."""
    result = train_here("--data", tiny_data, "--imgsz", "60", "--epochs", "1", "--batch-size", "4", "--workers", "0",
                        "--noplots", "--project", tmp_path, "--name", "odd")
    captured = capsys.readouterr()
    assert "Training 1 epochs of 64 px images" in captured.out + captured.err
    assert torch.load(result.last, map_location="cpu", weights_only=True)["args"]["imgsz"] == 64
    val_here("--weights", result.last, "--data", tiny_data, "--workers", "0", "--noplots", "--project", tmp_path)
    captured = capsys.readouterr()
    assert "imgsz 64" in captured.out + captured.err


def test_the_start_summary_says_which_defaults_applied():
    from types import SimpleNamespace

    from yolotrain.utils.engine.summary import sizing_note

    assert "the built-in demo's defaults: 256 px, 8 epochs" in sizing_note(SimpleNamespace(sized_for="demo"))
    assert "defaults for your own data" in sizing_note(SimpleNamespace(sized_for="your data"))
    assert sizing_note(SimpleNamespace(sized_for=None)) == ""
