"""The loop's side concerns, each a small object with one job: when to save mid-epoch, every
checkpoint write, the pictures, and what happens at the end of an epoch."""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch

from models.yolo import de_parallel
from utils.core import dist
from utils.core.dist import DistInfo
from utils.core.logging import LOGGER
from utils.core.runs import ResultsCSV
from utils.engine.checkpoint import rng_states
from utils.engine.optim import lr_lambda, refit_schedule
from utils.engine.recover import NanRecovery
from utils.eval.evaluate import EvalResult
from utils.eval.outputs import save_eval_plots
from utils.eval.plots import plot_images, plot_labels, plot_results
from utils.weights.checkpoint import fp32_state_dict, now_iso, save_checkpoint, strip_optimizer, to_plain, versions


class SaveClock:
    """--save-interval: rank 0's clock says when a mid-epoch last.pt is due.

    Only rank 0 reads the time; its answer travels in the step's all-reduce (loop.check_step), so
    every rank agrees on the step at which the save happens.
    """

    def __init__(self, minutes: float) -> None:
        self.seconds = minutes * 60
        self.pending = False  # agreed due, waiting for the next optimizer step
        self.next_at = time.monotonic() + self.seconds

    def due(self, info: DistInfo) -> bool:
        return info.is_main and self.seconds > 0 and time.monotonic() >= self.next_at

    def restart(self) -> None:
        self.pending = False
        self.next_at = time.monotonic() + self.seconds


class TimeBudget:
    """--time HOURS: the run trains the epochs that fit in the budget instead of --epochs.

    After each epoch (validation included) rank 0 counts the epochs that still fit whole: the
    hours left (set-up and any earlier attempts of a resumed run included) over this process's mean
    epoch time, rounded down. Every rank takes that answer, and the LR schedule and close_mosaic
    are refitted to the new total, so the last epoch that fits ends the run as a normal last epoch
    would (final validation, pictures, stripped checkpoints); an epoch that began as the planned
    last is not extended. The first epoch always runs, with --epochs as its plan and the LR of
    epoch 0, which every schedule length agrees on.
    """

    def __init__(self, hours: float) -> None:
        self.seconds = hours * 3600

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def refit(self, t, state, epoch_seconds: float | None) -> None:
        """After epoch ``state.epoch`` (which took ``epoch_seconds``; None for the resumed rest of an epoch,
        which times no whole one): set t.opt.epochs to the epochs that fit."""
        done = state.epoch + 1
        times = [*state.epoch_seconds, *([] if epoch_seconds is None else [epoch_seconds])]
        if not self.enabled or done >= t.opt.epochs or not times:  # the epoch planned last ends the run as planned
            return
        total = None
        if t.info.is_main:
            mean, left = sum(times) / len(times), self.seconds - state.train_seconds
            total = done + max(math.floor(left / mean), 0)
        total = int(dist.broadcast_object(total))
        if total == t.opt.epochs and len(state.epoch_seconds):  # said once after the first timed epoch, then on change
            return
        t.opt.epochs = total
        t.lr_lambda = lr_lambda(total, t.hyp.lrf, t.opt.cos_lr)
        refit_schedule(t.scheduler, t.lr_lambda)
        sampler, close = t.train_loader.sampler, int(t.hyp.close_mosaic)
        if close > 0 and (sampler.mosaic_off_from_epoch is None or sampler.mosaic_off_from_epoch > done):
            sampler.mosaic_off_from_epoch = max(total - close, done)  # once closed, mosaic stays closed
        if t.info.is_main:
            LOGGER.info(f"--time {self.seconds / 3600:g} h: {total} epochs fit ({done} done, "
                        f"{_minutes(mean)} an epoch, {_minutes(max(left, 0))} left); the LR schedule"
                        + (" and close_mosaic follow" if close > 0 else " follows"))


def _minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m {s:02d}s"


class Checkpointer:
    """Every checkpoint write of a run, from rank 0 only: last.pt (each epoch and mid-epoch),
    best.pt, epochN.pt (--save-period), and stripping the optimizer at the end."""

    def __init__(self, weights_dir: Path, info: DistInfo, save_period: int = -1,
                 recovery: NanRecovery | None = None) -> None:
        self.dir, self.info, self.save_period = Path(weights_dir), info, save_period
        self.last, self.best = self.dir / "last.pt", self.dir / "best.pt"
        self.recovery = recovery  # --nan-recover's NanRecovery: its rollback copy and count travel with the run

    def _checkpoint(self, t, state, epoch: int) -> dict:
        ckpt = make_checkpoint(t, state, epoch)
        if self.recovery is not None and self.recovery.enabled:
            ckpt["nan_recovery"] = self.recovery.state_dict()
        return ckpt

    def save_epoch(self, t, state, is_best: bool) -> None:
        """After epoch ``state.epoch``: last.pt, best.pt when it is the best so far, epochN.pt when due."""
        if not self.info.is_main:
            return
        ckpt = self._checkpoint(t, state, state.epoch)
        save_checkpoint(ckpt, self.last)
        if is_best:
            save_checkpoint(ckpt, self.best)
        if self.save_period > 0 and (state.epoch + 1) % self.save_period == 0:
            save_checkpoint(ckpt, self.dir / f"epoch{state.epoch + 1}.pt")

    def save_mid_epoch(self, t, state, batches: int, mloss: torch.Tensor) -> None:
        """--save-interval: last.pt at an optimizer step inside ``state.epoch``, with the batches done."""
        if not self.info.is_main:
            return
        ckpt = self._checkpoint(t, state, state.epoch - 1)
        ckpt.update(batches_done=batches, mloss=mloss.tolist(), lr_scale=state.lr_scale)
        save_checkpoint(ckpt, self.last)
        LOGGER.info(f"Saved {self.last} at epoch {state.epoch + 1}, batch {batches}/{t.batches_per_epoch}")

    def finish(self, strip: bool) -> None:
        """Strip the optimizer from the final checkpoints (smaller, inference-ready)."""
        if self.info.is_main and strip:
            for f in (self.last, self.best):
                if f.exists():
                    strip_optimizer(f)


