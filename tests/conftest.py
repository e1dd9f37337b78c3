"""Shared fixtures: the repo root, a subprocess environment and a tiny generated dataset.

The repo is importable through pyproject.toml's pytest ``pythonpath``, so nothing here edits sys.path.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def run_env() -> dict:
    """Environment for subprocess runs: repo importable, one thread per process on the 2-core CI box."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


def pytest_collection_modifyitems(config, items) -> None:
    """Skip ``cuda`` tests where CUDA is missing, and ``cuda(devices=2)`` ones below two GPUs, so the
    GPU checks sit beside their CPU twins and run wherever a GPU is present."""
    marked = [(item, item.get_closest_marker("cuda")) for item in items]
    marked = [(item, m) for item, m in marked if m is not None]
    if not marked:
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item, mark in marked:
        need = int(mark.kwargs.get("devices", mark.args[0] if mark.args else 1))
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), {have} here"))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: tiny convs run far faster than with threads fighting for 2 busy cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_val_split(root: Path, n: int, hw: tuple[int, int], shade) -> Path:
    """``root``/images/val with ``n`` flat-grey jpgs (image k has pixel value ``shade(k)``), each with one centred
    box in ``root``/labels/val; returns the images folder."""
    import cv2
    import numpy as np

    imgs, lbls = root / "images" / "val", root / "labels" / "val"
    imgs.mkdir(parents=True)
    lbls.mkdir(parents=True)
    for k in range(n):
        cv2.imwrite(str(imgs / f"{k}.jpg"), np.full((*hw, 3), shade(k), np.uint8))
        (lbls / f"{k}.txt").write_text("0 0.5 0.5 0.4 0.4\n")
    return imgs


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A tiny built-in shapes dataset yaml (generated on first use, like the real one)."""
    root = tmp_path_factory.mktemp("tiny")
    yaml_file = root / "tiny.yaml"
    yaml_file.write_text(
        "path: shapes\ntrain: images/train\nval: images/val\n"
        "names: {0: circle, 1: square, 2: triangle, 3: star, 4: cross, 5: ring}\n"
        "generate: shapes\ngenerate_args: {seed: 1, n_train: 16, n_val: 8, img_size: 96}\n"
    )
    return yaml_file


def _train_confident(data: Path, project: Path, cfg: str) -> Path:
    """best.pt of a 1-epoch run at imgsz 64 on ``data``, its head biases raised so it detects at conf 0.25.

    One epoch from scratch finds nothing above 0.25; with objectness (anchor head) or class scores
    (anchor-free head) lifted it draws boxes, some on objects, so detections and mAP are non-zero.
    """
    import re
    import subprocess

    from utils.weights.checkpoint import load_checkpoint, save_checkpoint

    args = ["--epochs", "1", "--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0",
            "--seed", "3", "--noplots"]
    name = Path(cfg).stem
    p = subprocess.run([PYTHON, "train.py", "--data", str(data), "--cfg", cfg, "--project", str(project), "--name",
                        name, *args], cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    path = project / name / "weights" / "best.pt"
    ckpt = load_checkpoint(path)
    nc = ckpt["model_yaml"]["nc"]
    for state in (ckpt["model"], ckpt["ema"]):
        anchor = [k for k in state if re.fullmatch(r"model\.\d+\.m\.\d+\.bias", k) and state[k].numel() == 3 * (nc + 5)]
        dfl = [k for k in state if re.fullmatch(r"model\.\d+\.cv3\.\d+\.2\.bias", k) and state[k].numel() == nc]
        assert len(anchor) == 3 or len(dfl) == 3, (anchor, dfl)
        for k in anchor:
            b = state[k].view(3, nc + 5)
            b[:, 4] += 6.0  # objectness
            b[:, 5:] += 2.0  # class scores
        for k in dfl:
            state[k] += 8.0  # class scores
    save_checkpoint(ckpt, path)
    return path


@pytest.fixture(scope="session")
def tiny_v5n(tiny_data, tmp_path_factory) -> Path:
    """An anchor-based (YOLOv5n) tiny_data checkpoint that detects at conf 0.25 (see _train_confident)."""
    return _train_confident(tiny_data, tmp_path_factory.mktemp("v5n"), "models/yolov5n.yaml")


@pytest.fixture(scope="session")
def tiny_v8n(tiny_data, tmp_path_factory) -> Path:
    """An anchor-free (YOLOv8n) tiny_data checkpoint that detects at conf 0.25 (see _train_confident)."""
    return _train_confident(tiny_data, tmp_path_factory.mktemp("v8n"), "models/yolov8n.yaml")


@pytest.fixture
def restore_logger():
    """The CLI attaches a handler to the project logger; later tests must not write to this test's capture."""
    from utils.core.logging import LOGGER

    saved = list(LOGGER.handlers), LOGGER.level, LOGGER.propagate
    yield
    LOGGER.handlers[:] = saved[0]
    LOGGER.setLevel(saved[1])
    LOGGER.propagate = saved[2]


@pytest.fixture
def project_log(restore_logger) -> list[str]:
    """The messages the project logger emits at INFO and above during the test, whether or not it propagates
    (a CLI run earlier in the session turns propagation off, which would leave ``caplog`` empty). A CLI run
    inside the test replaces the logger's handlers: ask for this fixture after it."""
    import logging

    from utils.core.logging import LOGGER

    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    yield messages
    LOGGER.removeHandler(handler)
