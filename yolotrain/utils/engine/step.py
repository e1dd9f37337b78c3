"""The training step: how one batch becomes optimizer steps on this rank, in one object.

``StepPlan`` says how, decided once from the global batch, the ranks and the optimizer's step size: batches
accumulated into a step (YOLOv5's SGD gathers 64 images), a step every batch, or a short run's large batch cut
into parts, each its own step (micro-steps: the batch-16 run's steps). ``Step`` does it, once a batch: the
warmup's LR per tick and the accumulation ramp, the forward and loss under autocast (eager, or replayed as CUDA
graphs), the backward (DDP's all-reduce, or its no_sync while a step accumulates), the step's one all-reduce that
every rank agrees on (``check_step``), then unscale, clip, optimizer step and EMA; or, when a loss since the last
step was not finite, the fp16 GradScaler's skip or --nan-recover's rollback. DDP is decided here and nowhere else:
around the model, or under --cuda-graphs around the graphed unit (utils/engine/graphs.py).

Names, the same in the start summary and the checkpoint's ``step`` record: the *global batch* (--batch-size,
images per batch over all ranks), the *per-rank batch* (its share on one rank), *images per step* (what one
optimizer step learns from, over all ranks) and, in the run state, *batches done* (the resume position inside
an epoch).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from yolotrain.models.heads.base import Criterion, Ranks
from yolotrain.utils.core import dist, precision
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.graphs import Capture, StepLoss, accumulation_problem, graphs_problems
from yolotrain.utils.engine.optim import SHORT_RUN_BATCH, LRSchedule, ModelEMA, OptimizerChoice
from yolotrain.utils.engine.recover import NanRecovery


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
    def of(cls, global_batch: int, world_size: int, nominal_batch: int, parts: int, samples: int) -> StepPlan:
        """``nominal_batch``: the images per step the optimizer gathers to (accumulation); ``parts``: the steps a
        short run asks per batch; ``samples``: images per rank per epoch (the last batch holds the rest)."""
        per_rank = global_batch // world_size
        part = math.ceil(per_rank / max(parts, 1))
        parts, (full, rest) = math.ceil(per_rank / part), divmod(samples, per_rank)
        return cls(global_batch, world_size, accumulate_steps(global_batch, nominal_batch), parts, part,
                   full + (rest > 0), full * parts + math.ceil(rest / part))

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.world_size

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


@dataclass(frozen=True)
class StepFlags:
    """What every rank agreed on at a step (``check_step``)."""

    save_due: bool  # rank 0's --save-interval clock
    stop: bool  # a stop signal reached some rank
    bad_ranks: tuple[int, ...] = ()  # ranks with a NaN/inf loss since the last optimizer step
    mloss: tuple[float, ...] = ()  # the epoch's running mean loss items, averaged over ranks (the progress bar)


@dataclass(frozen=True)
class StepResult:
    """One batch's step: the epoch's running mean loss on this rank, and at an optimizer step what the ranks
    agreed (``flags``), whether the step was taken, and the message that ends the run when a non-finite loss
    found no --nan-recover recovery left."""

    mloss: torch.Tensor
    flags: StepFlags | None = None  # None: the batch's gradient only accumulated
    stepped: bool = False  # False at a step: the window was rolled back (or the run ends: ``failure``)
    failure: str | None = None


@dataclass(frozen=True)
class StepOptions:
    """How the step computes, from the resolved config."""

    amp: bool  # autocast: fp16 with loss scaling on CUDA, bf16 on a CPU
    graphs: bool  # --cuda-graphs
    sync_bn: bool  # --sync-bn asked (it applies on several CUDA ranks)
    compile: bool  # --compile


FP16_OVERFLOW_PATIENCE = 10  # non-finite fp16 losses in a row the GradScaler may absorb (2**-10 of its scale)


def sync_bn_applies(asked: bool, info: DistInfo, device: torch.device) -> bool:
    """Whether --sync-bn converts the model: SyncBatchNorm exchanges statistics over NCCL, so several CUDA ranks."""
    return bool(asked and info.distributed and device.type == "cuda")


def wrap(model: nn.Module, options: StepOptions, info: DistInfo, device: torch.device) -> nn.Module:
    """What the step's forward runs: SyncBatchNorm when asked (CUDA, several ranks), then DDP when distributed
    (not under --cuda-graphs: StepLoss's graphed unit gets it), then --compile (in place, after DDP as torch
    advises: the module stays a DDP, its state_dict keys plain). The one place DDP is decided."""
    sync_bn = sync_bn_applies(options.sync_bn, info, device)
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        LOGGER.info("Using SyncBatchNorm")
    elif options.sync_bn:
        LOGGER.warning("WARNING: --sync-bn needs CUDA and more than one rank; using plain BatchNorm")
    if not options.graphs:
        model = dist.smart_DDP(model, device, sync_bn=sync_bn)
    if options.compile:
        model.compile()
        LOGGER.info("--compile: torch.compile on the training model; the first steps, and each new input shape, "
                    "compile and are slow (validation runs the EMA model uncompiled)")
    return model


class Fp16Overflows:
    """Under fp16 loss scaling a non-finite loss is an overflow the GradScaler handles: the step its gradient joins
    is skipped and the scale lowered. It stops the run (or spends a --nan-recover) only after
    FP16_OVERFLOW_PATIENCE in a row, which lowering the scale did not cure; fp32 and bf16 have no scaler."""

    def __init__(self) -> None:
        self.count = 0  # steps in a row whose non-finite loss the GradScaler absorbed

    def absorbs(self, scaler: torch.amp.GradScaler, non_finite: bool) -> bool:
        absorbed = non_finite and scaler.is_enabled() and self.count < FP16_OVERFLOW_PATIENCE
        self.count = self.count + 1 if absorbed else 0
        return absorbed


def optimizer_step(module: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   ema: ModelEMA) -> None:
    """Unscale, clip the gradient norm to 10, step, clear the gradients, update the EMA (YOLOv5's order)."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    ema.update(module)


class Step:
    """One batch in, its optimizer steps out, every rank in agreement. Built by setup from its parts; the loop
    calls it once a batch, after ``begin`` at each epoch's start."""

    def __init__(self, model: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, ema: ModelEMA, lr: LRSchedule, plan: StepPlan, recovery: NanRecovery,
                 info: DistInfo, device: torch.device, options: StepOptions, capture: Capture | None = None) -> None:
        self.model, self.optimizer, self.scaler, self.ema, self.lr = model, optimizer, scaler, ema, lr
        self.plan, self.recovery, self.info, self.device, self.options = plan, recovery, info, device, options
        self.module = wrap(model, options, info, device)  # what the forward runs: DDP around it, it, or compiled
        self.ddp = isinstance(self.module, DDP)  # no_sync while a step accumulates (never under --cuda-graphs)
        self.loss = StepLoss(self.module, criterion, graphs=options.graphs, capture=capture,
                             wrap=lambda unit: dist.smart_DDP(unit, device),  # under --cuda-graphs: DDP's unit
                             ranks=Ranks(info.world_size))  # N ranks normalise the loss as one process
        self.n_items = len(criterion.loss_names)
        self.epoch, self.last_opt_step, self.accumulate = 0, -1, plan.accumulate
        self.mloss = torch.zeros(self.n_items, device=device)
        self.window_bad: torch.Tensor | None = None  # on the device: a non-finite loss since the last step
        self.overflows = Fp16Overflows()

    def begin(self, epoch: int, batches_done: int, mloss: torch.Tensor | None) -> None:
        """An epoch starts at ``batches_done`` (a resumed mid-epoch checkpoint's), its running mean ``mloss``
        then; each epoch ended on an optimizer step."""
        self.module.train()
        self.epoch, self.accumulate = epoch, self.plan.accumulate
        self.last_opt_step = epoch * self.plan.batches_per_epoch + batches_done - 1
        self.mloss = mloss if batches_done else torch.zeros(self.n_items, device=self.device)

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, i: int, meanwhile: Callable[[], None],
                 ask: Callable[[], tuple[bool, bool]]) -> StepResult:
        """Batch ``i`` of the epoch. ``meanwhile``: what the loop does while the device runs the batch (fetch the
        next one), before the step's host sync; ``ask``: (rank 0's save clock is due, a stop signal came), read
        at an optimizer step and agreed by every rank."""
        ni = self.epoch * self.plan.batches_per_epoch + i  # batches since the run's start
        if self.plan.parts > 1:
            items, at_step = self._micro_steps(images, targets, i), True
        else:
            self.lr.warmup_step(ni, self.epoch)
            if ni <= self.lr.warmup.iters:
                self.accumulate = max(1, round(float(np.interp(ni, [0, self.lr.warmup.iters],
                                                               [1, self.plan.accumulate]))))
            at_step = ni - self.last_opt_step >= self.accumulate or i == self.plan.batches_per_epoch - 1
            loss, items = self.forward(images, targets, sync=at_step)
        finite = torch.isfinite(items).all()  # on the device: read at the optimizer step
        self.window_bad = ~finite if self.window_bad is None else self.window_bad | ~finite
        self.mloss = torch.where(finite, (self.mloss * i + items) / (i + 1), self.mloss)
        if self.plan.parts == 1:
            self.backward(loss)
        meanwhile()
        if not at_step:
            return StepResult(self.mloss)
        flags = check_step(self.window_bad, self.mloss, self.info, *ask())
        self.window_bad = None
        overflow = self.overflows.absorbs(self.scaler, bool(flags.bad_ranks))  # fp16: the scaler skips that step
        if flags.bad_ranks and not overflow:  # every rank agreed: stop, or (--nan-recover) roll back
            failure = self._skip_bad_window(flags, i)
            self.last_opt_step = ni  # the next optimizer step gathers a full accumulation from here
            return StepResult(self.mloss, flags, stepped=False, failure=failure)
        if self.plan.parts == 1:
            self.recovery.remember()  # the state every batch since the last step was scored on
            self.optimizer_step()
        self.last_opt_step = ni
        return StepResult(self.mloss, flags, stepped=True)

    def _micro_steps(self, images: torch.Tensor, targets: torch.Tensor, i: int) -> torch.Tensor:
        """A short run's large batch ``i``: per part, the warmup's LR, forward, backward and an optimizer step, so
        the run takes the batch-16 run's steps while the loader, the device feed and the step's host sync work
        per batch. Every rank's batch has the same length, so the parts (and DDP's all-reduces) match across
        ranks. The recovery state is the batch's start: a non-finite loss agreed at check_step rolls back the
        whole batch. Returns the loss items, the parts' mean weighted by images."""
        n = images.shape[0]
        items = torch.zeros((), device=images.device)
        for j, part in enumerate(self.plan.slices(n)):
            self.lr.warmup_step(self.plan.tick(self.epoch, i, j), self.epoch)
            rows = (targets[:, 0] >= part.start) & (targets[:, 0] < part.stop)
            mine = targets[rows].clone()
            mine[:, 0] -= part.start
            loss, loss_items = self.forward(images[part], mine, sync=True)
            self.backward(loss)
            if j == 0:
                self.recovery.remember()
            self.optimizer_step()
            items = items + loss_items.detach() * ((part.stop - part.start) / n)
        return items

    def autocast(self) -> torch.autocast:
        """The forward and loss precision of --amp (off: fp32). CUDA graphs capture the casts themselves, so
        autocast's cache of cast weights is off under --cuda-graphs (make_graphed_callables requires it)."""
        return torch.autocast(self.device.type, dtype=precision.amp_dtype(self.device), enabled=self.options.amp,
                              cache_enabled=not self.options.graphs)

    def forward(self, images: torch.Tensor, targets: torch.Tensor, sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and loss under autocast (host targets: each loss moves what it needs). Without ``sync`` the
        batch's gradient only accumulates: under DDP's no_sync its backward skips the all-reduce, which the
        stepping batch's does once for the accumulated sum."""
        quiet = self.module.no_sync() if self.ddp and not sync else contextlib.nullcontext()
        with quiet, self.autocast():
            return self.loss(images, targets)

    def backward(self, loss: torch.Tensor) -> None:
        """Scaled backward. DDP averages gradients over ranks while the loss is a sum over the rank's batch, so
        the loss is multiplied by the world size to keep the gradient of the global batch."""
        world = self.info.world_size
        if world > 1:
            loss = loss * world
        self.scaler.scale(loss).backward()

    def optimizer_step(self) -> None:
        optimizer_step(self.module, self.optimizer, self.scaler, self.ema)

    def _skip_bad_window(self, flags: StepFlags, i: int) -> str | None:
        """A non-finite loss on some rank since the last optimizer step, agreed by all: with a --nan-recover
        recovery left, roll back to the state before the last optimizer step, drop the batches since (their
        gradients) and halve the LR for the rest of the epoch (None); else the message that stops every rank
        together (the default, and once the recoveries are spent)."""
        recovery = self.recovery
        where = (f"epoch {self.epoch + 1}, batch {i + 1}: the loss became NaN/inf on rank(s) "
                 f"{', '.join(map(str, flags.bad_ranks))} since the last optimizer step")
        if recovery.left <= 0:
            spent = f"; all {recovery.limit} --nan-recover recoveries are used" if recovery.enabled else ""
            hint = "" if recovery.enabled else ", or let --nan-recover N roll back and skip such batches"
            return (f"{where}{spent}; checkpoints of earlier epochs are intact. Lower lr0 in the hyp yaml, "
                    f"or check the labels{hint}.")
        rolled = recovery.restore()
        self.lr.halve()
        if self.info.is_main:
            LOGGER.warning(f"WARNING: {where}; recovery {recovery.used}/{recovery.limit}: "
                           + ("rolled back to the state before the last optimizer step" if rolled
                              else "no optimizer step to undo since this process started")
                           + f", skipped the batches since, LR x{self.lr.scale:g} until the epoch ends")
        return None


def check_step(window_bad: torch.Tensor, mloss: torch.Tensor, info: DistInfo, save_due: bool,
               stop_requested: bool) -> StepFlags:
    """At each optimizer step, one all-reduce and one device-to-host copy carry every rank's NaN/inf flag for
    the batches since the last step, rank 0's --save-interval clock, every rank's stop signal and the running
    mean loss, so every rank gets the same answers at the same step (which ranks' loss was not finite, whether
    a mid-epoch save is due, whether to stop; decided together, so no rank waits in a collective for one that
    has stopped or rolled back) and the progress bar its figures without another sync."""
    world, rank = info.world_size, info.rank
    own = torch.zeros(world, device=mloss.device)
    own[rank] = window_bad.float()
    control = torch.tensor([float(save_due), float(stop_requested)], device=mloss.device)
    values = host_values(dist.all_reduce_sum(torch.cat((own, control, mloss.detach().float()))))
    return StepFlags(save_due=bool(values[world]), stop=bool(values[world + 1]),
                     bad_ranks=tuple(r for r in range(world) if values[r]),
                     mloss=tuple(v / world for v in values[world + 2:]))


def host_values(t: torch.Tensor) -> list[float]:
    """The step's one device-to-host copy (a host sync on CUDA)."""
    return t.tolist()
