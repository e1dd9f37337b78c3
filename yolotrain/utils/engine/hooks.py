"""The loop's side concerns, each a small object with one job: when to save mid-epoch, every
checkpoint write, the pictures, and what happens at the end of an epoch."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from yolotrain.utils.core import dist
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.core.runs import ResultsCSV
from yolotrain.utils.core.storage import storage_error, write_failure
from yolotrain.utils.engine.events import RunEvents, metric_summary
from yolotrain.utils.engine.faults import LoaderGuard
from yolotrain.utils.engine.preempt import StopRequest
from yolotrain.utils.engine.setup import Training
from yolotrain.utils.engine.track import Tracker, attach_trackers, close_trackers
from yolotrain.utils.eval.evaluate import EvalResult
from yolotrain.utils.eval.outputs import save_eval_plots
from yolotrain.utils.eval.plots import plot_images, plot_labels, plot_results
from yolotrain.utils.weights.checkpoint import save_checkpoint, strip_optimizer


class SaveClock:
    """--save-interval: rank 0's clock says when a mid-epoch last.pt is due.

    Only rank 0 reads the time; its answer travels in the step's all-reduce (step.check_step), so
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


PREEMPTED_MARKER = "PREEMPTED"


class Checkpointer:
    """Every checkpoint write of a run, from rank 0 only: last.pt (each epoch and mid-epoch),
    best.pt, epochN.pt (--save-period), and stripping the optimizer at the end.

    A write the storage refuses (a full disk, a quota, a read-only remount) leaves the file it replaces as it was
    (atomic writes) and becomes one line: the file, the error, the free space, and the last good last.pt with the
    --resume command that continues it (``failure``). Every rank learns of it at the save's agreement (the
    epoch's end verdict, or the mid-epoch save's broadcast) and stops with it."""

    def __init__(self, weights_dir: Path, info: DistInfo, save_period: int = -1, events: RunEvents | None = None) -> None:
        self.dir, self.info, self.save_period, self.events = Path(weights_dir), info, save_period, events
        self.last, self.best = self.dir / "last.pt", self.dir / "best.pt"
        self.saved_at: str | None = None  # where the last.pt this process wrote stands (epoch 3; epoch 3, batch 12/40)

    def _save(self, ckpt: dict, path: Path) -> None:
        save_checkpoint(ckpt, path)
        if self.events is not None:
            self.events.emit("on_model_save", path=path)

    def failure(self, path: Path, e: OSError) -> str:
        """The line for a refused write of ``path``: what failed, and what to resume from."""
        if not self.last.is_file():  # none written yet, or the run folder removed under the job
            return f"{write_failure(path, e)}; no checkpoint of this run is left in {self.dir}, so it starts again"
        good = f"{self.last} ({self.saved_at or 'the checkpoint this run resumed from'}) is the last good checkpoint"
        return (f"{write_failure(path, e)}; {good}: once the folder can be written again, "
                f"{tool_command('train')} --resume {self.last} continues from it")

    @staticmethod
    def guarded(write) -> OSError | None:
        """Run ``write()`` (rank 0's saves); the storage's error when it refused the write, else None."""
        try:
            write()
        except Exception as e:  # torch's serializer wraps the OSError of its write in a RuntimeError
            cause = storage_error(e)
            if cause is None:
                raise
            return cause
        return None

    def save_epoch(self, t: Training, is_best: bool) -> str | None:
        """After epoch ``t.state.epoch``: last.pt, best.pt when it is the best so far, epochN.pt when due.
        Returns the line of a refused write (rank 0), None when all were written."""
        if not self.info.is_main:
            return None
        ckpt, epoch = t.checkpoint(), t.state.epoch
        files = [self.last] + [self.best] * is_best
        if self.save_period > 0 and (epoch + 1) % self.save_period == 0:
            files.append(self.dir / f"epoch{epoch + 1}.pt")
        for path in files:
            error = self.guarded(lambda: self._save(ckpt, path))
            if error is not None and path == self.last:
                return self.failure(path, error)
            if error is not None:
                return (f"{write_failure(path, error)}; {self.last} of epoch {epoch + 1} was written and is good: "
                        f"{tool_command('train')} --resume {self.last} continues from it")
            if path == self.last:
                self.saved_at = f"epoch {epoch + 1}"
        return None

    def save_mid_epoch(self, t: Training) -> None:
        """--save-interval or a stop signal: last.pt at an optimizer step inside ``t.state.epoch``, on every rank
        (rank 0 writes); a refused write stops every rank with its line."""
        failed = self.write_mid_epoch(t) if self.info.is_main else None
        failed = dist.broadcast_object(failed)
        if failed is not None:
            raise UserError(failed)

    def write_mid_epoch(self, t: Training) -> str | None:
        """Rank 0's mid-epoch last.pt; the line of a refused write, else None."""
        where = f"epoch {t.state.epoch + 1}, batch {t.state.batches_done}/{t.batches_per_epoch}"
        error = self.guarded(lambda: self._save(t.checkpoint(), self.last))
        if error is not None:
            return self.failure(self.last, error)
        self.saved_at = where
        LOGGER.info(f"Saved {self.last} at {where}")
        return None

    def finish(self, strip: bool) -> None:
        """Strip the optimizer from the final checkpoints (smaller, inference-ready)."""
        if self.info.is_main and strip:
            for f in (self.last, self.best):
                error = self.guarded(lambda: strip_optimizer(f)) if f.exists() else None
                if error is not None:  # the run's checkpoints are whole, only larger
                    LOGGER.warning(f"WARNING: {write_failure(f, error)}; it stays as written, whole, with its "
                                   "optimizer state")

    @property
    def preempted_marker(self) -> Path:
        """<run>/PREEMPTED: present while the run's last stop was a preemption that --resume continues. A batch
        script tests it to requeue: under torchrun the job's exit code is 1 whatever its workers' (75)."""
        return self.dir.parent / PREEMPTED_MARKER

    def mark_preempted(self, message: str) -> None:
        """After a preemption's last.pt: write the marker (rank 0), with the stop's message."""
        if self.info.is_main:
            def write() -> None:
                with atomic_write(self.preempted_marker, "w", encoding="utf-8") as f:
                    f.write(message.rstrip() + "\n")
            error = self.guarded(write)
            if error is not None:
                LOGGER.warning(f"WARNING: {write_failure(self.preempted_marker, error)}; a batch script that tests "
                               "it will not requeue the job")

    def clear_preempted(self) -> None:
        """At the start of every run and resume: an earlier preemption is being continued."""
        if self.info.is_main:
            self.preempted_marker.unlink(missing_ok=True)


