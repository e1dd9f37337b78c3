"""The engine's events and the functions listening to them: the Python API's ``add_callback`` and the
experiment trackers (TensorBoard, MLflow) subscribe here, so the loop says once what happened and
every listener hears it.

A listener's exception stops the run with the listener named (``CallbackError``, a UserError: the CLIs
print one line and exit 1, the API raises it). Trackers catch their own errors, since a tracking server
that fails must never stop training.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from yolotrain.utils.core.errors import UserError, did_you_mean

EVENTS: dict[str, str] = {  # name -> what the payload is (docs/python.md lists every field)
    "on_train_start": "TrainEvent: the run is built; nothing trained yet (config, hyp, save_dir, model)",
    "on_train_epoch_start": "TrainEvent: an epoch is about to train (epoch, epochs, lr)",
    "on_train_batch_end": "TrainEvent: a batch's backward is done (batch, losses: the epoch's running mean, stepped)",
    "on_train_epoch_end": "TrainEvent: the epoch's batches are done, before validation (losses, lr)",
    "on_val_end": "ValEvent: a validation finished (metrics, result)",
    "on_fit_epoch_end": "TrainEvent: the epoch is recorded (metrics, fitness, is_best), its checkpoint written",
    "on_model_save": "TrainEvent: a checkpoint was written (path)",
    "on_train_end": "TrainEvent: training finished (best, last, metrics)",
    "on_predict_batch_end": "PredictEvent: a batch of images or frames was predicted (results)",
    "on_export_end": "ExportEvent: an export was written and matched the checkpoint (format, path, reports)",
}


class CallbackError(UserError):
    """A user callback raised: the run stops, naming the callback and the event."""


def callback_name(fn: Callable) -> str:
    """A callback as a person would name it: module.qualname for functions, the class for other callables."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


class Callbacks:
    """Listeners per event, called in the order added."""

    def __init__(self) -> None:
        self._listeners: dict[str, list[Callable[[Any], None]]] = {e: [] for e in EVENTS}

    def add(self, event: str, fn: Callable[[Any], None]) -> None:
        """Listen to ``event`` (one of EVENTS); ``fn`` gets the event's payload as its one argument."""
        if event not in EVENTS:
            raise UserError(f"unknown callback event '{event}'.{did_you_mean(event, EVENTS)} "
                            f"Events: {', '.join(EVENTS)}")
        if not callable(fn):
            raise UserError(f"the callback for '{event}' must be callable, got {type(fn).__name__}")
        self._listeners[event].append(fn)

    def wants(self, event: str) -> bool:
        """Whether anyone listens: the loop builds a payload (and reads device values) only then."""
        return bool(self._listeners[event])

    def run(self, event: str, payload: Any) -> None:
        for fn in list(self._listeners[event]):
            try:
                fn(payload)
            except CallbackError:
                raise
            except Exception as e:
                raise CallbackError(f"callback {callback_name(fn)} on {event} raised {type(e).__name__}: {e}") from e

    def listened(self) -> list[str]:
        """The events someone listens to."""
        return [e for e, fns in self._listeners.items() if fns]

    def merged(self, other: Callbacks | None) -> Callbacks:
        """A new registry with this one's listeners, then ``other``'s (the trackers', then the user's)."""
        out = Callbacks()
        for source in (self, other):
            for event, fns in (source._listeners.items() if source else ()):
                out._listeners[event].extend(fns)
        return out
