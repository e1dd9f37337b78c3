"""What every experiment tracker shares: it listens to the run's events, and its own failures only warn,
since a tracker must never stop or slow training (utils/core/callbacks.py turns a listener's exception
into a stopped run)."""
from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Any

from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.setup import Training


class RunEnd(enum.Enum):
    """How a run ended, as MLflow names a run's status."""

    FINISHED = "FINISHED"  # the planned epochs, --time or early stop
    KILLED = "KILLED"  # a stop signal (a requeue resumes it) or Ctrl-C
    FAILED = "FAILED"  # an error or the NaN budget


def metric_name(name: str) -> str:
    """A results.csv column as trackers accept it: MLflow refuses parentheses and other punctuation."""
    return re.sub(r"[^\w\-./ :]", "", name)


def plain_value(v: Any) -> Any:
    """A parameter value trackers store: numbers, strings and bools as they are, anything else as text."""
    return v if isinstance(v, (bool, int, float, str)) else str(v)


def run_params(t: Training) -> dict[str, Any]:
    """The run's arguments and hyperparameters (their names do not overlap), as plain values."""
    return {k: plain_value(v) for k, v in {**t.cfg.as_dict(), **t.hyp.as_dict()}.items()}


class Tracker:
    """A tracker's listeners (methods named after the events) and its close; subclasses set ``name``."""

    name = "tracker"
    EVENTS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.broken = False  # after a failure this tracker goes quiet for the rest of the run

    def listen(self, callbacks: Callbacks) -> None:
        """Register each of this tracker's listeners, guarded so an exception only warns."""
        for event in self.EVENTS:
            callbacks.add(event, self.guarded(getattr(self, event)))

    def guarded(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        def listener(payload: Any) -> None:
            if not self.broken:
                try:
                    fn(payload)
                except Exception as e:  # noqa: BLE001 -- a tracker's error never stops training
                    self.fail(f"{getattr(fn, '__name__', 'listener')}", e)
        listener.__qualname__ = f"{type(self).__name__}.{getattr(fn, '__name__', 'listener')}"
        return listener

    def fail(self, where: str, e: BaseException) -> None:
        """Warn once and stop this tracker; training goes on."""
        self.broken = True
        LOGGER.warning(f"{self.name}: {where} failed ({type(e).__name__}: {e}); this tracker stops, training goes on")

    def close(self, end: RunEnd) -> None:
        """Called once on every end of the run (finished, preempted, failed)."""