class RunPlots:
    """Rank 0's pictures (off with --noplots): labels.jpg, train_batch0-2.jpg, the final
    validation's curves, matrix and batches, and results.png at the end."""

    def __init__(self, save_dir: Path, names: list[str], enabled: bool) -> None:
        self.dir, self.names, self.enabled = Path(save_dir), names, enabled

    def labels(self, dataset) -> None:
        if self.enabled and not (self.dir / "labels.jpg").exists():
            plot_labels(dataset.labels, self.names, self.dir / "labels.jpg")

    def train_batch(self, batch, ni: int, imgs) -> None:
        """train_batch0-2.jpg: the loader's pixels, or the device's (``imgs``) when it drew them."""
        if self.enabled and ni < 3:
            plot_images(batch.images if batch.images is not None else imgs, batch.targets, batch.paths, self.names,
                        self.dir / f"train_batch{ni}.jpg")

    def validation(self, result: EvalResult) -> None:
        if self.enabled:
            save_eval_plots(result, self.names, self.dir)

    def results(self) -> None:
        if self.enabled:
            plot_results(self.dir / "results.csv")


@dataclass
class Hooks:
    """The loop's side concerns for one run, built by ``build_hooks``."""

    clock: SaveClock
    checkpointer: Checkpointer
    plots: RunPlots
    end_epoch: EpochEnd
    events: RunEvents
    trackers: list[Tracker] = field(default_factory=list)
    loader: LoaderGuard | None = None  # the training batches through a killed worker or a vanished image

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, kind, exc: BaseException | None, tb) -> None:
        """Close the trackers on every end: finished, preempted (KILLED, resumable), failed."""
        close_trackers(self.trackers, exc)


