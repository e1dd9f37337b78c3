"""The step plan: how a global batch becomes optimizer steps on each rank, decided once before training.

Accumulated batches (YOLOv5's SGD gathers 64 images a step), a step every batch, or a short run's large batch cut
into parts, each its own step (micro-steps: the batch-16 run's steps). The plan is fixed for the run; the step
(utils/engine/step.py) carries it out, the recipe's LR gain and the weight decay read its images per step, the
start summary explains it, and the checkpoint records it. ``problems`` refuses what the step cannot run, before
anything is written.

Names, the same in the start summary and the checkpoint's ``step`` record: the *global batch* (--batch-size,
images per batch over all ranks), the *per-rank batch* (its share on one rank: ``dist.BatchSplit``), *images per
step* (what one optimizer step learns from, over all ranks).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from yolotrain.utils.core.dist import BatchSplit, DistInfo
from yolotrain.utils.engine.graphs import accumulation_problem, graphs_problems
from yolotrain.utils.engine.optim import SHORT_RUN_BATCH, OptimizerChoice


# The fewest images per rank whose BatchNorm batch statistics are trusted: a short run's micro-step trains on at
# least this many, and a run whose ranks get fewer (without SyncBatchNorm) is warned at start.
BN_BATCH_FLOOR = 8


def accumulate_steps(global_batch: int, nominal_batch: int) -> int:
    """Batches accumulated into an optimizer step, so each step sees about ``nominal_batch`` images."""
    return max(round(nominal_batch / global_batch), 1)


def images_per_step(global_batch: int, accumulate: int, parts: int) -> float:
    """Images one optimizer step learns from, over all ranks: ``accumulate`` batches, or one of a batch's
    ``parts``. The one place this is derived: the plan, the recipe's LR, the weight decay, the summary and the
    checkpoint all read it."""
    return global_batch * accumulate / parts


@dataclass(frozen=True)
class StepPlan:
    """How this rank's batches become optimizer steps. A short run's large batch is cut into consecutive parts
    of at most ``part`` images, each its own step, and the warmup ramps per part (a tick), so on one rank a run
    at global batch 64 takes the batch-16 run's steps on the same images at the same LR. Otherwise a tick is a
    batch, as in YOLOv5's warmup, and a step comes every ``accumulate`` batches (and at each epoch's end)."""

    global_batch: int  # images per batch over all ranks
    world_size: int
    accumulate: int  # batches per optimizer step after the warmup's ramp
    parts: int  # optimizer steps per full batch (1 unless a short run cuts its batch)
    part: int  # the most images of a rank's batch in one part
    batches_per_epoch: int  # per rank
    ticks_per_epoch: int  # the warmup's ticks per epoch on this rank: parts, or batches

    @classmethod
    def of(cls, batch: BatchSplit, nominal_batch: int, parts: int, samples: int) -> StepPlan:
        """``batch``: the global batch and its share per rank; ``nominal_batch``: the images per step the optimizer
        gathers to (accumulation); ``parts``: the steps a short run asks per batch; ``samples``: images per rank
        per epoch (the last batch holds the rest)."""
        part = math.ceil(batch.per_rank / max(parts, 1))
        parts, (full, rest) = math.ceil(batch.per_rank / part), divmod(samples, batch.per_rank)
        return cls(batch.global_batch, batch.world_size, accumulate_steps(batch.global_batch, nominal_batch), parts,
                   part, full + (rest > 0), full * parts + math.ceil(rest / part))

    @property
    def batch(self) -> BatchSplit:
        return BatchSplit(self.global_batch, self.world_size)

    @property
    def per_rank_batch(self) -> int:
        return self.batch.per_rank

    @property
    def images_per_step(self) -> float:
        return images_per_step(self.global_batch, self.accumulate, self.parts)

    @property
    def images_per_tick(self) -> float:
        """Images over all ranks in one warmup tick (a part, or a batch): the warmup's floor counts them."""
        return self.global_batch / self.parts

    def slices(self, n: int) -> list[slice]:
        """A batch of ``n`` images in ceil(n / part) consecutive slices whose lengths differ by at most one: an
        epoch's short last batch of 32 at parts of 16 is two steps of 16, as the batch-16 run takes them."""
        bounds = np.linspace(0, n, max(math.ceil(n / self.part), 1) + 1).round().astype(int)
        return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]

    def tick(self, epoch: int, i: int, j: int = 0) -> int:
        """Part ``j`` of batch ``i`` of ``epoch``, counted from the run's start (the batch count when a batch is
        one part)."""
        return epoch * self.ticks_per_epoch + i * self.parts + j

    def describe(self) -> str:
        """The start summary's words for it."""
        if self.parts > 1:
            return f"{self.parts} optimizer steps per batch (a step per {self.images_per_step:g} images)"
        return f"accumulate {self.accumulate} (a step per {self.images_per_step:g} images)"

    def record(self) -> dict:
        """The checkpoint's ``step`` entry: the plan, and the images each optimizer step learned from."""
        return {**asdict(self), "per_rank_batch": self.per_rank_batch, "images_per_step": self.images_per_step}


