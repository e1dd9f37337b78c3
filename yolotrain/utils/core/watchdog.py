"""Hangs name themselves: a rank that makes no progress for ``--hang-timeout`` minutes says where it
is stuck and exits with ``EXIT_HUNG``, instead of the job hanging silently until gloo's or NCCL's
own timeout (30 minutes, 4 hours for the CPU object group) with no hint of the cause.

Each rank runs its own ``Watchdog``: a daemon thread that checks when this rank last made progress.
Entering or leaving a phase (``with watch.phase("loader")``) and ``beat()`` are progress. On timeout
the rank writes one line to stderr, e.g. ``rank 1: no progress for 30.0 min in phase 'step >
collective all_reduce_sum' (epoch 3, batch 17); exiting with code 124``, then the Python stacks of
its threads, and exits. A rank stuck waiting in a collective for a stalled peer does the same,
naming the collective.

train.py hands its Watchdog to the loop. The code beneath that is shared with val.py and the data
layer (the collectives of utils/core/dist.py, the label scan, the image cache, the evaluation's
batches) would need it threaded through every API, so a started Watchdog is also *installed* as the
process's one, and those places report through the module functions ``phase``, ``beat`` and
``beats``, which do nothing when none is installed (val.py, detect.py, tests).

Leaf module: standard library only, so utils/core/dist.py can name its collectives here.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterable, Iterator, NoReturn, TypeVar

from yolotrain.utils.core.errors import EXIT_HUNG

T = TypeVar("T")
_INSTALLED: Watchdog | None = None  # the started Watchdog of this process (Watchdog.start)


@dataclass(frozen=True)
class Phase:
    """One entry of the phase stack: what the rank is doing, where, and how long it may go quiet."""

    name: str  # "loader", "step", "collective all_reduce_sum", ...
    detail: str  # e.g. "epoch 3, batch 17"; inherited from the enclosing phase when not given
    limit_s: float  # seconds without progress before the watchdog fires


class Watchdog:
    """This rank's hang watchdog; ``timeout_s`` 0 disables it (no thread, phases still tracked).

    ``peers``: other ranks may be blocked on this one. A rank that fires then waits ``grace_s``
    (half the timeout, at most a minute) before exiting: the ranks waiting on it stopped making
    progress at most a step later, so they name their own phase before this exit turns their wait
    into a connection error.
    """

    MAX_GRACE_S = 60.0

    def __init__(self, rank: int, timeout_s: float, peers: bool = False) -> None:
        if not timeout_s >= 0:
            raise ValueError(f"hang timeout must be >= 0 seconds, got {timeout_s}")
        self.rank, self.timeout_s = rank, float(timeout_s)
        self.grace_s = min(self.timeout_s / 2, self.MAX_GRACE_S) if peers else 0.0
        self._stack: tuple[Phase, ...] = ()  # replaced whole, never mutated: the thread reads it unlocked
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self) -> Watchdog:
        """Start watching and install as the process's watchdog (a no-op when disabled)."""
        global _INSTALLED
        if self.enabled and self._thread is None:
            self.beat()
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()
            _INSTALLED = self
        return self

    def stop(self) -> None:
        """Stop watching (end of training, preemption, an error). After a report it waits for the exit."""
        global _INSTALLED
        if _INSTALLED is self:
            _INSTALLED = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def beat(self) -> None:
        """Progress: restart the clock (one float store, cheap enough per file or batch)."""
        self._last = time.monotonic()

    @contextmanager
    def phase(self, name: str, detail: str | None = None, patience_s: float = 0.0) -> Iterator[None]:
        """Mark what the rank is doing; entering and leaving are progress. ``patience_s``: a wait that
        may legitimately last longer than the timeout (e.g. for another node's data preparation)."""
        outer = self._stack
        inherited = outer[-1].detail if outer else ""
        self.beat()  # before the stack changes: a shorter limit never meets a stale clock
        self._stack = outer + (Phase(name, inherited if detail is None else detail, max(self.timeout_s, patience_s)),)
        try:
            yield
        finally:
            self.beat()
            self._stack = outer

    def where(self) -> str:
        """The current phase path and detail: "phase 'step > collective all_reduce_sum' (epoch 3, batch 17)"."""
        stack = self._stack
        if not stack:
            return "no marked phase"
        detail = f" ({stack[-1].detail})" if stack[-1].detail else ""
        return f"phase '{' > '.join(p.name for p in stack)}'{detail}"

    def _watch(self) -> None:
        poll = min(max(self.timeout_s / 20, 0.01), 5.0)
        while not self._stop.wait(poll):
            stack = self._stack
            idle = time.monotonic() - self._last
            if idle >= (stack[-1].limit_s if stack else self.timeout_s):
                self._fire(idle)

    def _fire(self, idle: float) -> NoReturn:
        """Name the phase, dump every thread's stack, give peers their grace, end the loader workers, exit."""
        try:  # whatever fails while reporting, the rank must still exit
            # from a new line (a progress bar may hold the current one), one write, so ranks do not interleave
            then = f" in {_duration(self.grace_s)} (time for the ranks waiting on it to report)" if self.grace_s else ""
            _write(f"\nrank {self.rank}: no progress for {_duration(idle)} in {self.where()}; exiting with code "
                   f"{EXIT_HUNG}{then}. Stacks of its threads:\n")
            faulthandler.dump_traceback(file=2, all_threads=True)
            _flush_streams()
            time.sleep(self.grace_s)
            _kill_children()
        finally:
            os._exit(EXIT_HUNG)


def phase(name: str, detail: str | None = None, patience_s: float = 0.0) -> AbstractContextManager[None]:
    """``Watchdog.phase`` on the installed watchdog; nothing when none is installed."""
    watch = _INSTALLED
    return watch.phase(name, detail, patience_s) if watch is not None else nullcontext()


def beat() -> None:
    """``Watchdog.beat`` on the installed watchdog; nothing when none is installed."""
    watch = _INSTALLED
    if watch is not None:
        watch.beat()


def beats(items: Iterable[T]) -> Iterator[T]:
    """Yield ``items``, beating as each arrives: a long pass over files or batches is progress."""
    for item in items:
        beat()
        yield item


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _write(text: str) -> None:
    """Straight to file descriptor 2: unbuffered, and past any lock of logging or sys.stderr that the
    stuck thread may hold."""
    os.write(2, text.encode(errors="replace"))


def _flush_streams() -> None:
    """Flush stdout/stderr (log lines still buffered) from a helper thread, waiting at most a second:
    a stream wedged by the stuck thread must not keep the rank alive."""
    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

    helper = threading.Thread(target=flush, daemon=True)
    helper.start()
    helper.join(1.0)


def _kill_children() -> None:
    """Kill this process's multiprocessing children (DataLoader workers): a worker stalled inside a
    sample never checks whether its parent is alive, and it left the rank's process group, so
    nothing else would end it."""
    for child in multiprocessing.active_children():
        try:
            child.kill()
        except (OSError, ValueError):
            pass
