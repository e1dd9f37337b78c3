"""Experiment trackers (TensorBoard, MLflow): opt-in per run (--tensorboard, --mlflow), rank 0 only, listening
to the run's events (utils/engine/events.py). A tracker that fails only warns; docs/tracking.md."""
from __future__ import annotations

import importlib.util

from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import Preempted, UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.setup import Training
from yolotrain.utils.engine.track.base import RunEnd, Tracker
from yolotrain.utils.engine.track.mlflow import MLflowTracker
from yolotrain.utils.engine.track.tensorboard import TensorBoardTracker

PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # flag -> the package it needs


def check_packages(args) -> None:
    """Stop before training, on every rank, when a tracking flag's package is not installed."""
    for flag, package in PACKAGES.items():
        if getattr(args, flag, None) not in (None, False) and not _installed(package):
            raise UserError(f"--{flag} needs the '{package}' package: pip install -r requirements-track.txt")


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken one
        return False


def attach_trackers(t: Training, callbacks: Callbacks) -> list[Tracker]:
    """The trackers the run asked for (rank 0 only), each listening on ``callbacks``; one that cannot start warns."""
    if not t.info.is_main:
        return []
    wanted = [(TensorBoardTracker, getattr(t.cfg, "tensorboard", False)),
              (MLflowTracker, getattr(t.cfg, "mlflow", None) not in (None, False))]
    trackers = []
    for kind, on in wanted:
        if not on:
            continue
        try:
            tracker = kind(t)
        except Exception as e:  # noqa: BLE001 -- training goes on without it
            LOGGER.warning(f"{kind.name}: could not start ({type(e).__name__}: {e}); training goes on without it")
            continue
        tracker.listen(callbacks)
        trackers.append(tracker)
    return trackers


def run_end(exc: BaseException | None) -> RunEnd:
    if exc is None:
        return RunEnd.FINISHED
    return RunEnd.KILLED if isinstance(exc, (Preempted, KeyboardInterrupt)) else RunEnd.FAILED


def close_trackers(trackers: list[Tracker], exc: BaseException | None) -> None:
    """Close each tracker once, with how the run ended (``exc``: the exception leaving train(), if any)."""
    end = run_end(exc)
    for tracker in trackers:
        try:
            tracker.close(end)
        except Exception as e:  # noqa: BLE001
            LOGGER.warning(f"{tracker.name}: closing failed ({type(e).__name__}: {e})")
