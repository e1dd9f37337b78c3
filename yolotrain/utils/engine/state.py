"""The run state: everything an exact continuation needs, in one place, and the one reader and writer
of a training checkpoint's keys (file IO, and what inference reads, live in the checkpoint module).

A checkpoint is the run state's ``state_dict()``, the step's (utils/engine/step.py: model, EMA, optimizer,
GradScaler, LR schedule, --nan-recover copy, running loss) and a record of what the run is (model yaml,
arguments, hyperparameters, class names, versions). Each component with state owns its part: here the early
stop, the sampler (close_mosaic's epoch), the time budget (the run's timings) and the RNG states.
``SavedRun`` is a checkpoint read back for a resume, as typed fields.

Where the run stands is one cursor: ``epoch`` (0-based, the epoch in progress) and ``batches_done``
(of it). A checkpoint taken inside an epoch records the epochs done before it and ``batches_done``;
one taken after an epoch's last batch records that epoch.
"""
from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.data.loader import TrainSampler
from yolotrain.utils.engine.rng import rng_states, set_rng_states
from yolotrain.utils.engine.budget import TimeBudget
from yolotrain.utils.engine.optim import EarlyStopping, OptimizerChoice
from yolotrain.utils.engine.step import Step
from yolotrain.utils.eval.metrics import DetectionMetrics
from yolotrain.utils.weights.checkpoint import load_checkpoint, now_iso, to_plain, versions


class StopReason(enum.Enum):
    """Why the epochs loop ended; train.py acts on this one value."""

    FINISHED = "finished"  # the planned epochs ran
    TIME_BUDGET = "time budget"  # --time: the epochs that fitted ran (a normal end)
    EARLY_STOP = "early stop"  # --patience epochs without improvement (a normal end)
    REQUESTED = "requested"  # a listener asked for the stop (TrainEvent.request_stop; a normal end)
    PREEMPTED = "preempted"  # a stop signal: last.pt saved, exit 75 for a requeue
    NAN_BUDGET = "nan budget"  # a non-finite loss with no --nan-recover recovery left: exit 1