def build_hooks(t: Training, callbacks: Callbacks | None = None, stop: StopRequest | None = None) -> Hooks:
    """``callbacks``: the caller's listeners to the run's events (the Python API's); the trackers listen first.
    ``stop``: the run's stop machinery, where a listener's ``request_stop`` goes."""
    listeners = Callbacks()
    trackers = attach_trackers(t, listeners)  # --tensorboard, --mlflow (rank 0)
    events = RunEvents(t, listeners.merged(callbacks), stop)
    checkpointer = Checkpointer(t.weights_dir, t.info, t.cfg.save_period, events)
    plots = RunPlots(t.save_dir, t.names, enabled=t.info.is_main and not t.cfg.noplots)
    return Hooks(clock=SaveClock(t.cfg.save_interval), checkpointer=checkpointer, plots=plots,
                 end_epoch=EpochEnd(t, checkpointer, events), events=events, trackers=trackers, loader=LoaderGuard(t))


@dataclass(frozen=True)
class EpochVerdict:
    """Rank 0's word at an epoch's end, broadcast so that every rank acts on the same one."""

    early: bool = False  # --patience epochs without improvement
    asked: str | None = None  # a listener's reason to end the run here (TrainEvent.request_stop)
    refused: str | None = None  # a write of the epoch's end the storage refused (its line): every rank stops

    @property
    def ends(self) -> bool:
        return self.early or self.asked is not None


class EpochEnd:
    """After each epoch: best fitness, the results.csv row (built by column name), the log line, the epoch's
    checkpoints, on_fit_epoch_end, then whether the run ends here: early stop, or a listener's request (decided
    on rank 0, where listeners run, and broadcast)."""

    def __init__(self, t: Training, checkpointer: Checkpointer, events: RunEvents) -> None:
        self.t, self.checkpointer, self.events = t, checkpointer, events
        names = t.step.criterion.loss_names
        self.csv = ResultsCSV(t.save_dir / "results.csv", loss_names=names)
        if t.info.is_main and t.state.resumed:
            self.csv.truncate_after(t.state.epoch - 1)

    def __call__(self, mloss: torch.Tensor, lrs: list[float], result: EvalResult | None) -> EpochVerdict:
        """Record the epoch; whether the run ends here (the same answer on every rank)."""
        t, state = self.t, self.t.state
        epoch, final = state.epoch, state.epoch + 1 == state.epochs
        if result is not None:
            state.metrics = result.metrics
        fitness = state.metrics.fitness() if result else 0.0
        # only validated epochs count towards early stopping (with --noval none do until the last)
        early = result is not None and state.stopper(epoch, fitness) and not final
        is_best = fitness >= state.best_fitness and result is not None
        state.best_fitness = max(state.best_fitness, fitness)
        row: dict[str, float] = {}
        refused = None
        if t.info.is_main:  # results.csv, then the checkpoints: a refused write is every rank's stop
            error = self.checkpointer.guarded(lambda: row.update(self._log(mloss, lrs, result)))
            refused = self.checkpointer.failure(self.csv.path, error) if error else None
        refused = refused or self.checkpointer.save_epoch(t, is_best)
        if refused is None:
            self.events.emit("on_fit_epoch_end", row=row, metrics=metric_summary(result) if result else {},
                             fitness=fitness if result else None, is_best=is_best,
                             lr=lrs, losses=dict(zip(t.step.criterion.loss_names, mloss.tolist())))
        verdict = dist.broadcast_object(EpochVerdict(early=early, asked=self.events.stop.asked, refused=refused))
        if verdict.refused is not None:
            raise UserError(verdict.refused)
        return verdict

    def _log(self, mloss: torch.Tensor, lrs: list[float], result: EvalResult | None) -> dict[str, float]:
        """The results.csv row and the log line; returns the row."""
        t, state = self.t, self.t.state
        m, names = state.metrics, t.step.criterion.loss_names
        row = {f"train/{n}_loss": v for n, v in zip(names, mloss.tolist())}
        row.update(ResultsCSV.metric_row(m if result else None))
        row.update({f"val/{n}_loss": v for n, v in zip(names, result.loss if result else [0.0] * len(names))})
        row.update({f"x/lr{j}": lr for j, lr in enumerate(lrs)})
        self.csv.append(state.epoch, row)
        losses = " ".join(f"{n} {v:.4f}" for n, v in zip(names, mloss.tolist()))
        LOGGER.info(f"epoch {state.epoch + 1}/{state.epochs}: {losses}"
                    + (f" | P {m.mp:.3f} R {m.mr:.3f} mAP50 {m.map50:.3f} mAP50-95 {m.map:.4f}" if result else "")
                    + f" | {time.time() - state.clock.started:.0f}s")
        return row
