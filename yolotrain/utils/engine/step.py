"""The training step: one batch in, its optimizer steps out, every rank in agreement; and the state it changes.

``Step`` is built from its parts (model, criterion, optimizer, GradScaler, EMA, LR schedule: ``StepParts``) and the
plan (utils/engine/plan.py), and owns them: it makes its own --nan-recover copy, keeps the epoch's running loss
and its cursor (the last optimizer step, the accumulation ramp), and checkpoints all of it (``state_dict`` /
``load_state_dict``, under the checkpoint keys the run has always written). Once a batch it runs the warmup's LR
per tick, the forward and loss under autocast (eager, or replayed as CUDA graphs), the backward (DDP's all-reduce,
or its no_sync while a step accumulates), the step's one all-reduce that every rank agrees on (``check_step``),
then unscale, clip, optimizer step and EMA; or, when a loss since the last step was not finite, the fp16
GradScaler's skip or --nan-recover's rollback. DDP is decided here and nowhere else: around the model, or under
--cuda-graphs around the graphed unit (utils/engine/graphs.py).

Its two modes are two small classes the plan chooses once (``build_step``): ``AccumulatingStep`` (a step every
``accumulate`` batches, YOLOv5's) and ``MicroSteps`` (a short run's large batch cut into parts, each its own step).
A further stateful part (a second EMA, SWA weights) is a ``StepExtra``: one class, handed to the builder, that
hears every optimizer step and checkpoints under its own key.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from yolotrain.models.heads.base import Criterion, Ranks
from yolotrain.utils.core import dist, precision
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.graphs import Capture, StepLoss
from yolotrain.utils.engine.optim import LRSchedule, ModelEMA
from yolotrain.utils.engine.plan import StepPlan, sync_bn_applies
from yolotrain.utils.engine.recover import NanRecovery
from yolotrain.utils.weights.checkpoint import fp32_state_dict


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


@dataclass(frozen=True)
class StepParts:
    """What a step changes, built together (setup.build_optimizer) and owned by the step from then on."""

    model: nn.Module  # the plain model (``wrap`` makes what the forward runs)
    criterion: Criterion
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: ModelEMA
    lr: LRSchedule  # the one writer of the optimizer's learning rates


class StepExtra(Protocol):
    """A stateful part of the step beyond its core (a second EMA, SWA weights): it hears every optimizer step
    and is checkpointed under its own ``key``. Adding one is its class and a line in the builder's list."""

    key: str

    def after_step(self, module: nn.Module) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Step:
    """One batch in, its optimizer steps out. The loop calls it once a batch, after ``begin`` at each epoch's start;
    a subclass says how a batch becomes steps (``_train``) and what a step agreed finite does (``_commit``)."""

    def __init__(self, parts: StepParts, plan: StepPlan, info: DistInfo, device: torch.device, options: StepOptions,
                 nan_recover: int = 0, extras: Sequence[StepExtra] = (), capture: Capture | None = None) -> None:
        self.model, self.criterion, self.optimizer = parts.model, parts.criterion, parts.optimizer
        self.scaler, self.ema, self.lr = parts.scaler, parts.ema, parts.lr
        self.plan, self.info, self.device, self.options, self.extras = plan, info, device, options, tuple(extras)
        self.recovery = NanRecovery(nan_recover, self.model, self.ema, self.optimizer, self.scaler)
        self.module = wrap(self.model, options, info, device)  # what the forward runs: DDP around it, it, or compiled
        self.ddp = isinstance(self.module, DDP)  # no_sync while a step accumulates (never under --cuda-graphs)
        self.loss = StepLoss(self.module, parts.criterion, graphs=options.graphs, capture=capture,
                             wrap=lambda unit: dist.smart_DDP(unit, device),  # under --cuda-graphs: DDP's unit
                             ranks=Ranks(info.world_size))  # N ranks normalise the loss as one process
        self.n_items = len(parts.criterion.loss_names)
        self.epoch, self.last_opt_step, self.accumulate = 0, -1, plan.accumulate  # the cursor
        self.mloss = torch.zeros(self.n_items, device=device)  # the epoch's running mean loss on this rank
        self.agreed: torch.Tensor | None = None  # the running mean over ranks a mid-epoch checkpoint records
        self.window_bad: torch.Tensor | None = None  # on the device: a non-finite loss since the last step
        self.overflows = Fp16Overflows()

    def begin(self, epoch: int, batches_done: int) -> None:
        """An epoch starts at ``batches_done`` (a resumed mid-epoch checkpoint's, whose running loss the step
        loaded); each epoch ended on an optimizer step."""
        self.module.train()
        self.epoch, self.accumulate = epoch, self.plan.accumulate
        self.last_opt_step = epoch * self.plan.batches_per_epoch + batches_done - 1
        resumed = batches_done and self.agreed is not None
        self.mloss = self.agreed if resumed else torch.zeros(self.n_items, device=self.device)

    def agree_loss(self) -> torch.Tensor:
        """The running mean loss over ranks (a collective: every rank calls it), kept for the next checkpoint."""
        self.agreed = dist.reduce_mean(self.mloss)
        return self.agreed

    def __call__(self, images: torch.Tensor, targets: torch.Tensor, i: int, meanwhile: Callable[[], None],
                 ask: Callable[[], tuple[bool, bool]]) -> StepResult:
        """Batch ``i`` of the epoch. ``meanwhile``: what the loop does while the device runs the batch (fetch the
        next one), before the step's host sync; ``ask``: (rank 0's save clock is due, a stop signal came), read
        at an optimizer step and agreed by every rank."""
        ni = self.epoch * self.plan.batches_per_epoch + i  # batches since the run's start
        items, at_step = self._train(images, targets, i, ni)
        finite = torch.isfinite(items).all()  # on the device: read at the optimizer step
        self.window_bad = ~finite if self.window_bad is None else self.window_bad | ~finite
        self.mloss = torch.where(finite, (self.mloss * i + items) / (i + 1), self.mloss)
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
        self._commit()
        self.last_opt_step = ni
        return StepResult(self.mloss, flags, stepped=True)

    def _train(self, images: torch.Tensor, targets: torch.Tensor, i: int, ni: int) -> tuple[torch.Tensor, bool]:
        """Forward and backward of batch ``i`` (``ni`` since the run's start): its loss items, and whether an
        optimizer step ends it."""
        raise NotImplementedError

    def _commit(self) -> None:
        """At a step every rank agreed finite: what the mode has left to do."""

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
        for extra in self.extras:
            extra.after_step(self.model)

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

    def state_dict(self, mid_epoch: bool) -> dict[str, Any]:
        """The step's keys of a checkpoint, in weights_only-safe types: the model, EMA, optimizer and GradScaler,
        the --nan-recover copy, each extra part under its key; inside an epoch also the running loss over ranks
        (``agree_loss``) and the LR schedule's epoch state."""
        ema = self.ema.state_dict()
        out = {"model": fp32_state_dict(self.model), "ema": ema["weights"], "ema_updates": ema["updates"],
               "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}
        if self.recovery.enabled:  # the rollback copy and the recoveries used
            out["nan_recovery"] = self.recovery.state_dict()
        out.update({extra.key: extra.state_dict() for extra in self.extras})
        if mid_epoch:
            out.update(mloss=self.agreed.tolist(), **self.lr.state_dict())
        return out

    def load_state_dict(self, ckpt: dict[str, Any], epoch: int, batches_done: int) -> None:
        """Continue a saved run at ``epoch``, ``batches_done`` batches into it (the model's weights were loaded
        when it was built)."""
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.ema.load_state_dict({"weights": ckpt["ema"], "updates": ckpt["ema_updates"]})
        if ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.lr.load_state_dict(ckpt if batches_done else {}, epoch)
        self.recovery.load_state_dict(ckpt.get("nan_recovery"))
        for extra in self.extras:
            if extra.key in ckpt:  # a part added since the checkpoint was written starts fresh
                extra.load_state_dict(ckpt[extra.key])
        self.agreed = torch.tensor(ckpt["mloss"], device=self.device) if batches_done else None


class AccumulatingStep(Step):
    """A step every ``accumulate`` batches (ramped up over the warmup, as YOLOv5's), and at each epoch's end; a
    tick of the warmup is a batch."""

    def _train(self, images: torch.Tensor, targets: torch.Tensor, i: int, ni: int) -> tuple[torch.Tensor, bool]:
        self.lr.warmup_step(ni, self.epoch)
        if ni <= self.lr.warmup.iters:
            self.accumulate = max(1, round(float(np.interp(ni, [0, self.lr.warmup.iters], [1, self.plan.accumulate]))))
        at_step = ni - self.last_opt_step >= self.accumulate or i == self.plan.batches_per_epoch - 1
        loss, items = self.forward(images, targets, sync=at_step)
        self.backward(loss)
        return items, at_step

    def _commit(self) -> None:
        self.recovery.remember()  # the state every batch since the last step was scored on
        self.optimizer_step()


class MicroSteps(Step):
    """A short run's large batch: per part, the warmup's LR, forward, backward and an optimizer step, so the run
    takes the batch-16 run's steps while the loader, the device feed and the step's host sync work per batch.
    Every rank's batch has the same length, so the parts (and DDP's all-reduces) match across ranks. The recovery
    state is the batch's start: a non-finite loss agreed at check_step rolls back the whole batch."""

    def _train(self, images: torch.Tensor, targets: torch.Tensor, i: int, ni: int) -> tuple[torch.Tensor, bool]:
        """The loss items are the parts' mean weighted by images; every batch ends on a step."""
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
        return items, True


def build_step(parts: StepParts, plan: StepPlan, info: DistInfo, device: torch.device, options: StepOptions,
               nan_recover: int = 0, extras: Sequence[StepExtra] = (), capture: Capture | None = None) -> Step:
    """The step the plan asks for, chosen once: micro-steps when a batch is cut into parts, else accumulation."""
    mode = MicroSteps if plan.parts > 1 else AccumulatingStep
    return mode(parts, plan, info, device, options, nan_recover, extras, capture)


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
