"""The training loop's inner part: one epoch of steps on this rank's shard.

``train_one_epoch`` reads like YOLOv5's loop: warmup, forward, loss, backward, an optimizer step
every ``accumulate`` batches (and always on an epoch's last batch), EMA. What changes from step to
step lives in ``LoopState``; what stays fixed for the run lives in ``Training`` (utils/engine/setup.py).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from utils.core import dist
from utils.core.errors import UserError
from utils.core.logging import LOGGER
from utils.core.watchdog import Watchdog
from utils.engine.hooks import Checkpointer, RunPlots, SaveClock
from utils.engine.preempt import StopRequest
from utils.engine.recover import NanRecovery
from utils.engine.setup import Training

T = TypeVar("T")
_END = object()  # fetch_batches: the loader is exhausted


@dataclass
class LoopState:
    """What one step hands to the next, and one epoch to the next (checkpointed as needed)."""

    epoch: int  # the epoch being trained (0-based)
    first_batch: int = 0  # a run resumed from a mid-epoch checkpoint starts its first epoch here
    mloss: torch.Tensor | None = None  # ... with the running mean loss saved with it
    last_opt_step: int = -1  # integrated batch index of the last optimizer step
    accumulate: int = 1  # batches per optimizer step (ramped up during warmup)
    best_fitness: float = 0.0
    metrics: object | None = None  # DetectionMetrics of the last validation
    epoch_seconds: list[float] = field(default_factory=list)  # finished epochs' wall times, for the ETA
    stopping: bool = False  # every rank agreed on a stop signal: leave at the next optimizer step
    preempted_at: int | None = None  # batches done in state.epoch when the stop saved mid-epoch
    lr_scale: float = 1.0  # --nan-recover halves the LR for the rest of an epoch
    t_start: float = field(default_factory=time.time)  # when this process started training (set-up included)
    seconds_before: float = 0.0  # wall time earlier attempts of a resumed run spent

    @classmethod
    def start(cls, t: Training, t_start: float) -> LoopState:
        """A fresh run's state, or a resumed one's (at the saved epoch and batch, with that epoch's LR scale
        and the earlier attempts' epoch times)."""
        s = t.start
        nb = t.batches_per_epoch
        return cls(epoch=s.epoch, first_batch=s.batches_done, mloss=s.mloss,
                   last_opt_step=s.epoch * nb + s.batches_done - 1, accumulate=t.accumulate,
                   best_fitness=s.best_fitness, epoch_seconds=list(s.epoch_seconds), lr_scale=s.lr_scale,
                   t_start=t_start, seconds_before=s.train_seconds)

    @property
    def train_seconds(self) -> float:
        """Wall time of the whole run so far, over all its attempts (--time's budget)."""
        return self.seconds_before + time.time() - self.t_start


@dataclass(frozen=True)
class StepFlags:
    """What every rank agreed on at a step (loop.check_step)."""

    save_due: bool  # rank 0's --save-interval clock
    stop: bool  # a stop signal reached some rank
    bad_ranks: tuple[int, ...] = ()  # ranks whose loss was NaN/inf at this step


def train_one_epoch(t: Training, state: LoopState, clock: SaveClock, checkpointer: Checkpointer,
                    plots: RunPlots, stop: StopRequest, recovery: NanRecovery, watch: Watchdog) -> torch.Tensor:
    """One pass over this rank's shard; returns the mean loss items averaged over ranks.

    A stop signal agreed at a step (``state.stopping``) ends the epoch at the next optimizer step (at
    most ``accumulate`` batches later) with a mid-epoch last.pt and ``state.preempted_at`` set; when
    that step is the epoch's last, the epoch ends as usual and train() stops after its checkpoint.
    ``watch`` hears of each batch: fetched in phase "loader", trained in "step", saved in "save"."""
    t.model.train()
    epoch, first = state.epoch, state.first_batch
    nb = t.batches_per_epoch  # first + what the (possibly skipping) loader yields
    mloss = state.mloss if state.mloss is not None else torch.zeros(len(t.criterion.loss_names), device=t.device)
    state.first_batch, state.mloss = 0, None
    if not first:  # a mid-epoch resume keeps the saved epoch's --nan-recover LR scale (LoopState.start)
        state.lr_scale = 1.0
    bar = ProgressBar(t, state, first, nb)
    for i, batch in fetch_batches(bar.enumerate(t.train_loader, first), watch, epoch, first):
        with watch.phase("step", f"epoch {epoch + 1}, batch {i + 1}"):  # DDP's collectives and check_step's
            ni = i + nb * epoch  # integrated batch count since the start of training
            imgs = prepare_images(t, batch)
            if t.opt.multi_scale:
                imgs = rescale_batch(imgs, t.imgsz, t.grid, t.opt.seed, epoch=epoch, i=i)
            t.warmup.apply(t.optimizer, ni, t.lr_lambda, epoch)
            if ni <= t.warmup.iters:
                state.accumulate = max(1, round(float(np.interp(ni, [0, t.warmup.iters], [1, t.accumulate]))))
                scale_lr(t.optimizer, state.lr_scale)  # warmup set the LR afresh
            plots.train_batch(batch, ni)
            with t.autocast():
                pred = t.model(imgs)
                loss, loss_items = t.criterion(pred, batch.targets)  # host targets: each loss moves what it needs
            flags = check_step(loss_items, t.info, clock.due(t.info), stop.requested)
            clock.pending |= flags.save_due
            state.stopping |= flags.stop
            if flags.bad_ranks:  # every rank agreed: stop the run, or (--nan-recover) roll back and skip the batch
                skip_bad_batch(t, state, recovery, flags.bad_ranks, loss_items, i)
                state.last_opt_step = ni  # the next optimizer step gathers a full accumulation from here
                continue
            mloss = (mloss * i + loss_items) / (i + 1)
            backward(t, loss)
            # Each epoch ends on an optimizer step: a checkpoint then never holds half-accumulated
            # gradients, so a resumed run continues exactly where the interrupted one would have.
            if ni - state.last_opt_step >= state.accumulate or i == nb - 1:
                recovery.remember()  # every batch since the last step had a finite loss on this state
                optimizer_step(t.model, t.optimizer, t.scaler, t.ema)
                state.last_opt_step = ni
                if state.stopping and i < nb - 1:
                    with watch.phase("save"):
                        mean = dist.reduce_mean(mloss)
                        checkpointer.save_mid_epoch(t, state, i + 1, mean)
                    state.preempted_at = i + 1
                    bar.close()
                    return mean.cpu()
                if clock.pending and i < nb - 1:  # the epoch's end saves anyway
                    clock.restart()
                    with watch.phase("save"):
                        checkpointer.save_mid_epoch(t, state, i + 1, dist.reduce_mean(mloss))
            bar.update(i, mloss, batch, imgs)
    return dist.reduce_mean(mloss).cpu()


def fetch_batches(batches: Iterable[T], watch: Watchdog, epoch: int, first: int) -> Iterator[T]:
    """The epoch's batches, each waited for in phase "loader": a stalled loader worker names itself."""
    it = iter(batches)
    for i in itertools.count(first):
        with watch.phase("loader", f"epoch {epoch + 1}, batch {i + 1}"):
            item = next(it, _END)
        if item is _END:
            return
        yield item


def prepare_images(t: Training, batch) -> torch.Tensor:
    """uint8 batch -> float 0-1 on the device, in the run's memory format (no copy in the default one)."""
    imgs = batch.images.to(t.device, non_blocking=True).float().div_(255)
    return imgs.contiguous(memory_format=t.memory_format)


def backward(t: Training, loss: torch.Tensor) -> None:
    """Scaled backward. DDP averages gradients over ranks while the loss is a sum over the batch,
    so the loss is multiplied by the world size to keep the gradient of the global batch."""
    world = t.info.world_size
    if world > 1:
        loss = loss * world
    t.scaler.scale(loss).backward()


def optimizer_step(model, optimizer, scaler, ema) -> None:
    """Unscale, clip the gradient norm to 10, step, clear the gradients, update the EMA (YOLOv5's order)."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    ema.update(model)


def check_step(loss_items: torch.Tensor, info: dist.DistInfo, save_due: bool, stop_requested: bool) -> StepFlags:
    """One all-reduce per step carries every rank's NaN/inf flag, rank 0's --save-interval clock and
    every rank's stop signal, so every rank gets the same answers at the same step: whether a
    mid-epoch save is due, whether to stop, and which ranks' loss was not finite (decided together,
    so no rank waits in a collective for one that has stopped or rolled back).
    """
    world, rank = info.world_size, info.rank
    flags = torch.zeros(world + 2, device=loss_items.device)
    flags[rank] = float(not torch.isfinite(loss_items).all())
    flags[world] = float(save_due)
    flags[world + 1] = float(stop_requested)
    flags = dist.all_reduce_sum(flags)
    bad = tuple(flags[:world].nonzero().flatten().tolist())
    return StepFlags(save_due=bool(flags[world]), stop=bool(flags[world + 1]), bad_ranks=bad)


def skip_bad_batch(t: Training, state: LoopState, recovery: NanRecovery, bad_ranks: tuple[int, ...],
                   loss_items: torch.Tensor, i: int) -> None:
    """A non-finite loss on some rank, agreed by all: a UserError that stops every rank together
    (the default, and once --nan-recover's recoveries are spent), or a rollback to the state before
    the last optimizer step with this batch skipped and the LR halved for the rest of the epoch."""
    names = ", ".join(t.criterion.loss_names)
    where = (f"epoch {state.epoch + 1}, batch {i + 1}: the loss became NaN/inf on rank(s) "
             f"{', '.join(map(str, bad_ranks))} ({names} = {[round(v, 4) for v in loss_items.tolist()]})")
    if recovery.left <= 0:
        spent = f"; all {recovery.limit} --nan-recover recoveries are used" if recovery.enabled else ""
        hint = "" if recovery.enabled else ", or let --nan-recover N roll back and skip such batches"
        raise UserError(f"{where}{spent}; checkpoints of earlier epochs are intact. Lower lr0 in the hyp yaml, "
                        f"or check the labels{hint}.")
    rolled = recovery.restore()
    state.lr_scale *= 0.5
    scale_lr(t.optimizer, 0.5)
    if t.info.is_main:
        LOGGER.warning(f"WARNING: {where}; recovery {recovery.used}/{recovery.limit}: "
                       + ("rolled back to the state before the last optimizer step" if rolled
                          else "no optimizer step to undo since this process started")
                       + f", skipped the batch, LR x{state.lr_scale:g} until the epoch ends")


def scale_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    if factor != 1:
        for g in optimizer.param_groups:
            g["lr"] *= factor


def rescale_batch(imgs: torch.Tensor, imgsz: int, gs: int, seed: int, epoch: int, i: int) -> torch.Tensor:
    """--multi-scale: resize the batch to a size in [0.5, 1.5] x imgsz (a multiple of the stride),
    drawn from (seed, epoch, step) so every rank agrees and a resumed run repeats it. Targets are
    normalised, so they need no change."""
    size = int(np.random.default_rng([seed, epoch, i]).integers(int(imgsz * 0.5), int(imgsz * 1.5) + gs)) // gs * gs
    sf = size / max(imgs.shape[2:])
    if sf == 1:
        return imgs
    shape = [math.ceil(x * sf / gs) * gs for x in imgs.shape[2:]]
    return torch.nn.functional.interpolate(imgs, size=shape, mode="bilinear", align_corners=False)


class ProgressBar:
    """Rank 0's bar for one epoch: running losses, instances, image size, img/s over all ranks, run ETA."""

    def __init__(self, t: Training, state: LoopState, first: int, nb: int) -> None:
        self.t, self.state, self.first, self.nb = t, state, first, nb
        self.t0 = time.monotonic()
        self.bar: tqdm | None = None

    def enumerate(self, loader, first: int):
        self.bar = tqdm(enumerate(loader, start=first), total=self.nb, initial=first, disable=not self.t.info.is_main,
                        bar_format="{l_bar}{bar:10}{r_bar}", desc=f"{self.state.epoch + 1}/{self.t.opt.epochs}")
        return self.bar

    def update(self, i: int, mloss: torch.Tensor, batch, imgs: torch.Tensor) -> None:
        if self.bar is None or self.bar.disable:
            return
        t, state = self.t, self.state
        seconds = (time.monotonic() - self.t0) / (i + 1 - self.first)  # per batch, this epoch so far
        done = state.epoch_seconds
        per_epoch = sum(done) / len(done) if done else seconds * self.nb  # validation included once known
        left = seconds * (self.nb - i - 1) + (t.opt.epochs - state.epoch - 1) * per_epoch
        losses = " ".join(f"{n} {v:.4f}" for n, v in zip(t.criterion.loss_names, mloss.tolist()))
        self.bar.set_postfix_str(f"{losses} | {batch.targets.shape[0]} inst {imgs.shape[-1]}px | "
                                 f"{len(batch.images) * t.info.world_size / seconds:.0f} img/s | run ETA {_hms(left)}",
                                 refresh=False)

    def close(self) -> None:
        """End the bar of an epoch left early (a stop signal)."""
        if self.bar is not None:
            self.bar.close()


def _hms(seconds: float) -> str:
    m, sec = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}"
