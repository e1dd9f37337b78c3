"""Sharing a machine's cores between the yolotrain processes that compute on them.

torch runs its CPU work on an OpenMP pool that spins while it waits for its threads. Two jobs
that each size that pool for the whole machine (two trainings on a 2-core box, tune workers
beside each other) keep descheduling each other's threads mid-region, and the spinning makes
every step many times slower than half speed. So every process that sets its thread count
registers in one folder per user (a file per process, named by pid and start time), and takes
``cores // processes`` threads; a running process re-counts about once a second at a step
boundary and shrinks or grows its pool as jobs come and go. ``--threads N`` keeps N threads and
is counted as N cores taken.
"""
from __future__ import annotations

import atexit
import os
import tempfile
import time
from pathlib import Path

import torch

from utils.core.logging import LOGGER

REFRESH_S = 1.0  # how often a running process re-counts the others


def share_folder() -> Path:
    """This user's registry of computing processes (one per user: another user's jobs are not visible)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"yolotrain-cores-{uid}"


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks (/proc/<pid>/stat field 22), which tells a live process
    from a later one that reuses its pid; None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None if Path("/proc/self/stat").exists() else _alive_without_proc(pid)
    return stat[stat.rindex(")") + 2:].split()[19]


def _alive_without_proc(pid: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "0"


class CoreShare:
    """This process's entry in the registry and the thread count it implies.

    ``fixed``: the threads a --threads N process keeps (0: share). ``cap``: the most threads this
    process takes (torch's default count, or the rank's share of its node's cores).
    """

    def __init__(self, cores: int, cap: int, fixed: int = 0, folder: Path | None = None) -> None:
        self.cores, self.cap, self.fixed = cores, cap, fixed
        self.folder = folder or share_folder()
        self.pid = os.getpid()
        self.entry = self.folder / f"{self.pid}-{_start_time(self.pid) or 0}"
        self.threads = 0
        self._checked = 0.0

    def join(self) -> int:
        """Register and set this process's threads; returns them."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.entry.write_text(str(self.fixed))
        except OSError as e:  # an unwritable temp folder costs only the sharing
            LOGGER.debug(f"core share off: {e}")
        return self.refresh(force=True)

    def leave(self) -> None:
        if os.getpid() == self.pid:  # never from a forked child (a loader worker) that inherited this object
            self.entry.unlink(missing_ok=True)

    def others(self) -> list[int]:
        """The fixed thread counts of the other live registered processes (0 for a sharing one); the entries
        of dead processes are removed."""
        found = []
        try:
            entries = list(self.folder.iterdir())
        except OSError:
            return found
        for entry in entries:
            pid, _, started = entry.name.partition("-")
            if not pid.isdigit() or entry == self.entry or int(pid) == self.pid:
                continue
            if _start_time(int(pid)) not in (started, "0") or not started:
                entry.unlink(missing_ok=True)
                continue
            try:
                found.append(int(entry.read_text() or 0))
            except (OSError, ValueError):  # a file being written or just removed: count it as sharing
                found.append(0)
        return found

    def fair_threads(self) -> int:
        """``fixed``, else the cores left by the fixed processes split evenly over the sharing ones, at least 1."""
        if self.fixed:
            return self.fixed
        others = self.others()
        free = self.cores - sum(others)
        return max(1, min(self.cap, free // (1 + sum(1 for n in others if n == 0))))

    def refresh(self, force: bool = False) -> int:
        """Re-count (at most once per REFRESH_S unless ``force``) and resize torch's pool when the count changed.
        Call it between steps, on the thread that runs the model: OpenMP's thread count is per calling thread."""
        now = time.monotonic()
        if not force and now - self._checked < REFRESH_S:
            return self.threads
        self._checked = now
        n = self.fair_threads()
        if n != self.threads:
            if self.threads:
                LOGGER.info(f"CPU: {n} thread(s), sharing {self.cores} cores with the yolotrain processes beside this one")
            torch.set_num_threads(n)
            self.threads = n
        return n


_share: CoreShare | None = None  # this process's entry, like torch's own thread count: one per process
_default_threads = 0  # torch's thread count before the first join (later joins lower it)


def join(cores: int, ranks_here: int = 1, fixed: int = 0) -> int:
    """Register this process (again, with new limits, for a second run in one process) and set its threads:
    ``fixed``, else at most torch's default and the rank's share of the node (``ranks_here`` ranks)."""
    global _share, _default_threads
    if _share is None or _share.pid != os.getpid():  # a forked child is a new process
        _default_threads = torch.get_num_threads()
        _share = CoreShare(cores, 1, fixed)
        atexit.register(_share.leave)
    _share.cores, _share.fixed = cores, fixed
    _share.cap = min(_default_threads, max(1, cores // max(ranks_here, 1)))
    return _share.join()


def leave() -> None:
    """The run is over: stop counting this process (the next run's join registers it again)."""
    if _share is not None and _share.pid == os.getpid():
        _share.leave()


def refresh() -> None:
    """At a step boundary: follow the processes that started or ended since the last count (cheap)."""
    if _share is not None and _share.pid == os.getpid():
        _share.refresh()
