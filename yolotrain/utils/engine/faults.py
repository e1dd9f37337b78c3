"""The machine failing under a running job: a loader worker killed, an input that cannot be read mid-run, a run
or cache folder that cannot be written.

``LoaderGuard`` hands the loop this rank's training batches. A loader worker that dies (SIGKILL from the
kernel's OOM killer, most often) is named with the likely cause and what to change, and the loader restarts at
the batch it had not delivered: the same samples in the same order, so the run goes on exactly (a few times per
rank; after that the rank stops as below). An image that vanishes or cannot be read after the scan (a shared
filesystem cleaned, a dataset re-synced, a stale NFS handle) stops the run, as a stop signal does: the rank asks
for a stop, which the next optimizer step's agreement carries to every rank, and the run leaves there with
a mid-epoch last.pt to resume from once the file is back. Until that step the rank trains on a stand-in (its
last batch again), so its collectives match the other ranks'; the checkpoint is then the state before that
step, taken by rank 0 before the step's agreement (every optimizer step keeps the model's buffers for it), so
the stand-in is never in it and a resume repeats the undisturbed run exactly. Rank 0 learns that some rank
trained on a stand-in from the process group's store, set before that rank's stepping batch, so before rank 0
can have finished that batch's gradient all-reduce.

``validate_through_kills``: a validation whose loader worker was killed runs again on fresh workers.
``check_run_folders``: the run folder and --cache-dir are checked writable on every rank before any work;
``check_resumed_data``: a resume whose train split lost (or gained) images since is refused on every rank.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

from yolotrain.utils.core import dist
from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.core.storage import check_writable, storage_error
from yolotrain.utils.data.batch import Batch
from yolotrain.utils.data.dataset import SampleKey
from yolotrain.utils.engine.preempt import StopRequest
from yolotrain.utils.engine.setup import Training

T = TypeVar("T")
MAX_RESTARTS = 3  # loader restarts per rank and run after a killed worker; the next kill stops the run
STAND_IN_KEY = "yolotrain/stand-in"  # the store's flag: some rank trains on a stand-in batch until the step


def check_run_folders(save_dir: Path, cache_dir: str | None, info: DistInfo) -> None:
    """The run folder (rank 0, which writes it) and --cache-dir (each node's local rank 0) are writable, or every
    rank stops with the first problem's line, before the scan, the model build or any rank's work."""
    problem = check_writable(save_dir, "the run folder", "--project and --name") if info.is_main else None
    if problem is None and cache_dir and info.local_rank in (-1, 0):
        problem = check_writable(Path(cache_dir), "--cache-dir", "--cache-dir")
    found = [p for p in dist.all_gather_object(problem) if p]
    if found:
        raise UserError(found[0])


def check_resumed_data(t: Training, saved) -> None:
    """A resumed run trains the data it was saved with: a train split that gives another number of batches per
    epoch (images removed or added since, found by the scan) is refused on every rank, unless --allow-changes."""
    step = (saved.ckpt.get("step") or {}) if saved is not None else {}
    was, now = step.get("batches_per_epoch"), t.plan.batches_per_epoch
    if was is None or was == now or step.get("world_size") != t.info.world_size or t.cfg.allow_changes:
        return
    raise UserError(f"{t.cfg.data}: its train split gives {now} batches per epoch per rank where the run in "
                    f"{saved.path} had {was}: images were removed or added since it was saved; put them back to "
                    "--resume it (--allow-changes continues on the data as it is)")


def _ignore_child(signum: int, frame) -> None:
    """SIGCHLD: a dead worker is found where the loader waits for it (LoaderGuard), not at any bytecode."""


class LoaderGuard:
    """This rank's training batches through what the machine does to the loader (the module's doc)."""

    def __init__(self, t: Training) -> None:
        self.t = t
        self.restarts = 0
        self.spare: Batch | None = None  # the last batch delivered: the stand-in's source
        self.stand_in: Batch | None = None
        self.stop = StopRequest()
        self.epoch, self.completed = 0, None
        self.buffers: list[torch.Tensor] = []  # rank 0: the model's buffers at the epoch's last optimizer step
        self._flagged = False  # this rank took a stand-in to train (and said so in the store)
        self.presaved: tuple[str, str] | None = None  # rank 0: ("saved" | "kept" | "refused", where or line)

    # ------------------------------------------------------------------ the batches
    def batches(self, stop: StopRequest, epoch: int, first: int) -> Iterator[Batch]:
        """The epoch's batches from ``first``; a restart after a killed worker continues at the batch not
        delivered; after a fault, stand-ins until the epoch's end (the loop leaves at the next step)."""
        self.stop, self.epoch, self.completed = stop, epoch, None
        loader, done, it = self.t.train_loader, first, None
        while True:
            try:
                it = self._open(loader) if it is None else it
                batch = next(it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001  (what is not the machine's is raised again)
                if not self._after_failure(e, it, done):
                    break
                it = None  # a fresh iterator: new workers, from the batch not delivered
                continue
            done, self.spare = done + 1, batch
            yield batch
        for _ in range(done, self.t.plan.batches_per_epoch):
            yield self.stand_in

    def _open(self, loader) -> Iterator[Batch]:
        it = iter(loader)
        if loader.num_workers > 0 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, _ignore_child)  # torch's raises in the middle of a step
        return it

    def _after_failure(self, e: Exception, it, done: int) -> bool:
        """True: a killed worker, the loader to restart at batch ``done``; False: this rank's fault is recorded
        (the stop request). Anything that is not the machine's failing is raised again."""
        where = f"epoch {self.epoch + 1}, batch {done + 1}"
        rank = f"rank {self.t.info.rank}: " if self.t.info.distributed else ""
        it = it if it is not None else getattr(self.t.train_loader, "_iterator", None)  # iter() itself failed
        killed = dead_workers(e, it)
        hint = f" {OOM_HINT}" if killed and "SIGTERM" not in killed else ""  # SIGTERM: a scheduler's stop
        if killed and self.restarts < MAX_RESTARTS:
            self.restarts += 1
            LOGGER.warning(f"WARNING: {rank}{killed} at {where}; restarted the loader there ({self.restarts}/"
                           f"{MAX_RESTARTS}).{hint}")
            self._shut(it)
            self.t.train_loader.sampler.set_epoch(self.epoch, skip=done * self.t.plan.per_rank_batch)
            return True
        if killed:
            fault = (f"{rank}{killed} at {where}, after {self.restarts} restarts of the loader.{hint}",
                     "once the workers have the memory they need")
        elif isinstance(e, UserError) or storage_error(e) is not None:
            fault = f"{rank}{e} at {where}, after the scan had read it", "once the file can be read again"
        else:
            raise e
        self._shut(it)
        self.spare = self.spare if self.spare is not None else self._readable_batch()
        if self.spare is None:  # nothing delivered yet and no sample readable: no batch can stand in
            raise UserError(fault[0]) from None
        self.stop.fault = fault
        self.stand_in = self.spare._replace(images=None if self.spare.images is None else self.spare.images.clone())
        return False

    def _readable_batch(self) -> Batch | None:
        """A batch of one readable sample (no mosaic), repeated: the stand-in of a process whose loader failed
        before it delivered anything; None when none of the first few samples reads."""
        dataset, n = self.t.train_loader.dataset, self.t.plan.per_rank_batch
        for index in range(min(len(dataset), 16)):
            try:
                return dataset.__getitems__([SampleKey(0, index, False)] * n)
            except Exception:  # noqa: BLE001  (unreadable too: the next one)
                continue
        return None

    def _shut(self, it) -> None:
        _shut_loader(self.t.train_loader, it)

    # ------------------------------------------------------------------ the stop, agreed at a step
    def taken(self, item) -> None:
        """The loop takes a batch to train: a stand-in is flagged in the store before its step's collectives."""
        if self.stand_in is not None and getattr(item, "batch", None) is self.stand_in and not self._flagged:
            self._flagged = True
            store = _store()
            if store is not None:
                store.set(STAND_IN_KEY, "1")

    def stepped(self, i: int, mloss: tuple[float, ...]) -> None:
        """An optimizer step at batch ``i`` was taken: what a checkpoint before the next one would hold
        (rank 0 keeps the model's buffers, which the next forwards change, when steps are batches apart)."""
        self.completed = (i + 1, mloss)
        if self.t.info.is_main and self.t.plan.accumulate > 1 and self.t.plan.parts == 1:
            own = list(self.t.step.model.buffers())
            if len(self.buffers) != len(own):
                self.buffers = [b.detach().clone() for b in own]
            else:
                torch._foreach_copy_(self.buffers, [b.detach() for b in own])

    def ask(self, hooks) -> tuple[bool, bool]:
        """At an optimizer step, before its agreement: (the save clock is due, a stop is asked). Rank 0 first
        writes the checkpoint before this step when some rank trained on a stand-in since the last one."""
        if self.t.info.is_main and self.presaved is None and self._stand_in_anywhere():
            self.presaved = self._presave(hooks.checkpointer)
        return hooks.clock.due(self.t.info), self.stop.requested

    def _stand_in_anywhere(self) -> bool:
        if self._flagged:
            return True
        store = _store()
        return store is not None and store.check([STAND_IN_KEY])

    def _presave(self, checkpointer) -> tuple[str, str]:
        """last.pt as it stood at this epoch's last optimizer step: its batch count, mean loss and buffers."""
        if self.completed is None and not checkpointer.last.is_file():
            return "refused", "no checkpoint of this run was written yet, so it starts again"
        if self.completed is None:  # no step of this epoch in this process: last.pt stays the resume point
            return "kept", checkpointer.saved_at or "the checkpoint this run resumed from"
        state, step, own = self.t.state, self.t.step, list(self.t.step.model.buffers())
        now, current = (state.batches_done, step.agreed), [b.detach().clone() for b in own]
        state.batches_done, step.agreed = self.completed[0], torch.tensor(self.completed[1], device=self.t.device)
        try:
            with torch.no_grad():
                for b, kept in zip(own, self.buffers):  # none kept when every batch is a step
                    b.copy_(kept)
            refused = checkpointer.write_mid_epoch(self.t)
        finally:
            with torch.no_grad():
                for b, c in zip(own, current):
                    b.copy_(c)
            state.batches_done, step.agreed = now
        if refused is not None:
            return "refused", refused
        return "saved", checkpointer.saved_at

    def at_stop(self, i: int) -> tuple[str | None, bool]:
        """Every rank, once a stop is agreed at batch ``i``'s step: the faults' line (None: a stop signal alone),
        and whether the epoch ends here with no further save (rank 0 wrote the checkpoint before the step)."""
        gathered = dist.all_gather_object((self.stop.fault, self.presaved))
        faults = [f for f, _ in gathered if f]
        if not faults:
            return None, False
        (fault, when), presaved = faults[0], gathered[0][1]
        nb, last = self.t.plan.batches_per_epoch, self.t.weights_dir / "last.pt"
        resume = f"{when}, {tool_command('train')} --resume {last} continues from it"
        if presaved is None:
            epoch = self.epoch + 1
            where = f"epoch {epoch}, batch {i + 1}/{nb}" if i < nb - 1 else f"the end of epoch {epoch}"
            return f"{fault}; saved {last} at {where}: {resume}", False
        kind, text = presaved
        if kind == "refused":
            return f"{fault}; {text}", True
        if kind == "kept":
            return f"{fault}; {last} ({text}) stays the checkpoint to resume, no optimizer step having run since: " \
                   f"{resume}", True
        return f"{fault}; saved {last} at {text}, the last optimizer step every rank's batches were read for: " \
               f"{resume}", True


OOM_HINT = ("The kernel's OOM killer sends SIGKILL when host memory runs out: fewer --workers, or --cache disk (or "
            "none) in place of --cache ram, leave more of it")


def validate_through_kills(evaluate: Callable[[], T], loader, info: DistInfo) -> T:
    """``evaluate()`` over ``loader``; a killed worker is named and the validation runs again from its first batch
    on fresh workers (its collectives come after the last batch, so the other ranks wait for this rank there),
    up to ``MAX_RESTARTS`` times; the next kill ends the run with its line."""
    rank = f"rank {info.rank}: " if info.distributed else ""
    restart = 0
    while True:
        restart += 1
        try:
            return evaluate()
        except RuntimeError as e:
            killed = dead_workers(e, getattr(loader, "_iterator", None))
            if killed is None:
                raise
            hint = f" {OOM_HINT}" if "SIGTERM" not in killed else ""
            if restart > MAX_RESTARTS:
                raise UserError(f"{rank}{killed} during validation, after {MAX_RESTARTS} fresh loaders.{hint}") \
                    from None
            LOGGER.warning(f"WARNING: {rank}{killed} during validation; validating again on a fresh loader "
                           f"({restart}/{MAX_RESTARTS}).{hint}")
            _shut_loader(loader, getattr(loader, "_iterator", None))


def _shut_loader(loader, it) -> None:
    """End ``it``'s workers (what is left of them) so that the next ``iter(loader)`` starts a new pool."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001  (a broken pool goes; the fresh one is what matters)
            pass
    if it is not None and getattr(loader, "_iterator", None) is it:
        loader._iterator = None  # persistent workers: the next iter() starts a new pool


def dead_workers(e: Exception, it) -> str | None:
    """``loader worker (pid 123) was killed by SIGKILL`` when ``e`` is the DataLoader's word for a dead worker."""
    text = str(e)
    if not isinstance(e, RuntimeError) or "DataLoader worker" not in text:
        return None
    dead = [w for w in getattr(it, "_workers", []) if not w.is_alive()]
    if not dead:
        return f"a loader worker died ({text.splitlines()[0]})"
    parts = []
    for w in dead:
        code = w.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with {code}"
        parts.append(f"loader worker (pid {w.pid}) was {how}")
    return ", ".join(parts)


def _store():
    """The process group's store (None on one process): where a rank's stand-in flag reaches rank 0."""
    if not dist.is_dist():
        return None
    from torch.distributed.distributed_c10d import _get_default_store
    return _get_default_store()
