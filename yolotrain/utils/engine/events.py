"""What a training run tells its listeners (utils/core/callbacks.py), and when: rank 0 builds one
``TrainEvent`` per event that someone listens to, so an unheard event costs nothing (no payload, no
device read)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.engine.preempt import StopRequest
from yolotrain.utils.engine.setup import Training
from yolotrain.utils.eval.evaluate import EvalResult


@dataclass
class TrainEvent:
    """One training event. Fields an event does not concern keep their empty defaults (docs/python.md)."""

    event: str
    save_dir: Path
    epoch: int  # the epoch in progress, 0-based
    epochs: int  # the run's length (--time may refit it)
    batch: int = 0  # batches of the epoch done on rank 0
    batches: int = 0  # batches per epoch per rank
    iteration: int = 0  # batches since the run's first
    stepped: bool = False  # on_train_batch_end: an optimizer step followed this batch
    losses: dict[str, float] = field(default_factory=dict)  # the epoch's running mean loss terms
    lr: list[float] = field(default_factory=list)  # per parameter group
    metrics: dict[str, float] = field(default_factory=dict)  # mp, mr, map50, map, fitness (ValResult's names):
    # on_fit_epoch_end the epoch's validation ({} when it was not validated), on_train_end best.pt's
    row: dict[str, float] = field(default_factory=dict)  # on_fit_epoch_end: results.csv's row, by its column names
    fitness: float | None = None
    is_best: bool = False
    path: Path | None = None  # on_model_save: the file written; on_train_end: best.pt
    training: Any = None  # the run's Training (model, EMA, optimizer, config, hyp): for advanced listeners
    stop: StopRequest | None = field(default=None, repr=False)  # the run's stop machinery (request_stop)

    def request_stop(self, reason: str) -> None:
        """End the run after the epoch in progress, on every rank together, as a normal end (stop 'requested'):
        a listener deciding the run is not worth finishing (tune.py's pruner) must not leave ranks behind."""
        if self.stop is not None:
            self.stop.ask(reason)

    @property
    def model(self) -> torch.nn.Module:
        """The training model (the plain one: DDP and --compile wrap it inside the step)."""
        return self.training.step.model

    @property
    def ema(self) -> torch.nn.Module:
        """The EMA model that validation scores and checkpoints hold."""
        return self.training.step.ema.ema

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved train.py arguments."""
        return self.training.cfg.as_dict()

    @property
    def hyp(self) -> dict[str, float]:
        return self.training.hyp.as_dict()


@dataclass
class ValEvent:
    """on_val_end: a validation's result (in training, each epoch's; in val.py or YOLO.val, the run's)."""

    event: str
    metrics: dict[str, float]  # mp, mr, map50, map, fitness: the names of ValResult and TrainResult.metrics
    result: EvalResult
    save_dir: Path | None = None
    epoch: int | None = None  # in training: the epoch validated, 0-based


def metric_summary(result: EvalResult) -> dict[str, float]:
    """The headline figures of a validation and its fitness, by the API's one set of names (ValResult's
    attributes, TrainResult.metrics' keys); results.csv's column names stay in the files that need them."""
    m = result.metrics
    return {"mp": m.mp, "mr": m.mr, "map50": m.map50, "map": m.map, "fitness": m.fitness()}


class RunEvents:
    """The run's side of the callbacks: rank 0 tells its listeners; other ranks are silent."""

    def __init__(self, t: Training, callbacks: Callbacks | None, stop: StopRequest | None = None) -> None:
        self.t, self.callbacks, self.stop = t, callbacks or Callbacks(), stop or StopRequest()
        self.enabled = t.info.is_main

    def wants(self, event: str) -> bool:
        return self.enabled and self.callbacks.wants(event)

    def emit(self, event: str, **fields: Any) -> None:
        """Tell ``event``'s listeners, with the run's position filled in."""
        if not self.wants(event):
            return
        t, s = self.t, self.t.state
        self.callbacks.run(event, TrainEvent(event=event, save_dir=t.save_dir, epoch=s.epoch, epochs=s.epochs,
                                             batch=s.batches_done, batches=t.batches_per_epoch, training=t, stop=self.stop,
                                             **fields))

    def batch_end(self, ni: int, mloss: torch.Tensor | tuple[float, ...], stepped: bool) -> None:
        """After a batch: ``mloss`` the running mean, as host values when the step read them, else on the device
        (read here only when someone listens)."""
        if self.wants("on_train_batch_end"):
            values = mloss.tolist() if isinstance(mloss, torch.Tensor) else list(mloss)
            self.emit("on_train_batch_end", iteration=ni, stepped=stepped, lr=self.t.step.lr.values(),
                      losses=dict(zip(self.t.step.criterion.loss_names, values)))

    def val_end(self, result: EvalResult | None) -> None:
        if result is not None and self.wants("on_val_end"):
            self.callbacks.run("on_val_end", ValEvent("on_val_end", metric_summary(result), result, self.t.save_dir,
                                                      self.t.state.epoch))
