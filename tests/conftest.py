"""Shared fixtures: a tiny generated dataset, shapes datasets, and runs built once per test run.

The suite runs on two processes by default (pytest-xdist, ``-n auto``): a fixture whose result is a folder on
disk (a dataset, a trained checkpoint, a reference run) is built once for the whole test run, whichever worker asks
first, under a file lock in a folder every worker sees (``once``); the others wait for it and read it.
The repo is importable through pyproject.toml's pytest ``pythonpath``, so nothing here edits sys.path.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import LAUNCHERS, PYTHON, Run, run

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker is one of as many processes as cores: one thread each, as every subprocess run has (helpers.run_env).
    # Set before torch is imported, so torch's pool starts at that size.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per usable core, at most 4 (each may run a 2-rank torchrun, 3 processes of ~1 GB)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


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


@pytest.fixture(scope="session")
def once(tmp_path_factory) -> Callable[[str, Callable[[Path], object]], Path]:
    """``once(name, build)``: the folder ``name``, filled by ``build(folder)`` the first time any worker of this test
    run asks for it; a build that fails leaves nothing, so the next asker builds again (and fails the same way)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, build: Callable[[Path], object]) -> Path:
        folder = shared / "once" / name
        folder.parent.mkdir(exist_ok=True)
        with open(f"{folder}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder.parent / f"{name}.done").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                build(folder)
                (folder.parent / f"{name}.done").touch()
        return folder

    return get


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: tiny convs run far faster than with threads fighting for 2 busy cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY_YAML = ("path: shapes\ntrain: images/train\nval: images/val\n"
             "names: {0: circle, 1: square, 2: triangle, 3: star, 4: cross, 5: ring}\n"
             "generate: shapes\ngenerate_args: {seed: 1, n_train: 16, n_val: 8, img_size: 96}\n")


@pytest.fixture(scope="session")
def tiny_data(once) -> Path:
    """A tiny built-in shapes dataset yaml (generated on first use, like the real one; shared by every worker)."""
    return once("tiny", lambda folder: (folder / "tiny.yaml").write_text(TINY_YAML)) / "tiny.yaml"


@pytest.fixture(scope="session")
def shapes_dataset(once) -> Callable[..., Path]:
    """``shapes_dataset(seed, n_train, n_val, img_size=96)``: the root of a generated shapes dataset (images/ and
    labels/ with train and val), made once per test run for each set of arguments. Read-only: copy it to edit it."""
    def get(seed: int, n_train: int, n_val: int, img_size: int = 96) -> Path:
        from yolotrain.utils.data.shapes import generate_shapes

        name = f"shapes-{seed}-{n_train}-{n_val}-{img_size}"
        return once(name, lambda folder: generate_shapes(folder / "shapes", seed=seed, n_train=n_train, n_val=n_val,
                                                         img_size=img_size)) / "shapes"

    return get


@pytest.fixture(scope="session")
def reference_run(once, tiny_data) -> Callable[..., Run]:
    """``reference_run(*flags, launcher="1-process", script=None, data=None)``: the folder of an undisturbed
    ``train.py`` run on tiny_data (or ``data``) with ``flags`` after ``--project/--name`` (a helpers.Run: its folder
    and output), trained once per test run
    and shared by every test that compares against it (the resume, stop and preemption tests). ``script`` replaces
    train.py (tests/scripts/nan_grad.py with its own arguments, say)."""
    def get(*flags: object, launcher: str = "1-process", script: tuple[str, ...] | None = None,
            data: Path | None = None) -> Run:
        data = data or tiny_data
        argv = [str(f) for f in flags]
        key = hashlib.sha1(repr((launcher, script, str(data), argv)).encode()).hexdigest()[:12]

        def build(folder: Path) -> None:
            p = run([*LAUNCHERS[launcher], *(script or ("train.py",)), "--data", data, "--project", folder, "--name",
                     "run", *argv])
            (folder / "output.txt").write_text(p.stdout + p.stderr)

        return Run(once(f"reference-{key}", build) / "run")

    return get


def _train_confident(data: Path, project: Path, cfg: str) -> Path:
    """best.pt of a 1-epoch run at imgsz 64 on ``data``, its head biases raised so it detects at conf 0.25.

    One epoch from scratch finds nothing above 0.25; with objectness (anchor head) or class scores
    (anchor-free head) lifted it draws boxes, some on objects, so detections and mAP are non-zero.
    """
    import re

    from yolotrain.utils.weights.checkpoint import load_checkpoint, save_checkpoint

    args = ["--epochs", "1", "--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0",
            "--seed", "3", "--noplots"]
    name = Path(cfg).stem
    run([PYTHON, "train.py", "--data", data, "--cfg", cfg, "--project", project, "--name", name, *args])
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
def tiny_v5n(tiny_data, once) -> Path:
    """An anchor-based (YOLOv5n) tiny_data checkpoint that detects at conf 0.25 (see _train_confident)."""
    return once("v5n", lambda folder: _train_confident(tiny_data, folder, "models/yolov5n.yaml")) / "yolov5n" / \
        "weights" / "best.pt"


@pytest.fixture(scope="session")
def tiny_v8n(tiny_data, once) -> Path:
    """An anchor-free (YOLOv8n) tiny_data checkpoint that detects at conf 0.25 (see _train_confident)."""
    return once("v8n", lambda folder: _train_confident(tiny_data, folder, "models/yolov8n.yaml")) / "yolov8n" / \
        "weights" / "best.pt"


@pytest.fixture
def restore_logger():
    """The CLI attaches a handler to the project logger; later tests must not write to this test's capture."""
    from yolotrain.utils.core.logging import LOGGER

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

    from yolotrain.utils.core.logging import LOGGER

    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    yield messages
    LOGGER.removeHandler(handler)
