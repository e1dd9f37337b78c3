"""Distributed helpers: the only module that reads torchrun's environment.

Plain ``python train.py`` is world size 1 with no process group. Under ``torchrun`` every rank
joins the default group (nccl on CUDA, gloo on CPU) plus a CPU gloo group used for object
gathers and for the long waits of ``torch_distributed_zero_first``, which must survive a
dataset scan far longer than an NCCL watchdog would tolerate.

Every collective here names itself to the rank's hang watchdog while it waits (a phase such as
"collective all_reduce_sum", utils/core/watchdog.py), so a rank blocked on a stalled peer says
where; the collectives DDP runs inside forward and backward count as the loop's "step".
"""
from __future__ import annotations

import datetime
import gc
import inspect
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, MutableMapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from yolotrain.utils.core import watchdog
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER

_CPU_GROUP = None  # gloo group for object collectives and long waits, while a process_group() holds it
LONG_TIMEOUT = datetime.timedelta(hours=4)  # dataset scans and cache builds on huge datasets


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def dist_info(local_rank_flag: int = -1, env: MutableMapping[str, str] | None = None) -> DistInfo:
    """Where this process stands: torchrun's environment, else SLURM's (``srun python train.py``).

    A legacy ``--local-rank`` flag is used when LOCAL_RANK is unset. Under SLURM without torchrun,
    one task per GPU, the torchrun variables are derived from SLURM's and exported, so the
    process group's env:// rendezvous finds them (MASTER_ADDR: the job's first node).
    """
    env = os.environ if env is None else env
    if "RANK" not in env and int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in env:
        _export_slurm_env(env)
    world = int(env.get("WORLD_SIZE", 1))
    rank = int(env.get("RANK", 0))
    local = int(env.get("LOCAL_RANK", local_rank_flag if local_rank_flag >= 0 else 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    return DistInfo(rank=rank, local_rank=local, world_size=world, local_world_size=local_world)


def _export_slurm_env(env: MutableMapping[str, str]) -> None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT from a SLURM task's variables."""
    tasks_per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(int(tasks_per_node.split("(")[0].split(",")[0]))
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    env.setdefault("MASTER_ADDR", first_slurm_host(nodes) if nodes else "127.0.0.1")
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", 0)) % 1000))  # jobs on one node differ


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[07-09,12]-ib,cpu1' -> 'gpu07-ib' (zero padding kept)."""
    head = nodelist.strip()
    bracket, comma = head.find("["), head.find(",")
    if bracket == -1 or (comma != -1 and comma < bracket):
        return head.split(",")[0]
    close = head.index("]", bracket)
    first = head[bracket + 1:close].split(",")[0].split("-")[0]
    return head[:bracket] + first + head[close + 1:].split(",")[0]


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    """The process group's rank, for the collectives below only: the rest of the code reads DistInfo."""
    return dist.get_rank() if is_dist() else 0


def _world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


@dataclass(frozen=True)
class BatchSplit:
    """A global batch and its share on each rank, split once: every CLI's batch flag (and the API's batch=)
    counts all ranks; the loaders, the sampler, the recipe and the step plan take this rather than dividing or
    multiplying back themselves."""

    global_batch: int  # images per batch over all ranks
    world_size: int

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size


def batch_split(batch_size: int, info: DistInfo, flag: str = "--batch-size") -> BatchSplit:
    """The split of a global batch over this run's ranks; a UserError naming ``flag`` when they do not divide it."""
    if batch_size % info.world_size:
        raise UserError(f"{flag} {batch_size} must be a multiple of the world size {info.world_size}")
    return BatchSplit(batch_size, info.world_size)


def per_rank_batch(batch_size: int, info: DistInfo, flag: str = "--batch-size") -> int:
    """This rank's share of a global batch (the inference tools' form of ``batch_split``)."""
    return batch_split(batch_size, info, flag).per_rank


def select_device(device: str = "", batch_size: int = 0, info: DistInfo | None = None) -> torch.device:
    """Pick this rank's device from a YOLOv5-style string: '' (auto), 'cpu', 'cuda', '0', '0,1', 'cuda:1'.

    Indices count the devices this process sees (CUDA_VISIBLE_DEVICES). A device that is not there,
    one listed twice, or a global batch size that the world size does not divide, is a UserError."""
    info = info or dist_info()
    spec = str(device).strip().lower().replace(" ", "")
    if spec == "cpu" or (spec == "" and not torch.cuda.is_available()):
        chosen = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
        ids = _device_ids(device, spec)
        chosen = torch.device("cuda", _cuda_index(device, ids, info, torch.cuda.device_count()))
        torch.cuda.set_device(chosen)
    if batch_size > 0:  # -1: AutoBatch picks a multiple later
        per_rank_batch(batch_size, info)
    if info.is_main:
        if chosen.type == "cuda":
            p = torch.cuda.get_device_properties(chosen)
            LOGGER.info(f"torch {torch.__version__} CUDA:{chosen.index} ({p.name}, {p.total_memory / 2**30:.0f} GiB)"
                        f" x {info.world_size} rank(s)")
        else:
            LOGGER.info(f"torch {torch.__version__} CPU ({torch.get_num_threads()} threads per rank)"
                        f" x {info.world_size} rank(s)")
    return chosen


def listed_cuda_devices(device: str) -> list[int]:
    """The CUDA indices a --device string names ('0,1' -> [0, 1]); [] for '', 'cpu' or 'cuda'. The same
    parse and refusals as select_device (the Python API counts the ranks to start with it)."""
    spec = str(device).strip().lower().replace(" ", "")
    return [] if spec == "cpu" else _device_ids(device, spec) or []


def _device_ids(device: str, spec: str) -> list[int] | None:
    """The CUDA indices of a --device string ('0,1', 'cuda:1'), None for '' or 'cuda' (any visible)."""
    if spec in ("", "cuda"):
        return None
    ids = [s.removeprefix("cuda:") for s in spec.split(",") if s]
    if not ids or not all(s.isdigit() for s in ids):
        raise UserError(f"--device {device}: expected 'cpu', 'cuda' or CUDA indices like '0', '0,1' or 'cuda:1'")
    twice = sorted({s for s in ids if ids.count(s) > 1}, key=int)
    if twice:
        raise UserError(f"--device {device}: device {','.join(twice)} is listed more than once "
                        "(each rank needs a GPU of its own)")
    return [int(s) for s in ids]


def _cuda_index(device: str, ids: list[int] | None, info: DistInfo, n: int) -> int:
    """This rank's index among the ``n`` visible devices: --device's list indexed by local rank (its
    first entry for a single process), else the local rank itself. When each rank sees fewer
    devices than the node has ranks because the launcher masked them per rank (CUDA_VISIBLE_DEVICES,
    as srun --gpus-per-task does), the local rank wraps around the devices this rank sees."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    seen = f" (CUDA_VISIBLE_DEVICES={mask})" if mask else ""
    missing = [str(i) for i in ids or [] if i >= n]
    if missing:
        raise UserError(f"--device {device}: no CUDA device {','.join(missing)}: this process sees {n}{seen}, "
                        "and --device indices count the devices it sees")
    local, ranks = info.local_rank, info.local_world_size
    per_rank_mask = info.distributed and n < ranks and bool(mask)
    if not info.distributed:
        if ids and len(ids) > 1:
            LOGGER.warning(f"WARNING: --device {device}: one process uses one device, cuda:{ids[0]}; for "
                           f"data-parallel work on {len(ids)} GPUs start one process per device with "
                           f"torchrun --nproc_per_node {len(ids)}")
        return ids[0] if ids else 0
    if ids is not None and len(ids) < ranks and not per_rank_mask:
        raise UserError(f"--device {device}: {len(ids)} device(s) for {ranks} ranks on this node")
    if ids is None and n < ranks and not per_rank_mask:
        raise UserError(f"local rank {local} has no CUDA device ({n} visible for {ranks} ranks on this node): start "
                        f"one rank per GPU (torchrun --nproc_per_node {n}), or let the launcher give each rank its "
                        "own GPUs through CUDA_VISIBLE_DEVICES (srun --gpus-per-task=1)")
    choices = list(range(n)) if ids is None else ids
    return choices[local % len(choices)]  # local < len(choices) unless the devices are masked per rank


@contextmanager
def process_group(info: DistInfo, device: torch.device, min_timeout_s: float = 0.0) -> Iterator[None]:
    """Inside: the process group (nccl for CUDA, gloo for CPU) and the CPU gloo group; leaving destroys what
    this call made.

    ``min_timeout_s``: the default group's collectives wait at least this long (30 minutes otherwise), so a
    rank blocked on a stalled peer is named by its hang watchdog before gloo or NCCL gives up. Inside an outer
    call (tune.py's worker, whose trials each train) the groups are the outer call's and stay. A default group
    made by the caller's own script (the Python API under torchrun) is trained on; only the CPU group is ours.

    Leaving collects garbage first: a DDP wrapper left in a reference cycle holds its group past the destroy, and
    a gloo group freed during interpreter shutdown can abort the process (``terminate called without an active
    exception``) after the run has finished well."""
    global _CPU_GROUP
    if not info.distributed or _CPU_GROUP is not None:
        yield
        return
    made_default = not is_dist()
    if made_default:
        backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
        timeout = max(datetime.timedelta(minutes=30), datetime.timedelta(seconds=min_timeout_s))
        store = _restart_store(info, timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=info.rank,
                                    world_size=info.world_size)
    _CPU_GROUP = dist.new_group(backend="gloo", timeout=LONG_TIMEOUT)
    try:
        yield
    finally:
        gc.collect()
        if is_dist():
            dist.destroy_process_group(None if made_default else _CPU_GROUP)
        _CPU_GROUP = None


def _restart_store(info: DistInfo, timeout: datetime.timedelta):
    """After an elastic restart (torchrun --max-restarts), a store whose keys carry the attempt number.

    Workers reach the agent's store directly, where the crashed attempt's process-group keys are
    still present; reading them made restarted ranks connect to dead peers and hang. Attempt 0 uses
    torch's own env:// set-up unchanged.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if attempt == 0:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                          is_master=not agent_hosts and info.rank == 0, timeout=timeout)
    return dist.PrefixStore(f"yolotrain/attempt_{attempt}", store)


@contextmanager
def torch_distributed_zero_first(local_rank: int) -> Iterator[None]:
    """Let each node's local rank 0 do the work first (scan, cache, generate) while the others wait.

    Every rank passes one CPU-group gather: local masters after their work, the others before theirs.
    A master that fails hands its error message to the gather, so the waiting ranks stop at once with
    that same UserError (on every node, in every rank's error file) instead of hanging until a timeout.
    """
    if not is_dist():
        yield
        return
    if local_rank != 0:
        _rendezvous(None)
        yield
        return
    try:
        yield
    except BaseException as e:
        _rendezvous(str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}", raise_on_failure=False)
        raise
    _rendezvous(None)


def _rendezvous(failure: str | None, raise_on_failure: bool = True) -> None:
    """The zero-first wait: as long as the slowest node's scan or cache build, which beats only on its
    own local rank 0, so the watchdog allows it the CPU group's own timeout."""
    out: list[str | None] = [None] * _world_size()
    with watchdog.phase("collective all_gather_object (local rank 0 prepares the data)",
                        patience_s=LONG_TIMEOUT.total_seconds() - 300):  # named before gloo's own timeout
        dist.all_gather_object(out, failure, group=_CPU_GROUP)
    failures = [f for f in out if f is not None]
    if failures and raise_on_failure:
        raise UserError(failures[0])


def barrier() -> None:
    if is_dist():
        with watchdog.phase("collective barrier"):
            dist.barrier(group=_CPU_GROUP)


def all_gather_object(obj: Any) -> list[Any]:
    """Gather a picklable object from every rank (over the CPU group); world size 1 -> [obj]."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * _world_size()
    with watchdog.phase("collective all_gather_object"):
        dist.all_gather_object(out, obj, group=_CPU_GROUP)
    return out


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Gather to rank ``dst`` only (others get None), over the CPU group."""
    if not is_dist():
        return [obj]
    out = [None] * _world_size() if _rank() == dst else None
    with watchdog.phase("collective gather_object"):
        dist.gather_object(obj, out, dst=dst, group=_CPU_GROUP)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s object on every rank: how decisions made once reach every rank."""
    if not is_dist():
        return obj
    box = [obj]
    with watchdog.phase("collective broadcast_object"):
        dist.broadcast_object_list(box, src=src, group=_CPU_GROUP)
    return box[0]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor over ranks (default group); identity at world size 1."""
    if not is_dist():
        return t
    t = t.clone()
    with watchdog.phase("collective all_reduce_sum"):
        dist.all_reduce(t)
    return t


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite each tensor with rank ``src``'s, in place (default group: on the device under NCCL)."""
    if not is_dist():
        return
    with watchdog.phase("collective broadcast"):
        for t in tensors:
            dist.broadcast(t, src=src)


def reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over ranks (default group); identity at world size 1."""
    return all_reduce_sum(t) / _world_size()


def smart_DDP(model: torch.nn.Module, device: torch.device, sync_bn: bool = False) -> torch.nn.Module:
    """Wrap in DistributedDataParallel: device_ids on CUDA, none on CPU. With SyncBatchNorm the ranks'
    BatchNorm statistics already agree, so DDP does not broadcast buffers before each forward."""
    if not is_dist():
        return model
    version = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:3] if v.isdigit())
    if version[:2] == (1, 12) and version[2:] in ((), (0,)):
        raise UserError("torch 1.12.0 has a DDP bug that breaks training; use another version")
    # rank 0's buffers before every forward; torch 2.14 renamed the argument (the old name warns on every rank)
    renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
    sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": not sync_bn}
    if device.type == "cuda":
        return DDP(model, device_ids=[device.index], output_device=device.index, **sync)
    return DDP(model, **sync)