def mosaic_off_from(close_mosaic: float, epochs: int) -> int:
    """The first epoch without mosaic: the hyp's last ``close_mosaic`` epochs, but at most half the run (rounded
    up), so a short run still trains about half its epochs on mosaics. Runs of 20 epochs or more keep YOLOv5's
    and Ultralytics' rule."""
    return epochs - min(int(close_mosaic), (epochs + 1) // 2)


@dataclass(frozen=True)
class Stop:
    reason: StopReason
    message: str = ""  # for PREEMPTED and NAN_BUDGET: what the user is told; for REQUESTED, the listener's reason
    epochs: int = 0  # epochs this process trained to their end (the end summary's count)


@dataclass(frozen=True)
class TrainResult:
    """What a finished run hands its caller (train.py's main, the Python API): its files and best.pt's scores."""

    save_dir: Path
    best: Path | None  # None when no epoch was validated
    last: Path
    metrics: dict[str, Any]  # best.pt's validation (DetectionMetrics.as_dict: mp, mr, map50, map, fitness, per class)
    epochs: int  # epochs trained to their end in this call
    stop: str  # a StopReason value: finished, time budget, early stop or requested

    def as_dict(self) -> dict[str, Any]:
        """Plain values (json): the Python API carries a data-parallel run's result from rank 0 this way."""
        return {**asdict(self), "save_dir": str(self.save_dir), "best": str(self.best) if self.best else None,
                "last": str(self.last)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainResult:
        return cls(**{**d, "save_dir": Path(d["save_dir"]), "best": Path(d["best"]) if d["best"] else None,
                      "last": Path(d["last"])})


@dataclass(frozen=True)
class SavedRun:
    """A checkpoint to resume, read once; ``load`` refuses files that hold no training state."""

    path: Path
    ckpt: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> SavedRun:
        ckpt = load_checkpoint(path)
        if "converted_from" in ckpt:
            raise UserError(f"{path}: a converted YOLOv5/Ultralytics checkpoint has no training state to resume; "
                            f"fine-tune from it with --weights {path}")
        if "optimizer" not in ckpt:
            raise UserError(f"{path}: this run finished (its optimizer state was stripped); nothing to resume")
        return cls(Path(path), ckpt)

    @property
    def args(self) -> dict[str, Any]:
        return self.ckpt["args"]

    @property
    def epochs_done(self) -> int:
        return self.ckpt["epoch"] + 1

    @property
    def batches_done(self) -> int:
        return int(self.ckpt.get("batches_done", 0))

    @property
    def model_yaml(self) -> dict:
        return self.ckpt["model_yaml"]

    @property
    def model_weights(self) -> dict[str, torch.Tensor]:
        return self.ckpt["model"]

    @property
    def hyp(self) -> dict[str, float]:
        return self.ckpt["hyp"]

    @property
    def optimizer_choice(self) -> OptimizerChoice | None:
        """The run's own optimizer (runs saved before --optimizer auto have none)."""
        return OptimizerChoice(**self.ckpt["optimizer_choice"]) if "optimizer_choice" in self.ckpt else None


@dataclass
class RunState:
    """What the loop and its hooks change as a run trains: the cursor, the best fitness and last metrics, and the
    components that own the rest of the loop's state (the early stop, the time budget, the sampler's close_mosaic
    epoch, the trackers' ids). What the step changes (model, EMA, optimizer, GradScaler, LR schedule, running
    loss) the step owns and checkpoints (utils/engine/step.py)."""

    epochs: int  # the run's length: --epochs, or what --time refitted it to
    device: torch.device  # the RNG states saved and restored include this device's
    sampler: TrainSampler
    stopper: EarlyStopping
    clock: TimeBudget
    epoch: int = 0  # the epoch in progress (0-based)
    batches_done: int = 0  # batches of it done (the resume position; a checkpoint's batches_done)
    best_fitness: float = 0.0
    metrics: DetectionMetrics | None = None  # the last validation's
    resumed: bool = False
    tracking: dict[str, str] = field(default_factory=dict)  # experiment trackers' ids (MLflow's run), rank 0's

    def mid_epoch(self, batches_per_epoch: int) -> bool:
        return 0 < self.batches_done < batches_per_epoch

    def replan(self, epochs: int, close_mosaic: int) -> None:
        """--time refitted the run to ``epochs``: close_mosaic follows (a closed mosaic stays closed); the step's
        LR schedule is refitted beside it (``LRSchedule.refit``)."""
        self.epochs = epochs
        done, off = self.epoch + 1, self.sampler.mosaic_off_from_epoch
        if close_mosaic > 0 and (off is None or off > done):
            self.sampler.close_mosaic_from(max(mosaic_off_from(close_mosaic, epochs), done))

    def state_dict(self, mid_epoch: bool) -> dict[str, Any]:
        """The loop's keys of a checkpoint, in weights_only-safe types (``make_checkpoint`` adds the step's)."""
        out = {"epoch": self.epoch - 1 if mid_epoch else self.epoch, "best_fitness": float(self.best_fitness),
               "early_stop": self.stopper.state_dict(), "rng": rng_states(self.device), **self.clock.state_dict(),
               **self.sampler.state_dict(), "metrics": self.metrics.as_dict() if self.metrics else {}}
        if self.tracking:  # a resumed run continues the same tracker run (utils/engine/track)
            out["tracking"] = dict(self.tracking)
        if mid_epoch:
            out["batches_done"] = self.batches_done
        return out

    def load_state_dict(self, ckpt: dict[str, Any], restore_mosaic: bool) -> None:
        """Continue a saved run; ``restore_mosaic``: take its close_mosaic epoch (--time moved it) rather than
        the one the build computed from --epochs."""
        self.stopper.load_state_dict(ckpt["early_stop"])
        set_rng_states(ckpt["rng"], self.device)
        self.epoch, self.batches_done = ckpt["epoch"] + 1, int(ckpt.get("batches_done", 0))
        self.best_fitness = ckpt["best_fitness"]
        self.clock.load_state_dict(ckpt)
        if restore_mosaic and "mosaic_off_from_epoch" in ckpt:
            self.sampler.load_state_dict(ckpt)
        self.tracking = {str(k): str(v) for k, v in (ckpt.get("tracking") or {}).items()}
        self.resumed = True


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint says the run is, beside its state: the model to rebuild, the arguments (with the
    run's current epoch count, and the image size it trains at: --imgsz rounded up to the stride) and
    hyperparameters to resume with, the names, and how its metrics were computed."""

    model_yaml: dict[str, Any]
    optimizer_choice: OptimizerChoice
    step: dict[str, Any]  # StepPlan.record(): how a batch became optimizer steps, and the images per step
    seed: int
    world_size: int
    hyp: dict[str, Any]
    args: dict[str, Any]
    names: list[str]
    val_precision: str  # fp32, or the --amp precision validation ran in (bf16 on CPU, fp16 on CUDA)

    def as_dict(self) -> dict[str, Any]:
        return {"model_yaml": to_plain(self.model_yaml), "optimizer_choice": asdict(self.optimizer_choice),
                "step": to_plain(self.step), "seed": self.seed, "world_size": self.world_size, "hyp": self.hyp, "args": to_plain(self.args),
                "names": list(self.names), "val_precision": self.val_precision, "versions": versions(),
                "date": now_iso()}


def make_checkpoint(state: RunState, step: Step, record: RunRecord) -> dict[str, Any]:
    """Everything an exact continuation needs, in weights_only-safe types: the loop's state, the step's, and
    the record of what the run is."""
    mid = state.mid_epoch(step.plan.batches_per_epoch)
    return {**state.state_dict(mid), **step.state_dict(mid), **record.as_dict()}


RESULT_FILE_ENV = "YOLOTRAIN_RESULT_FILE"  # set by the Python API's launcher (yolotrain/launch.py)


def hand_back(result: TrainResult, is_main: bool) -> None:
    """Rank 0 leaves its result where the Python API's launcher asked (json), when it asked."""
    path = os.environ.get(RESULT_FILE_ENV)
    if path and is_main:
        with atomic_write(path, "w", encoding="utf-8") as f:
            json.dump(result.as_dict(), f)


def train_result(save_dir: Path, end: Stop) -> TrainResult:
    """The finished run's result, on every rank (best.pt's metrics are read where the file is: rank 0's node)."""
    best, last = save_dir / "weights" / "best.pt", save_dir / "weights" / "last.pt"
    best = best if best.exists() else None
    return TrainResult(save_dir=save_dir, best=best, last=last, metrics=saved_metrics(best) if best else {},
                       epochs=end.epochs, stop=end.reason.value)


def saved_metrics(path: Path) -> dict[str, float]:
    """The metrics a checkpoint was saved with ({} when none)."""
    return load_checkpoint(path).get("metrics") or {} if path.exists() else {}
