"""A node's local copy of the remote shards it trains from, filled in the background while reads go on.

Reading an image from object storage is one byte-range request, which costs the store's latency every time.
The first read from a shard queues a copy of the whole shard (one request) into a folder on this node's
disk, made by a background thread of the process that read it, one copy at a time; until the copy is
there, reads stay byte-range requests, after it they are local reads of the same bytes. One process per
node copies a given shard (an exclusive lock file beside it); a copy is written to a temporary name and
renamed, so a reader sees a whole shard or none.

The budget: ``YOLOTRAIN_SHARD_CACHE_GB`` caps the size of the node's copies, all indexes together (0 turns
them off); unset, copies go on while the disk keeps a tenth of its size (at least 1 GiB) free. Nothing is
evicted: once full, the shards not copied are read by range, as without the cache.
"""
from __future__ import annotations

import fcntl
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Any

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data import remote

BUDGET_ENV = "YOLOTRAIN_SHARD_CACHE_GB"
MIN_FREE = 2**30  # bytes the disk keeps free at least, without a budget


def budget_bytes() -> int | None:
    """``YOLOTRAIN_SHARD_CACHE_GB`` in bytes; None when unset (the disk's reserve decides)."""
    text = os.environ.get(BUDGET_ENV)
    if text is None:
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise UserError(f"{BUDGET_ENV}={text!r}: expected GiB for the node's shard copies, a number >= 0 (0: none)")
    return int(gb * 2**30)


class ShardCache:
    """Local copies of one index's shards in ``folder`` (named by the index's content id, under the node's
    ``yolotrain-shards`` folder); ``budget``: bytes all copies there may take (None: keep the disk's reserve)."""

    def __init__(self, folder: Path, budget: int | None) -> None:
        self.folder, self.budget = folder, budget
        self._pid: int | None = None  # the process the copier below belongs to (a forked worker makes its own)

    def __getstate__(self) -> dict[str, Any]:  # a spawned loader worker starts with no copies of its own
        return {"folder": self.folder, "budget": self.budget}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], state["budget"])

    def local(self, url: str, nbytes: int | None) -> Path | None:
        """The shard's local copy when this node has it whole; else None, after queueing its copy (``nbytes``
        long, when the index says) unless this process queued it already."""
        path = self.folder / url.rsplit("/", 1)[-1]
        if path.is_file():
            return path
        if self._pid != os.getpid():  # first use in this process: a fork's copy of the parent's queue is no use
            # (nor its word that copies stopped for room: each process says so once)
            self._pid, self._queued, self._queue, self._told_full = os.getpid(), set(), queue.Queue(), False
            threading.Thread(target=self._copier, daemon=True).start()
        if url not in self._queued:  # only this process's reading thread queues
            self._queued.add(url)
            self._queue.put((url, path, nbytes))
        return None

    def wait(self) -> None:
        """Until this process's queued copies have finished (or failed)."""
        if self._pid == os.getpid():
            self._queue.join()

    def _copier(self) -> None:
        """One copy at a time per process: the node copies as many shards at once as it has reading processes."""
        while True:
            url, path, nbytes = self._queue.get()
            try:
                self._copy(url, path, nbytes)
            finally:
                self._queue.task_done()

    def _copy(self, url: str, path: Path, nbytes: int | None) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f".{path.name}.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # another process of this node is copying it
                if path.is_file():
                    return
                if not self._room(nbytes or 0):
                    self._tell_full()
                    return
                tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
                try:
                    remote.download(url, tmp)
                    if nbytes is not None and tmp.stat().st_size != nbytes:
                        raise OSError(f"got {tmp.stat().st_size} bytes, the index says {nbytes}")
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
        except Exception as e:  # the reads go on by range, which retry and report what is wrong
            LOGGER.debug(f"{url}: no local copy ({type(e).__name__}: {e})")

    def _tell_full(self) -> None:
        """One line per process when a copy does not fit: the reads of that shard stay byte-range requests."""
        if not self._told_full:
            self._told_full = True
            limit = f"{BUDGET_ENV}={os.environ.get(BUDGET_ENV)}" if self.budget is not None else (
                "the disk's reserve (a tenth of its size, at least 1 GiB, kept free)")
            LOGGER.info(f"{self.folder}: no room for more shard copies under {limit}; "
                        f"the shards not copied are read from the store by range")

    def _room(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` fits the budget (or leaves the disk its reserve)."""
        if self.budget is not None:
            used = sum(p.stat().st_size for p in self.folder.parent.glob("*/*.tar"))
            return used + nbytes <= self.budget
        disk = shutil.disk_usage(self.folder)
        return disk.free - nbytes >= max(disk.total // 10, MIN_FREE)
