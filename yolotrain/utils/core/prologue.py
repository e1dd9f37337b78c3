"""A tool's run, set up and torn down in one place: train, val and detect each enter one RunPrologue.

Entering: where this process stands (DistInfo), logging (rank 0 talks, the others warn with their rank)
and the CPU threads (a training's are claimed, so one started beside it takes the cores left). Between
entering and ``start`` the tool resolves its arguments (a resumed run's, YOLOv5's task rules), since the
device and the limits come from them. ``start``: the device, the hang watchdog and the process group,
whose collectives outlast the watchdog and its grace (a rank waiting on a stalled one reports, then
exits 124). Leaving closes them in reverse. Nested (a tune trial inside its worker, the Python API inside
a torchrun script) the outer process group stays, because ``dist.process_group`` leaves what it did not make.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack

import torch

from yolotrain.utils.core import dist
from yolotrain.utils.core.cores import claim_cores, set_cpu_threads
from yolotrain.utils.core.logging import setup_logging
from yolotrain.utils.core.watchdog import Watchdog

GROUP_MARGIN_S = 120  # a collective's timeout beyond the hang watchdog's limit and grace


def process_group(info: dist.DistInfo, device: torch.device, watch: Watchdog) -> AbstractContextManager:
    """The job's process group (a no-op on one process), its collectives waiting as long as ``watch`` and its
    grace allow and then some, so a rank waiting on a stalled one hears of it from its watchdog first. Also
    what a tune worker joins once for all its trials (yolotrain/app/search), with a watchdog of the trials'
    limits."""
    return dist.process_group(info, device, min_timeout_s=watch.timeout_s + watch.grace_s + GROUP_MARGIN_S)


class RunPrologue:
    """``with RunPrologue(opt.local_rank, opt.threads) as run: ...; device = run.start(...)``."""

    def __init__(self, local_rank: int = -1, threads: int = 0, claim: bool = False) -> None:
        self.local_rank, self.threads, self.claim = local_rank, threads, claim
        self.info = dist.DistInfo()
        self.device: torch.device | None = None
        self.watch: Watchdog | None = None
        self._stack = ExitStack()

    def __enter__(self) -> RunPrologue:
        self.info = dist.dist_info(self.local_rank)
        setup_logging(self.info.rank, self.info.world_size)
        if self.claim:  # fixed for the run, counted for a training started beside it (utils/core/cores.py)
            self._stack.enter_context(claim_cores(self.info, self.threads))
        else:
            set_cpu_threads(self.info, self.threads)
        return self

    def start(self, device: str, batch_size: int, hang_timeout_min: float) -> torch.device:
        """The device this rank runs on, its hang watchdog (hangs name themselves) and the process group."""
        self.device = dist.select_device(device, batch_size, self.info)
        self.watch = self._stack.enter_context(Watchdog(self.info.rank, hang_timeout_min * 60,
                                                        peers=self.info.distributed))
        with self.watch.phase("init process group"):
            self._stack.enter_context(process_group(self.info, self.device, self.watch))
        return self.device

    def __exit__(self, *exc: object) -> bool:
        return bool(self._stack.__exit__(*exc))
