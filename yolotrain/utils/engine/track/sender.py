"""A background sender: training hands it records and never waits on the network.

Records are delivered in order by one daemon thread. A failure keeps the record at the head of the queue,
warns once naming the server, and retries after a growing pause; when the server answers again the backlog
goes out. ``close`` waits a bounded time and returns what was not delivered, for the caller to keep.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from yolotrain.utils.core.logging import LOGGER

PAUSES_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # between retries while the server is away; at close, 1 s at most


class Rejected(Exception):
    """The server answered and refused a record (a bad value, not an outage): it is dropped, not retried."""


class Sender:
    """Deliver records in order on a daemon thread; ``deliver(record)`` raises on failure (Rejected: drop)."""

    def __init__(self, label: str, deliver: Callable[[dict[str, Any]], None]) -> None:
        self.label, self.deliver = label, deliver
        self._queue: deque[dict[str, Any]] = deque()
        self._cond = threading.Condition()
        self._closing = self._stopped = False
        self.failing = False  # the last attempt failed; the warning has been given
        self.warned = False
        self.rejected = 0
        self._thread = threading.Thread(target=self._run, name=f"{label} sender", daemon=True)
        self._thread.start()

    def put(self, record: dict[str, Any]) -> None:
        with self._cond:
            self._queue.append(record)
            self._cond.notify()

    def _next(self) -> dict[str, Any] | None:
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            return None if self._stopped or not self._queue else self._queue[0]

    def _run(self) -> None:
        failures = 0
        while (record := self._next()) is not None:
            try:
                self.deliver(record)
            except Rejected as e:
                self.rejected += 1
                LOGGER.warning(f"{self.label}: the server refused a {record.get('op', 'record')} record ({e}); dropped")
            except Exception as e:  # noqa: BLE001 -- any outage: keep the record and retry
                failures += 1
                self._failed(e)
                with self._cond:
                    pause = PAUSES_S[min(failures, len(PAUSES_S)) - 1]
                    self._cond.wait(min(pause, 1.0) if self._closing else pause)
                continue
            with self._cond:
                if self._queue and self._queue[0] is record:
                    self._queue.popleft()
            if self.failing:
                self.failing, failures = False, 0
                LOGGER.info(f"{self.label} answers again; sending the {len(self._queue) + 1} records kept")

    def _failed(self, e: BaseException) -> None:
        self.failing = True
        if not self.warned:
            self.warned = True
            text = str(e).splitlines()[0][:200] if str(e) else ""
            LOGGER.warning(f"{self.label} did not answer ({type(e).__name__}: {text}); training goes on, and its "
                           "records are kept and sent when it answers")

    def close(self, timeout_s: float, down_s: float = 5.0) -> list[dict[str, Any]]:
        """Deliver what is queued within ``timeout_s`` (``down_s`` while the server does not answer: it is not
        coming back in time); returns the records left, oldest first, and stops the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        start = time.monotonic()
        while self._thread.is_alive() and time.monotonic() - start < (down_s if self.failing else timeout_s):
            self._thread.join(0.1)
        with self._cond:
            self._stopped = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        return left