def explain(plan: StepPlan, choice: OptimizerChoice, micro_steps: str, by_device: bool) -> tuple[str, str | None]:
    """The start summary's one line on how a batch becomes optimizer steps on this device and why; and the
    warning for a --micro-steps the run's optimizer does not use (None when it uses it, or nobody asked).
    ``micro_steps``: the resolved flag; ``by_device``: it was auto, resolved by the device."""
    steps = f"{plan.describe()} at global batch {plan.global_batch}"
    if choice.nominal_batch != SHORT_RUN_BATCH:  # only a short run's AdamW (--optimizer auto) cuts its batch
        unused = None if by_device or micro_steps == "off" else (
            f"WARNING: --micro-steps {micro_steps} has no effect: micro-steps cut the batch of --optimizer auto's "
            f"short-run AdamW (anchor-free and end-to-end models, short schedules); this run trains {choice.name}, "
            f"which gathers {choice.nominal_batch} images a step")
        return f"{steps}: {choice.name} gathers {choice.nominal_batch} images a step", unused
    if plan.parts > 1:
        why = (f"the short run's AdamW takes the batch-{SHORT_RUN_BATCH} run's steps" if micro_steps in ("on", "auto")
               else f"--micro-steps {micro_steps}")
        if by_device:
            why += " (--micro-steps auto: on for a CPU, where a step costs its images; off on CUDA, where each step " \
                   "has a fixed cost)"
    elif plan.global_batch <= SHORT_RUN_BATCH:
        why = f"the short run's AdamW steps every {SHORT_RUN_BATCH} images"
    elif micro_steps == "off":
        why = ("one AdamW step per batch (" + ("--micro-steps auto: off on CUDA, where each step has a fixed cost"
                                               if by_device else "--micro-steps off")
               + f"; on takes the batch-{SHORT_RUN_BATCH} run's steps)")
    else:
        why = (f"a rank's batch of {plan.per_rank_batch} is too small to cut (each part keeps at least "
               f"{BN_BATCH_FLOOR} images)")
    return f"{steps}: {why}", None


def problems(args, device: torch.device, world_size: int, nominal_batch: Callable[[], int]) -> list[str]:
    """Why the step cannot run as the resolved ``args`` ask, one sentence each; [] when it can. Checked before
    the run folder, the data scan or the model build. ``nominal_batch``: the images per step the run's optimizer
    gathers to (asked only for --cuda-graphs, which needs a step after every backward)."""
    if not args.cuda_graphs:
        return []
    nominal = nominal_batch()
    accumulation = accumulation_problem(args.batch_size, accumulate_steps(args.batch_size, nominal), nominal)
    return graphs_problems(device, world_size, args.compile, args.rect, args.multi_scale, args.sync_bn) + (
        [accumulation] if accumulation else [])


def sync_bn_applies(asked: bool, info: DistInfo, device: torch.device) -> bool:
    """Whether --sync-bn converts the model: SyncBatchNorm exchanges statistics over NCCL, so several CUDA ranks."""
    return bool(asked and info.distributed and device.type == "cuda")
