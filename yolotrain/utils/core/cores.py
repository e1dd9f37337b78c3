"""Two trainings on one machine: the second takes the cores the first leaves, fixed for its run.

torch runs its CPU work on an OpenMP pool whose threads spin while they wait. Two jobs that each
size that pool for the whole machine (two trainings on a 2-core box, tune workers side by side)
keep descheduling each other's threads mid-region, and every step gets many times slower than
half speed (docs/benchmarks.md). So each training process records its thread count in one folder
per user while it runs, and a process that starts with the default thread count takes at most the
cores the live ones leave (at least one). A run's count never changes after its start: the floats
of a CPU step depend on it, and exact resume depends on the floats. ``--threads N`` or
``OMP_NUM_THREADS`` is the user's choice and stands (a warning says when it oversubscribes).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from yolotrain.utils.core.cpu import usable_cpus
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.logging import LOGGER

try:
    import fcntl
except ImportError:  # Windows: no flock (and no /proc), so no registry: each job sizes its threads alone
    fcntl = None


def registry_folder() -> Path:
    """This user's folder of running trainings (per user: another user's jobs are not visible)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"yolotrain-cores-{uid}"


def _start_ticks(pid: int) -> str | None:
    """A process's start time in clock ticks (/proc/<pid>/stat field 22), which tells a live process from a
    later one that reuses its pid; None when it is gone. Without /proc, "0" for any live pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "0"
    return stat[stat.rindex(")") + 2:].split()[19]


@dataclass(frozen=True)
class Holder:
    """Another live training process and the threads it runs."""
    pid: int
    job: str
    threads: int


class Registry:
    """The folder of entries, one file per training process: ``<pid>-<start ticks>`` holding "threads job"."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or registry_folder()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One process at a time reads the others and writes its entry, so two jobs started together see each other."""
        if fcntl is None:
            raise OSError("no file locks on this platform")
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.folder / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield  # closing the file releases the lock

    def entry(self, pid: int) -> Path:
        return self.folder / f"{pid}-{_start_ticks(pid) or 0}"

    def holders(self, job: str) -> list[Holder]:
        """The live processes of other jobs; entries of processes that are gone are removed."""
        found = []
        for path in self.folder.glob("*-*"):
            pid, _, ticks = path.name.partition("-")
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            if _start_ticks(int(pid)) not in (ticks, "0"):
                path.unlink(missing_ok=True)  # a killed run leaves its entry behind
                continue
            try:
                threads, _, other = path.read_text().partition(" ")
                if other != job:
                    found.append(Holder(int(pid), other, int(threads)))
            except (OSError, ValueError):  # removed while read
                continue
        return found


def job_key(env: Mapping[str, str]) -> str:
    """What the ranks of one job share (torchrun's run id, else its rendezvous address), else this process."""
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"run:{env['TORCHELASTIC_RUN_ID']}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"addr:{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return f"pid:{os.getpid()}"


def choose_threads(info: DistInfo, requested: int, default: int, cores: int, others: list[Holder],
                   explicit: bool) -> int:
    """This rank's threads: ``requested``; else torch's ``default`` capped at the rank's share of the node, and,
    unless the user chose the count (``explicit``: OMP_NUM_THREADS), at the cores the other jobs leave (>= 1)."""
    if requested > 0:
        return requested
    n = min(default, max(1, cores // max(info.local_world_size, 1)))
    if explicit or not others:
        return n
    free = cores - sum(h.threads for h in others)
    return max(1, min(n, free // max(info.local_world_size, 1)))


def set_cpu_threads(info: DistInfo, requested: int = 0) -> int:
    """Intra-op threads of a tool without a run to register (val.py, detect.py, export.py): ``requested``,
    else torch's count capped at this rank's share of the node (choose_threads' rule, other jobs aside)."""
    n = choose_threads(info, requested, torch.get_num_threads(), usable_cpus(), [], explicit=True)
    torch.set_num_threads(n)
    return n


@contextlib.contextmanager
def claim_cores(info: DistInfo, requested: int = 0, registry: Registry | None = None,
                env: Mapping[str, str] | None = None) -> Iterator[int]:
    """Set this rank's CPU threads for the run (see the module docstring), registered until it ends; then the
    process's count is restored."""
    env = os.environ if env is None else env
    registry, cores, job = registry or Registry(), usable_cpus(), job_key(env)
    try:
        with registry.locked():
            others = registry.holders(job)
            n = choose_threads(info, requested, torch.get_num_threads(), cores, others,
                               explicit="OMP_NUM_THREADS" in env)
            entry = registry.entry(os.getpid())
            entry.write_text(f"{n} {job}")
    except OSError as e:  # an unwritable temp folder costs only the sharing
        LOGGER.debug(f"CPU thread registry off ({e})")
        others, entry, n = [], None, choose_threads(info, requested, torch.get_num_threads(), cores, [], True)
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    _report(n, cores, others)
    try:
        yield n
    finally:
        torch.set_num_threads(before)  # the next run in this process (tune's trials, the API) starts from it
        if entry is not None:
            entry.unlink(missing_ok=True)


def _report(n: int, cores: int, others: list[Holder]) -> None:
    """One line when another training shares the machine: what this run took, and how to share evenly."""
    if not others:
        return
    held = sum(h.threads for h in others)
    who = (f"{len(others)} other training process(es) (pid {', '.join(str(h.pid) for h in others[:4])}) "
           f"holding {held} thread(s) on this {cores}-core machine")
    if n + held <= cores:
        LOGGER.info(f"CPU: {n} thread(s) beside {who}; the count stays fixed for the run")
        return
    even = max(1, cores // (len({h.job for h in others}) + 1))
    LOGGER.warning(f"CPU: {n} thread(s) beside {who}: the jobs' threads compete for the cores and every step slows "
                   f"down; for an even share start each job with --threads {even} (docs/training.md)")
