"""A scheduler's polite stop: SIGTERM (torchrun, Kubernetes, most schedulers) or SIGUSR1 (SLURM's
``--signal=USR1@90``) asks training to save and leave.

The handler only records the request; the training step reads it on every rank at each optimizer step and
carries it in the step's all-reduce (``step.check_step``), so every rank agrees (``agreed``) and stops at the
same optimizer step, even when only one of them got the signal. There the Checkpointer writes a
mid-epoch ``last.pt`` and train.py exits with ``EXIT_PREEMPTED``, so ``--resume auto`` on the
next launch continues exactly.

A listener of the run's events may ask for a stop too (``TrainEvent.request_stop``: tune.py's pruner). Listeners
run on rank 0 only, so its request travels in the epoch's end agreement (hooks.EpochEnd), rank 0's word to every
rank beside the early stop's, and every rank ends the run after that epoch, a normal end.
"""
from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records SIGTERM / SIGUSR1 on this rank, and a listener's request (``ask``). ``requested`` stays set once
    a signal came: a signal that arrives while an epoch ends (validation, checkpoint) is honoured at the next
    step."""

    def __init__(self) -> None:
        self.signal: str | None = None  # the first signal's name; a second one changes nothing
        self.agreed = False  # every rank learned of a signal at a step: the run leaves there (or at the epoch's end)
        self.asked: str | None = None  # a listener's reason to end the run after the epoch in progress
        # this rank's loader failed mid-epoch (utils/engine/faults.py), its line and when a resume will work: the run
        # stops at the next optimizer step
        self.fault: tuple[str, str] | None = None
        self.faulted: str | None = None  # agreed at the stop on every rank: the run ends with this line, exit 1
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None or self.fault is not None

    def agree(self, stop: bool) -> None:
        """A step's all-reduce said whether a stop signal reached some rank; once agreed it stays agreed."""
        self.agreed = self.agreed or stop

    def ask(self, reason: str) -> None:
        """A listener on rank 0 asks the run to end after the epoch in progress (the first reason is kept)."""
        if self.asked is None:
            self.asked = reason

    def install(self) -> StopRequest:
        """Handle the stop signals in this process (main thread only, as Python requires; a
        no-op elsewhere, e.g. when train.main runs inside a test's worker thread)."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back to the handlers before install() (a Python API caller's process lives on)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame) -> None:  # async: only record (no logging, no I/O)
        if self.signal is None:
            self.signal = signal.Signals(signum).name
