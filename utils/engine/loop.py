"""The training loop: the run's epochs (``run_epochs``), and one epoch of steps on this rank's shard.

``train_one_epoch`` reads like YOLOv5's loop: warmup, forward, loss, backward, an optimizer step
every ``accumulate`` batches (and always on an epoch's last batch), EMA. Where the run stands lives
in the run state (``t.state``, utils/engine/state.py); what one step hands the next in this process
in ``LoopState``; what stays fixed for the run in ``Training`` (utils/engine/setup.py).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, TypeVar

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from utils.core import dist
from utils.core.errors import EXIT_PREEMPTED
from utils.core.logging import LOGGER
from utils.core.watchdog import Watchdog
from utils.data.device_feed import DeviceFeed, OnDevice
from utils.engine.hooks import EpochVerdict, Hooks
from utils.engine.preempt import StopRequest
from utils.engine.progress import ProgressBar
from utils.engine.setup import Training
from utils.engine.state import Stop, StopReason
from utils.eval.evaluate import EvalOptions, EvalResult, evaluate_model

T = TypeVar("T")
_END = object()  # fetch_batches: the loader is exhausted


@dataclass
class LoopState:
    """What one step hands to the next within this process (derived afresh on a resume, never saved)."""

    last_opt_step: int  # integrated batch index of the last optimizer step
    accumulate: int  # batches per optimizer step (ramped up during warmup)
    stopping: bool = False  # every rank agreed on a stop signal: leave at this optimizer step
    overflows: int = 0  # fp16: optimizer steps in a row with a non-finite loss, left to the GradScaler
    window_bad: torch.Tensor | None = None  # on the device: a non-finite loss since the last optimizer step

    @classmethod
    def start(cls, t: Training) -> LoopState:
        s = t.state
        return cls(last_opt_step=s.epoch * t.batches_per_epoch + s.batch - 1, accumulate=t.accumulate)


@dataclass(frozen=True)
class EpochEnded:
    """What train_one_epoch hands back: the mean loss items over ranks, and a stop when it ended the epoch early."""

    mloss: torch.Tensor
    stop: Stop | None = None


@dataclass(frozen=True)
class StepFlags:
    """What every rank agreed on at a step (loop.check_step)."""

    save_due: bool  # rank 0's --save-interval clock
    stop: bool  # a stop signal reached some rank
    bad_ranks: tuple[int, ...] = ()  # ranks with a NaN/inf loss since the last optimizer step
    mloss: tuple[float, ...] = ()  # the epoch's running mean loss items, averaged over ranks (the progress bar)


def run_epochs(t: Training, hooks: Hooks, stop: StopRequest, watch: Watchdog) -> Stop:
    """The run's epochs from where its state stands: train, validate on every rank, record and save;
    returns why it stopped. ``watch`` hears of each phase (loader, step, validation, save)."""
    state, loop, close = t.state, LoopState.start(t), int(t.hyp.close_mosaic)
    first_epoch, verdict = state.epoch, EpochVerdict()
    while state.epoch < state.epochs:  # --time may change state.epochs after each epoch
        t_epoch, first = time.time(), state.batch
        t.train_loader.sampler.set_epoch(state.epoch, skip=first * t.batch)
        if state.epoch == t.train_loader.sampler.mosaic_off_from_epoch:
            LOGGER.info(f"Closing mosaic: the last {state.epochs - state.epoch} epochs train without it")
        t.criterion.set_progress(state.epoch, state.epochs)  # a loss that follows the schedule (YOLO26's ProgLoss)
        hooks.events.emit("on_train_epoch_start", lr=t.lr.values())
        ended = train_one_epoch(t, loop, hooks, stop, watch)
        if ended.stop is not None:
            return ended.stop
        lrs = t.lr.values()
        hooks.events.emit("on_train_epoch_end", lr=lrs, losses=dict(zip(t.criterion.loss_names, ended.mloss.tolist())))
        t.lr.next_epoch()
        with watch.phase("validation", f"epoch {state.epoch + 1}"):  # each batch is progress
            result = validate(t)
            seconds = None if first else time.time() - t_epoch  # a resumed part of an epoch is no epoch's time
            fits = state.clock.end_epoch(state.epoch + 1, state.epochs, seconds, t.info, close)  # --time
            if fits is not None:
                state.replan(fits, close)  # before the checkpoint
            if result is None and state.epoch + 1 == state.epochs:  # --noval, and --time just made this the last
                result = validate(t)
            hooks.events.val_end(result)
        with watch.phase("save", f"epoch {state.epoch + 1}"):
            verdict = hooks.end_epoch(ended.mloss, lrs, result)  # results.csv row, last/best.pt, early or asked stop
            if result is not None and state.epoch + 1 == state.epochs:
                hooks.plots.validation(result)
        hooks.clock.restart()
        if verdict.ends or loop.stopping or state.epoch + 1 >= state.epochs:
            break
        state.epoch, state.batch = state.epoch + 1, 0
    return _stop_after_epoch(t, loop, stop, hooks, verdict, state.epoch - first_epoch + 1)


def _stop_after_epoch(t: Training, loop: LoopState, stop: StopRequest, hooks: Hooks, verdict: EpochVerdict,
                      epochs: int) -> Stop:
    """Why the epochs ended after one's checkpoint: a stop signal agreed during it, unless the run ends there
    anyway (its last epoch, an early stop, a listener's request: a normal end), else that normal end."""
    state = t.state
    if loop.stopping and not verdict.ends and state.epoch + 1 < state.epochs:
        return Stop(StopReason.PREEMPTED, _preempted(stop, hooks, f"the end of epoch {state.epoch + 1}"), epochs)
    if verdict.asked is not None:
        return Stop(StopReason.REQUESTED, verdict.asked, epochs)
    if verdict.early:
        return Stop(StopReason.EARLY_STOP, epochs=epochs)
    return Stop(StopReason.TIME_BUDGET if state.clock.enabled else StopReason.FINISHED, epochs=epochs)


def _preempted(stop: StopRequest, hooks: Hooks, where: str) -> str:
    last = hooks.checkpointer.last
    return (f"{stop.signal or 'a stop signal on another rank'}: saved {last} at {where}; exiting with code "
            f"{EXIT_PREEMPTED} (requeue); the same command with --resume auto, or --resume {last}, continues exactly")


def validate(t: Training) -> EvalResult | None:
    """The EMA model on the val split, on every rank, each rank's EMA made rank 0's first (the one best.pt
    holds); --noval validates only the final epoch."""
    final = t.state.epoch + 1 == t.state.epochs
    if t.cfg.noval and not final:
        return None
    t.ema.sync_buffers()
    options = EvalOptions(channels_last=t.cfg.channels_last, half=t.val_half,
                          keep_batches=3 if final and not t.cfg.noplots else 0)
    return evaluate_model(t.ema.ema, t.val_loader, t.device, t.names, t.info, options, criterion=t.criterion)


def train_one_epoch(t: Training, loop: LoopState, hooks: Hooks, stop: StopRequest, watch: Watchdog) -> EpochEnded:
    """One pass over this rank's shard, from ``t.state.batch`` (a resumed mid-epoch checkpoint's) on.

    A stop signal agreed at a step (``loop.stopping``) ends the epoch at the next optimizer step (at
    most ``accumulate`` batches later) with a mid-epoch last.pt and a PREEMPTED stop; when that step is
    the epoch's last, the epoch ends as usual and run_epochs stops after its checkpoint. A non-finite
    loss with no --nan-recover recovery left ends it with a NAN_BUDGET stop. ``watch`` hears of each
    batch: fetched in phase "loader" (from the second on, inside the step before it: ``DeviceFeed.ahead``),
    trained in "step", saved in "save"."""
    t.model.train()
    state, nb = t.state, t.batches_per_epoch
    epoch, first = state.epoch, state.batch
    mloss = state.mloss if first else torch.zeros(len(t.criterion.loss_names), device=t.device)
    bar = ProgressBar(t, first, nb)
    fed = DeviceFeed(t.train_loader, t.device, t.memory_format)  # fed.ahead(): the next batch during this step
    for i, item in fetch_batches(bar.enumerate(fed, first), watch, epoch, first):
        with watch.phase("step", f"epoch {epoch + 1}, batch {i + 1}"):  # DDP's collectives and check_step's
            state.batch = i + 1
            ni = i + nb * epoch  # integrated batch count since the start of training
            fw = forward(t, loop, hooks, item, i, ni)
            finite = torch.isfinite(fw.loss_items).all()  # on the device: read at the optimizer step
            loop.window_bad = ~finite if loop.window_bad is None else loop.window_bad | ~finite
            mloss = torch.where(finite, (mloss * i + fw.loss_items) / (i + 1), mloss)
            if not fw.stepped:
                backward(t, fw.loss)
            with watch.phase("loader", f"epoch {epoch + 1}, batch {i + 2}"):
                fed.ahead()  # fetched and queued while the device runs this batch, before check_step waits for it
            if not fw.steps:
                hooks.events.batch_end(ni, mloss, stepped=False)
                continue
            flags = check_step(loop.window_bad, mloss, t.info, hooks.clock.due(t.info), stop.requested)
            loop.window_bad, loop.stopping = None, loop.stopping or flags.stop
            hooks.clock.pending |= flags.save_due
            overflow = scaler_absorbs(t.scaler, loop, bool(flags.bad_ranks))  # fp16: the scaler skips that step
            if flags.bad_ranks and not overflow:  # every rank agreed: stop, or (--nan-recover) roll back
                spent = skip_bad_window(t, flags, i)
                if spent:
                    bar.close()
                    return EpochEnded(mloss.cpu(), Stop(StopReason.NAN_BUDGET, spent))
                loop.last_opt_step = ni  # the next optimizer step gathers a full accumulation from here
                continue
            if not fw.stepped:
                state.recovery.remember()  # the state every batch since the last step was scored on
                optimizer_step(t.model, t.optimizer, t.scaler, t.ema)
            loop.last_opt_step = ni
            if (loop.stopping or hooks.clock.pending) and i < nb - 1:  # the epoch's end saves anyway
                save_mid_epoch(t, loop, hooks, mloss, watch)
                if loop.stopping:
                    bar.close()
                    where = f"epoch {epoch + 1}, batch {i + 1}/{nb}"
                    return EpochEnded(state.mloss.cpu(), Stop(StopReason.PREEMPTED, _preempted(stop, hooks, where)))
            bar.update(i, flags.mloss, item.batch, fw.imgs)
            hooks.events.batch_end(ni, flags.mloss, stepped=True)
    return EpochEnded(dist.reduce_mean(mloss).cpu())


@dataclass(frozen=True)
class Forward:
    """One batch's forward pass: its images on the device, the loss and its items, and whether an optimizer
    step follows its backward (decided before the forward, which DDP needs to skip the gradient all-reduce).
    ``stepped``: the batch trained in micro-steps (``micro_steps``), its backward and steps done already."""

    imgs: torch.Tensor
    loss: torch.Tensor | None
    loss_items: torch.Tensor
    steps: bool
    stepped: bool = False


def forward(t: Training, loop: LoopState, hooks: Hooks, item: OnDevice, i: int, ni: int) -> Forward:
    """The warmup's LR and accumulation for batch ``ni``, then forward and loss under autocast.

    Each epoch ends on an optimizer step: a checkpoint then never holds half-accumulated gradients, so a
    resumed run continues exactly where the interrupted one would have. A batch whose gradient only
    accumulates runs under DDP's no_sync: its backward skips the all-reduce, which the stepping batch's does
    once for the accumulated sum."""
    epoch, batch, imgs = t.state.epoch, item.batch, item.images
    if t.cfg.multi_scale:
        imgs = rescale_batch(imgs, t.imgsz, t.grid, t.cfg.seed, epoch=epoch, i=i)
    hooks.plots.train_batch(batch, ni, imgs)
    if t.steps.per_batch > 1:
        return Forward(imgs, None, micro_steps(t, imgs, batch.targets, i), steps=True, stepped=True)
    t.lr.warmup_step(ni, epoch)
    if ni <= t.lr.warmup.iters:
        loop.accumulate = max(1, round(float(np.interp(ni, [0, t.lr.warmup.iters], [1, t.accumulate]))))
    steps = ni - loop.last_opt_step >= loop.accumulate or i == t.batches_per_epoch - 1
    quiet = t.model.no_sync() if not steps and isinstance(t.model, DDP) else contextlib.nullcontext()
    with quiet, t.autocast():
        loss, loss_items = t.step_loss(imgs, batch.targets)  # host targets: each loss moves what it needs
    return Forward(imgs, loss, loss_items, steps)


def micro_steps(t: Training, imgs: torch.Tensor, targets: torch.Tensor, i: int) -> torch.Tensor:
    """A short run's large batch ``i`` (t.steps): per part, the warmup's LR, forward, backward and an optimizer
    step, so the run takes the batch-16 run's steps while the loader, the device feed and the step's host sync
    work per batch. Every rank's batch has the same length, so the parts (and DDP's all-reduces) match across
    ranks. The recovery state is the batch's start: a non-finite loss agreed at check_step rolls back the
    whole batch. Returns the loss items, the parts' mean weighted by images."""
    n, epoch = imgs.shape[0], t.state.epoch
    items = torch.zeros((), device=imgs.device)
    for j, part in enumerate(t.steps.parts(n)):
        t.lr.warmup_step(t.steps.tick(epoch, i, j), epoch)
        rows = (targets[:, 0] >= part.start) & (targets[:, 0] < part.stop)
        mine = targets[rows].clone()
        mine[:, 0] -= part.start
        with t.autocast():
            loss, loss_items = t.step_loss(imgs[part], mine)
        backward(t, loss)
        if j == 0:
            t.state.recovery.remember()
        optimizer_step(t.model, t.optimizer, t.scaler, t.ema)
        items = items + loss_items.detach() * ((part.stop - part.start) / n)
    return items


def save_mid_epoch(t: Training, loop: LoopState, hooks: Hooks, mloss: torch.Tensor, watch: Watchdog) -> None:
    """last.pt inside an epoch, with the mean loss over ranks so far (a stop signal, or --save-interval)."""
    if not loop.stopping:
        hooks.clock.restart()
    with watch.phase("save"):
        t.state.mloss = dist.reduce_mean(mloss)
        hooks.checkpointer.save_mid_epoch(t)


def fetch_batches(batches: Iterable[T], watch: Watchdog, epoch: int, first: int) -> Iterator[T]:
    """The epoch's batches, each waited for in phase "loader": a stalled loader worker names itself."""
    it = iter(batches)
    for i in itertools.count(first):
        with watch.phase("loader", f"epoch {epoch + 1}, batch {i + 1}"):
            item = next(it, _END)
        if item is _END:
            return
        yield item


def backward(t: Training, loss: torch.Tensor) -> None:
    """Scaled backward. DDP averages gradients over ranks while the loss is a sum over the batch,
    so the loss is multiplied by the world size to keep the gradient of the global batch (whether
    it all-reduces here was decided in the forward: ``forward``)."""
    world = t.info.world_size
    if world > 1:
        loss = loss * world
    t.scaler.scale(loss).backward()


FP16_OVERFLOW_PATIENCE = 10  # non-finite fp16 losses in a row the GradScaler may absorb (2**-10 of its scale)


def scaler_absorbs(scaler: torch.amp.GradScaler, loop: LoopState, non_finite: bool) -> bool:
    """Under fp16 loss scaling a non-finite loss is an overflow the GradScaler handles: the step its gradient joins
    is skipped and the scale lowered. It stops the run (or spends a --nan-recover) only after
    FP16_OVERFLOW_PATIENCE in a row, which lowering the scale did not cure; fp32 and bf16 have no scaler."""
    absorbed = non_finite and scaler.is_enabled() and loop.overflows < FP16_OVERFLOW_PATIENCE
    loop.overflows = loop.overflows + 1 if absorbed else 0
    return absorbed


def optimizer_step(model, optimizer, scaler, ema) -> None:
    """Unscale, clip the gradient norm to 10, step, clear the gradients, update the EMA (YOLOv5's order)."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    ema.update(model)


def check_step(window_bad: torch.Tensor, mloss: torch.Tensor, info: dist.DistInfo, save_due: bool,
               stop_requested: bool) -> StepFlags:
    """At each optimizer step, one all-reduce and one device-to-host copy carry every rank's NaN/inf flag for
    the batches since the last step, rank 0's --save-interval clock, every rank's stop signal and the running
    mean loss, so every rank gets the same answers at the same step (which ranks' loss was not finite, whether
    a mid-epoch save is due, whether to stop; decided together, so no rank waits in a collective for one that
    has stopped or rolled back) and the progress bar its figures without another sync."""
    world, rank = info.world_size, info.rank
    own = torch.zeros(world, device=mloss.device)
    own[rank] = window_bad.float()
    control = torch.tensor([float(save_due), float(stop_requested)], device=mloss.device)
    values = host_values(dist.all_reduce_sum(torch.cat((own, control, mloss.detach().float()))))
    return StepFlags(save_due=bool(values[world]), stop=bool(values[world + 1]),
                     bad_ranks=tuple(r for r in range(world) if values[r]),
                     mloss=tuple(v / world for v in values[world + 2:]))


def host_values(t: torch.Tensor) -> list[float]:
    """The step's one device-to-host copy (a host sync on CUDA)."""
    return t.tolist()


def skip_bad_window(t: Training, flags: StepFlags, i: int) -> str | None:
    """A non-finite loss on some rank since the last optimizer step, agreed by all: with a --nan-recover recovery
    left, roll back to the state before the last optimizer step, drop the batches since (their gradients) and
    halve the LR for the rest of the epoch (None); else the message that stops every rank together (the default,
    and once the recoveries are spent)."""
    recovery = t.state.recovery
    where = (f"epoch {t.state.epoch + 1}, batch {i + 1}: the loss became NaN/inf on rank(s) "
             f"{', '.join(map(str, flags.bad_ranks))} since the last optimizer step")
    if recovery.left <= 0:
        spent = f"; all {recovery.limit} --nan-recover recoveries are used" if recovery.enabled else ""
        hint = "" if recovery.enabled else ", or let --nan-recover N roll back and skip such batches"
        return (f"{where}{spent}; checkpoints of earlier epochs are intact. Lower lr0 in the hyp yaml, "
                f"or check the labels{hint}.")
    rolled = recovery.restore()
    t.lr.halve()
    if t.info.is_main:
        LOGGER.warning(f"WARNING: {where}; recovery {recovery.used}/{recovery.limit}: "
                       + ("rolled back to the state before the last optimizer step" if rolled
                          else "no optimizer step to undo since this process started")
                       + f", skipped the batches since, LR x{t.lr.scale:g} until the epoch ends")
    return None


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