def make_checkpoint(t, state, epoch: int) -> dict:
    """Everything an exact continuation needs, in weights_only-safe types."""
    return {
        "epoch": epoch,
        "best_fitness": float(state.best_fitness),
        "model_yaml": to_plain(de_parallel(t.model).yaml),
        "model": fp32_state_dict(de_parallel(t.model)),
        "ema": fp32_state_dict(t.ema.ema),
        "ema_updates": t.ema.updates,
        "optimizer": t.optimizer.state_dict(),
        "optimizer_choice": asdict(t.optimizer_choice),
        "scaler": t.scaler.state_dict(),
        "early_stop": t.stopper.state_dict(),
        "rng": rng_states(),
        "train_seconds": float(state.train_seconds),  # --time: what this run has already spent
        "mosaic_off_from_epoch": t.train_loader.sampler.mosaic_off_from_epoch,  # --time moves it: a resume keeps it
        "epoch_seconds": [float(s) for s in state.epoch_seconds],  # whole epochs' times, all attempts (--time, ETA)
        "seed": t.opt.seed,
        "world_size": t.info.world_size,
        "hyp": t.hyp.as_dict(),
        "args": to_plain(vars(t.opt)),
        "names": list(t.names),
        "metrics": state.metrics.as_dict() if state.metrics else {},
        "val_precision": "bf16" if t.val_half else "fp32",  # how those metrics were computed: val.py's default
        "versions": versions(),
        "date": now_iso(),
    }


class RunPlots:
    """Rank 0's pictures (off with --noplots): labels.jpg, train_batch0-2.jpg, the final
    validation's curves, matrix and batches, and results.png at the end."""

    def __init__(self, save_dir: Path, names: list[str], enabled: bool) -> None:
        self.dir, self.names, self.enabled = Path(save_dir), names, enabled

    def labels(self, dataset) -> None:
        if self.enabled and not (self.dir / "labels.jpg").exists():
            plot_labels(dataset.labels, self.names, self.dir / "labels.jpg")

    def train_batch(self, batch, ni: int) -> None:
        if self.enabled and ni < 3:
            plot_images(batch.images, batch.targets, batch.paths, self.names, self.dir / f"train_batch{ni}.jpg")

    def validation(self, result: EvalResult) -> None:
        if self.enabled:
            save_eval_plots(result, self.names, self.dir)

    def results(self) -> None:
        if self.enabled:
            plot_results(self.dir / "results.csv")


class EpochEnd:
    """After each epoch: early stop (decided once, broadcast), best fitness, the results.csv row
    (built by column name), the log line and the epoch's checkpoints."""

    def __init__(self, t, checkpointer: Checkpointer) -> None:
        self.t, self.checkpointer = t, checkpointer
        names = t.criterion.loss_names
        self.csv = ResultsCSV(t.save_dir / "results.csv", loss_names=names)
        if t.info.is_main and t.start.resumed:
            self.csv.truncate_after(t.start.epoch - 1)

    def __call__(self, state, mloss: torch.Tensor, lrs: list[float], result: EvalResult | None) -> bool:
        """Record the epoch; True when training should stop early (the same answer on every rank)."""
        t, epoch = self.t, state.epoch
        final = epoch + 1 == t.opt.epochs
        if result is not None:
            state.metrics = result.metrics
        fitness = state.metrics.fitness() if result else 0.0
        # only validated epochs count towards early stopping (with --noval none do until the last)
        stop = dist.broadcast_object(result is not None and t.stopper(epoch, fitness) and not final)
        is_best = fitness >= state.best_fitness and result is not None
        state.best_fitness = max(state.best_fitness, fitness)
        if t.info.is_main:
            self._log(state, mloss, lrs, result)
        self.checkpointer.save_epoch(t, state, is_best)
        return stop

    def _log(self, state, mloss: torch.Tensor, lrs: list[float], result: EvalResult | None) -> None:
        t, m = self.t, state.metrics
        names = t.criterion.loss_names
        row = {f"train/{n}_loss": v for n, v in zip(names, mloss.tolist())}
        row.update(ResultsCSV.metric_row(m if result else None))
        row.update({f"val/{n}_loss": v for n, v in zip(names, result.loss if result else [0.0] * len(names))})
        row.update({f"x/lr{j}": lr for j, lr in enumerate(lrs)})
        self.csv.append(state.epoch, row)
        losses = " ".join(f"{n} {v:.4f}" for n, v in zip(names, mloss.tolist()))
        LOGGER.info(f"epoch {state.epoch + 1}/{t.opt.epochs}: {losses}"
                    + (f" | P {m.mp:.3f} R {m.mr:.3f} mAP50 {m.map50:.3f} mAP50-95 {m.map:.4f}" if result else "")
                    + f" | {time.time() - state.t_start:.0f}s")
