"""Rank 0's progress bar for an epoch of training: running losses, instances, image size, img/s, run ETA."""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from yolotrain.utils.engine.setup import Training


class ProgressBar:
    """Rank 0's bar for one epoch: running losses, instances, image size, img/s over all ranks, run ETA."""

    def __init__(self, t: Training, first: int, nb: int) -> None:
        self.t, self.first, self.nb = t, first, nb
        self.t0 = time.monotonic()
        self.bar: tqdm | None = None

    def enumerate(self, loader, first: int):
        s = self.t.state
        self.bar = tqdm(enumerate(loader, start=first), total=self.nb, initial=first, disable=not self.t.info.is_main,
                        bar_format="{l_bar}{bar:10}{r_bar}", desc=f"{s.epoch + 1}/{s.epochs}")
        return self.bar

    def update(self, i: int, mloss: tuple[float, ...], batch, imgs: torch.Tensor) -> None:
        """At an optimizer step, from the step's host values (mloss: the running mean over ranks)."""
        if self.bar is None or self.bar.disable:
            return
        t, state = self.t, self.t.state
        seconds = (time.monotonic() - self.t0) / (i + 1 - self.first)  # per batch, this epoch so far
        done = state.clock.epoch_seconds
        per_epoch = sum(done) / len(done) if done else seconds * self.nb  # validation included once known
        left = seconds * (self.nb - i - 1) + (state.epochs - state.epoch - 1) * per_epoch
        losses = " ".join(f"{n} {v:.4f}" for n, v in zip(t.step.criterion.loss_names, mloss))
        self.bar.set_postfix_str(f"{losses} | {batch.targets.shape[0]} inst {imgs.shape[-1]}px | "
                                 f"{batch.size * t.info.world_size / seconds:.0f} img/s | run ETA {_hms(left)}",
                                 refresh=False)

    def close(self) -> None:
        """End the bar of an epoch left early (a stop signal)."""
        if self.bar is not None:
            self.bar.close()


def _hms(seconds: float) -> str:
    m, sec = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}"
