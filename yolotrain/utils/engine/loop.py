"""The training loop: the run's epochs (``run_epochs``), and one epoch of steps on this rank's shard.

``train_one_epoch`` reads like YOLOv5's loop, with the step in one call: for each batch, the step
(utils/engine/step.py: warmup, forward, loss, backward, an optimizer step when one is due, EMA), then
the side concerns (the progress bar, the events, a mid-epoch checkpoint when a stop or --save-interval
asks for one). What the step changes it owns (``t.step``, utils/engine/step.py); where the run stands lives in
the run state (``t.state``, utils/engine/state.py); what stays fixed for the run in ``Training``
(utils/engine/setup.py).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np
import torch

from yolotrain.utils.core import dist
from yolotrain.utils.core.errors import EXIT_PREEMPTED
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.core.watchdog import Watchdog
from yolotrain.utils.data.device_feed import DeviceFeed, OnDevice
from yolotrain.utils.engine.faults import LoaderGuard, validate_through_kills
from yolotrain.utils.engine.hooks import EpochVerdict, Hooks
from yolotrain.utils.engine.preempt import StopRequest
from yolotrain.utils.engine.progress import ProgressBar
from yolotrain.utils.engine.setup import Training
from yolotrain.utils.engine.state import Stop, StopReason
from yolotrain.utils.eval.evaluate import EvalOptions, EvalResult, evaluate_model

T = TypeVar("T")
_END = object()  # fetch_batches: the loader is exhausted


@dataclass(frozen=True)
class EpochEnded:
    """What train_one_epoch hands back: the mean loss items over ranks, and a stop when it ended the epoch early."""

    mloss: torch.Tensor
    stop: Stop | None = None


def run_epochs(t: Training, hooks: Hooks, stop: StopRequest, watch: Watchdog) -> Stop:
    """The run's epochs from where its state stands: train, validate on every rank, record and save;
    returns why it stopped. ``watch`` hears of each phase (loader, step, validation, save)."""
    state, step, close = t.state, t.step, int(t.hyp.close_mosaic)
    first_epoch, verdict = state.epoch, EpochVerdict()
    while state.epoch < state.epochs:  # --time may change state.epochs after each epoch
        t_epoch, first = time.time(), state.batches_done
        t.train_loader.sampler.set_epoch(state.epoch, skip=first * t.plan.per_rank_batch)
        if state.epoch == t.train_loader.sampler.mosaic_off_from_epoch:
            LOGGER.info(f"Closing mosaic: the last {state.epochs - state.epoch} epochs train without it")
        step.criterion.set_progress(state.epoch, state.epochs)  # a loss that follows the schedule (YOLO26's ProgLoss)
        hooks.events.emit("on_train_epoch_start", lr=step.lr.values())
        ended = train_one_epoch(t, hooks, stop, watch)
        if ended.stop is not None:
            return ended.stop
        lrs = step.lr.values()
        hooks.events.emit("on_train_epoch_end", lr=lrs, losses=dict(zip(step.criterion.loss_names, ended.mloss.tolist())))
        step.lr.next_epoch()
        with watch.phase("validation", f"epoch {state.epoch + 1}"):  # each batch is progress
            result = validate(t)
            seconds = None if first else time.time() - t_epoch  # a resumed part of an epoch is no epoch's time
            fits = state.clock.end_epoch(state.epoch + 1, state.epochs, seconds, t.info, close)  # --time
            if fits is not None:
                state.replan(fits, close)  # before the checkpoint
                step.lr.refit(fits)
            if result is None and state.epoch + 1 == state.epochs:  # --noval, and --time just made this the last
                result = validate(t)
            hooks.events.val_end(result)
        with watch.phase("save", f"epoch {state.epoch + 1}"):
            verdict = hooks.end_epoch(ended.mloss, lrs, result)  # results.csv row, last/best.pt, early or asked stop
            if result is not None and state.epoch + 1 == state.epochs:
                hooks.plots.validation(result)
        hooks.clock.restart()
        if verdict.ends or stop.agreed or state.epoch + 1 >= state.epochs:
            break
        state.epoch, state.batches_done = state.epoch + 1, 0
    return _stop_after_epoch(t, stop, hooks, verdict, state.epoch - first_epoch + 1)


def _stop_after_epoch(t: Training, stop: StopRequest, hooks: Hooks, verdict: EpochVerdict, epochs: int) -> Stop:
    """Why the epochs ended after one's checkpoint: a stop signal agreed during it, unless the run ends there
    anyway (its last epoch, an early stop, a listener's request: a normal end), else that normal end."""
    state = t.state
    if stop.agreed and not verdict.ends and state.epoch + 1 < state.epochs:
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
    ema = t.step.ema
    ema.sync_buffers()
    options = EvalOptions(channels_last=t.cfg.channels_last, half=t.val_half,
                          keep_batches=3 if final and not t.cfg.noplots else 0)
    return validate_through_kills(  # a killed loader worker: validated again (utils/engine/faults.py)
        lambda: evaluate_model(ema.ema, t.val_loader, t.device, t.names, t.info, options, criterion=t.step.criterion),
        t.val_loader, t.info)


def train_one_epoch(t: Training, hooks: Hooks, stop: StopRequest, watch: Watchdog) -> EpochEnded:
    """One pass over this rank's shard, from ``t.state.batches_done`` (a resumed mid-epoch checkpoint's) on.

    A stop signal agreed at a step (``stop.agreed``) ends the epoch there with a mid-epoch last.pt and a
    PREEMPTED stop; when that step is the epoch's last, the epoch ends as usual and run_epochs stops after
    its checkpoint. A non-finite loss with no --nan-recover recovery left ends it with a NAN_BUDGET stop. The
    batches come through the run's LoaderGuard (utils/engine/faults.py): a rank whose loader failed asks for the
    stop, and ``stop_for_fault`` ends the epoch where rank 0 already saved from before the step.
    ``watch`` hears of each batch: fetched in phase "loader" (from the second on, inside the step before it:
    ``DeviceFeed.ahead``), trained in "step", saved in "save"."""
    state, step, nb = t.state, t.step, t.plan.batches_per_epoch
    epoch, first = state.epoch, state.batches_done
    step.begin(epoch, first)
    bar = ProgressBar(t, first, nb)
    guard = hooks.loader = hooks.loader or LoaderGuard(t)  # a killed worker, a vanished image (utils/engine/faults.py)
    fed = DeviceFeed(guard.batches(stop, epoch, first), t.device, t.memory_format)  # fed.ahead(): the next batch
    ask = lambda: guard.ask(hooks)  # noqa: E731  (read at an optimizer step)
    for i, item in fetch_batches(bar.enumerate(fed, first), watch, epoch, first, taken=guard.taken):
        with watch.phase("step", f"epoch {epoch + 1}, batch {i + 1}"):  # DDP's collectives and check_step's
            state.batches_done, ni = i + 1, i + nb * epoch  # ni: batches since the start of training
            images = step_input(t, hooks, item, i, ni)
            out = step(images, item.batch.targets, i, meanwhile=lambda: fetch_ahead(fed, watch, epoch, i), ask=ask)
            if out.flags is None:  # the batch's gradient accumulates
                hooks.events.batch_end(ni, out.mloss, stepped=False)
                continue
            stop.agree(out.flags.stop)
            if stop.agreed and (ended := stop_for_fault(guard, stop, out.mloss, i)) is not None:
                bar.close()
                return ended
            hooks.clock.pending |= out.flags.save_due
            if out.failure:
                bar.close()
                return EpochEnded(out.mloss.cpu(), Stop(StopReason.NAN_BUDGET, out.failure))
            if not out.stepped:  # rolled back (--nan-recover)
                continue
            guard.stepped(i, out.flags.mloss)
            if (stop.agreed or hooks.clock.pending) and i < nb - 1:  # the epoch's end saves anyway
                save_mid_epoch(t, hooks, watch, stopping=stop.agreed)
                if stop.agreed:
                    bar.close()
                    where = f"epoch {epoch + 1}, batch {i + 1}/{nb}"
                    return EpochEnded(step.agreed.cpu(), Stop(StopReason.PREEMPTED, _preempted(stop, hooks, where)))
            bar.update(i, out.flags.mloss, item.batch, images)
            hooks.events.batch_end(ni, out.flags.mloss, stepped=True)
    return EpochEnded(dist.reduce_mean(step.mloss).cpu())


def step_input(t: Training, hooks: Hooks, item: OnDevice, i: int, ni: int) -> torch.Tensor:
    """The batch's images as the step takes them (--multi-scale: resized), drawn for train_batch0-2.jpg."""
    images = item.images
    if t.cfg.multi_scale:
        images = rescale_batch(images, t.imgsz, t.grid, t.cfg.seed, epoch=t.state.epoch, i=i)
    hooks.plots.train_batch(item.batch, ni, images)
    return images


def fetch_ahead(fed: DeviceFeed, watch: Watchdog, epoch: int, i: int) -> None:
    """The next batch, fetched and queued while the device runs this one, before the step waits for it."""
    with watch.phase("loader", f"epoch {epoch + 1}, batch {i + 2}"):
        fed.ahead()


def save_mid_epoch(t: Training, hooks: Hooks, watch: Watchdog, stopping: bool) -> None:
    """last.pt inside an epoch, with the mean loss over ranks so far (a stop signal, or --save-interval)."""
    if not stopping:
        hooks.clock.restart()
    with watch.phase("save"):
        t.step.agree_loss()
        hooks.checkpointer.save_mid_epoch(t)


def fetch_batches(batches: Iterable[T], watch: Watchdog, epoch: int, first: int,
                  taken: Callable[[object], None] | None = None) -> Iterator[T]:
    """The epoch's batches, each waited for in phase "loader": a stalled loader worker names itself. ``taken``
    hears of each (``(i, OnDevice)``) before it trains."""
    it = iter(batches)
    for i in itertools.count(first):
        with watch.phase("loader", f"epoch {epoch + 1}, batch {i + 1}"):
            item = next(it, _END)
        if item is _END:
            return
        if taken is not None:
            taken(item[1] if isinstance(item, tuple) else item)
        yield item


def stop_for_fault(guard: LoaderGuard, stop: StopRequest, mloss: torch.Tensor, i: int) -> EpochEnded | None:
    """A stop agreed at batch ``i``'s step: when a rank's loader failed, its line on every rank (``stop.faulted``),
    and the epoch's end here when rank 0 already wrote the checkpoint from before the step."""
    stop.faulted, ends = guard.at_stop(i)
    return EpochEnded(mloss.cpu(), Stop(StopReason.PREEMPTED, stop.faulted)) if ends else None


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
