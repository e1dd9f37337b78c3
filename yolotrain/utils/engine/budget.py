"""--time HOURS: the run trains the epochs that fit in a budget instead of --epochs.

The budget also owns the run's timings (the wall time spent over all its attempts, and each whole
epoch's time), which it needs and which the progress bar's ETA reads; they travel in checkpoints.
"""
from __future__ import annotations

import math
import time
from typing import Any

from yolotrain.utils.core import dist
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.logging import LOGGER


class TimeBudget:
    """After each epoch (validation included) rank 0 counts the epochs that still fit whole: the hours
    left (set-up and any earlier attempts of a resumed run included) over the mean epoch time, rounded
    down. Every rank takes that answer; the run state refits the LR schedule and close_mosaic to it, so
    the last epoch that fits ends the run as a normal last epoch would. An epoch that began as the
    planned last is not extended. The first epoch always runs, with --epochs as its plan and the LR
    of epoch 0, which every schedule length agrees on."""

    def __init__(self, hours: float, started: float | None = None) -> None:
        self.seconds = hours * 3600
        self.started = time.time() if started is None else started  # this process's start, set-up included
        self.seconds_before = 0.0  # what earlier attempts of a resumed run spent
        self.epoch_seconds: list[float] = []  # whole epochs' wall times, over all attempts

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    @property
    def train_seconds(self) -> float:
        """Wall time of the whole run so far, over all its attempts."""
        return self.seconds_before + time.time() - self.started

    def end_epoch(self, done: int, epochs: int, seconds: float | None, info: DistInfo, close_mosaic: int) -> int | None:
        """``done`` epochs are done, the last in ``seconds`` (None for the resumed rest of an epoch, which
        times no whole one): record its time and return the epoch count that fits, or None to keep ``epochs``."""
        first = not self.epoch_seconds
        if seconds is not None:
            self.epoch_seconds.append(seconds)
        times = self.epoch_seconds
        if not self.enabled or done >= epochs or not times:  # the epoch planned last ends the run as planned
            return None
        total = None
        if info.is_main:
            mean, left = sum(times) / len(times), self.seconds - self.train_seconds
            total = done + max(math.floor(left / mean), 0)
        total = int(dist.broadcast_object(total))
        if total == epochs and not first:  # said once after the first timed epoch, then on change
            return None
        if info.is_main:
            LOGGER.info(f"--time {self.seconds / 3600:g} h: {total} epochs fit ({done} done, "
                        f"{_minutes(mean)} an epoch, {_minutes(max(left, 0))} left); the LR schedule"
                        + (" and close_mosaic follow" if close_mosaic > 0 else " follows"))
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"train_seconds": float(self.train_seconds), "epoch_seconds": [float(s) for s in self.epoch_seconds]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seconds_before = float(state.get("train_seconds", 0.0))
        self.epoch_seconds = [float(s) for s in state.get("epoch_seconds", ())]


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m {s:02d}s"
