"""Optimizer groups, learning-rate schedules, warmup, EMA and early stopping."""
from __future__ import annotations

import math
from copy import deepcopy
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

from yolotrain.models.yolo import de_parallel
from yolotrain.utils.core import dist
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.muon import MuSGD
from yolotrain.utils.weights.checkpoint import fp32_state_dict

NOMINAL_BATCH = 64  # weight decay is expressed per this many images; SGD recipes accumulate to it
SHORT_RUN_BATCH = 16  # --optimizer auto's short-run AdamW steps once per this many images


@dataclass(frozen=True)
class OptimizerChoice:
    """The optimizer a run trains with, after --optimizer auto is resolved. Saved in checkpoints so a
    resume (even one with more --epochs, which could flip the auto rule) keeps the run's optimizer."""

    name: str  # SGD, MuSGD, Adam or AdamW
    lr: float
    momentum: float  # SGD momentum / Adam beta1
    warmup_bias_lr: float
    reason: str
    nominal_batch: int = NOMINAL_BATCH  # images per optimizer step (accumulated); runs saved before it: 64
    class_lr_gain: float = 1.0  # LR multiplier on the head's class branches (Head.class_branches)
    steps_per_batch: int = 1  # optimizer steps per rank batch, one per part of it (utils/engine/step.py)


def smart_optimizer(model: nn.Module, name: str = "SGD", lr: float = 0.001, momentum: float = 0.9,
                    decay: float = 1e-5, boosted: Sequence[nn.Module] = (), gain: float = 1.0) -> torch.optim.Optimizer:
    """Three parameter groups, in this order: biases (no decay), norm weights (no decay), other
    weights (decay); each group's ``kind`` says which. Decay on BatchNorm scales or biases only shrinks
    them for no gain in accuracy; warmup starts the bias groups from their own LR. With ``gain`` != 1 the
    parameters of the ``boosted`` modules get three more groups of the same kinds at ``gain`` x ``lr``.
    """
    fast = {id(p) for m in boosted for p in m.parameters()} if gain != 1 else set()
    groups = [_kind_groups(model, lambda p: id(p) not in fast)]
    if fast:
        groups.append(_kind_groups(model, lambda p: id(p) in fast))
    first = groups[0]["bias"]
    # Adam(W)'s fused kernel does the whole step in one pass per tensor: several times faster on CPU than the
    # per-tensor loop, which counts once a short run steps every batch
    if name == "Adam":
        opt = torch.optim.Adam(first, lr=lr, betas=(momentum, 0.999), fused=True)
    elif name == "AdamW":
        opt = torch.optim.AdamW(first, lr=lr, betas=(momentum, 0.999), weight_decay=0.0, fused=True)
    elif name == "SGD":
        opt = torch.optim.SGD(first, lr=lr, momentum=momentum, nesterov=True)
    elif name == "MuSGD":  # Muon + SGD on the weights of 2+ dimensions (all in the decayed group), SGD elsewhere
        opt = MuSGD(first, lr=lr, momentum=momentum, nesterov=True)
    else:
        raise NotImplementedError(f"optimizer {name} not implemented")
    opt.param_groups[0]["kind"] = "bias"
    for i, kinds in enumerate(groups):
        scale = gain if i else 1.0
        for kind in ("bias", "norm", "weight")[1 if i == 0 else 0:]:
            opt.add_param_group({"params": kinds[kind], "lr": lr * scale, "kind": kind,
                                 "weight_decay": decay if kind == "weight" else 0.0})
    LOGGER.info(f"{name} parameter groups: {len(groups[0]['norm'])} weight(decay=0.0), "
                f"{len(groups[0]['weight'])} weight(decay={decay}), {len(first)} bias" +
                (f"; the class branches' {sum(map(len, groups[1].values()))} at {gain:g}x the LR" if fast else ""))
    return opt


def _kind_groups(model: nn.Module, keep: Callable[[nn.Parameter], bool]) -> dict[str, list[nn.Parameter]]:
    """The ``keep`` parameters by kind: biases, norm-layer weights, other weights."""
    norms = tuple(v for k, v in vars(nn).items() if "Norm" in k and isinstance(v, type))
    kinds: dict[str, list[nn.Parameter]] = {"bias": [], "norm": [], "weight": []}
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if keep(p):
                kind = "bias" if pname == "bias" else "norm" if pname == "weight" and isinstance(module, norms) else "weight"
                kinds[kind].append(p)
    return kinds


def lr_lambda(epochs: int, lrf: float, cos: bool = False) -> Callable[[float], float]:
    """Epoch -> LR multiplier: linear from 1 to lrf, or a one-cycle cosine."""
    if cos:
        return lambda x: ((1 - math.cos(x * math.pi / epochs)) / 2) * (lrf - 1) + 1
    return lambda x: (1 - x / epochs) * (1.0 - lrf) + lrf


WARMUP_SHARE = 0.1  # the most of a run of known length that warmup takes, above its 100-batch floor
WARMUP_FLOOR = 100  # YOLOv5's fewest warmup batches


def warmup_iters(warmup_epochs: float, batches_per_epoch: int, epochs: int | None, batch_size: int = 16) -> int:
    """YOLOv5's warmup, ``warmup_epochs`` of batches and at least 100 batches of 16 images (fewer batches at a
    larger global ``batch_size``: the floor counts images), but at most a tenth of the run's batches where
    that is above the floor (``epochs``; None: a --time run, whose length is not known). An 8-epoch run would
    otherwise spend over a third of its steps warming up; runs of 30 epochs or more keep YOLOv5's warmup."""
    floor = min(WARMUP_FLOOR, math.ceil(WARMUP_FLOOR * SHORT_RUN_BATCH / max(batch_size, 1)))
    iters = max(round(warmup_epochs * batches_per_epoch), floor)
    if epochs is None:
        return iters
    return min(iters, max(floor, round(WARMUP_SHARE * batches_per_epoch * epochs)))


@dataclass(frozen=True)
class Warmup:
    """Linear warmup of LR (bias group from warmup_bias_lr down, others from 0 up) and momentum, over ``iters``
    ticks (step.StepPlan: batches, or a short run's micro-steps); applied by LRSchedule."""

    iters: int
    bias_lr: float
    momentum0: float
    momentum: float


class LRSchedule:
    """The one writer of every parameter group's learning rate (and of momentum during warmup).

    Four things set the LR, all here: the per-batch warmup ramp, the per-epoch schedule (linear or
    cosine to lrf), --nan-recover's halving for the rest of an epoch (``scale``) and --time's refit of
    the schedule to a new epoch count. The base LR of each group is its ``initial_lr``, which a
    resumed optimizer's state brings back with the group's LR of the epoch it stands at.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: Warmup, epochs: int, lrf: float, cos: bool) -> None:
        self.optimizer, self.warmup, self.lrf, self.cos = optimizer, warmup, lrf, cos
        self.fn = lr_lambda(epochs, lrf, cos)
        self.epoch = 0  # the epoch whose LR the groups hold
        self.scale = 1.0  # --nan-recover's factor until the epoch ends
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
            g["lr"] = g["initial_lr"] * self.fn(0)

    def values(self) -> list[float]:
        """The LRs of the three base groups (bias, norm, weight): results.csv's x/lr0-2. Boosted groups
        (smart_optimizer's ``gain``) follow them at their fixed multiple."""
        return [g["lr"] for g in self.optimizer.param_groups[:3]]

    def warmup_step(self, ni: int, epoch: int) -> None:
        """Tick ``ni`` (step.StepPlan.tick, counted from the run's start) of warmup: ramp LR and momentum, then apply
        the scale."""
        if ni > self.warmup.iters:
            return
        w, xi = self.warmup, [0, self.warmup.iters]
        for j, g in enumerate(self.optimizer.param_groups):
            # bias groups (see smart_optimizer; group 0 in an optimizer saved without kinds) warm down from bias_lr
            start = w.bias_lr if g.get("kind", "bias" if j == 0 else "") == "bias" else 0.0
            g["lr"] = float(np.interp(ni, xi, [start, g["initial_lr"] * self.fn(epoch)]))
            if "momentum" in g:
                g["momentum"] = float(np.interp(ni, xi, [w.momentum0, w.momentum]))
        self._multiply(self.scale)

    def halve(self) -> None:
        """--nan-recover: half the LR until the epoch ends."""
        self.scale *= 0.5
        self._multiply(0.5)

    def next_epoch(self) -> None:
        """The epoch ended: the schedule's LR of the next one, unscaled."""
        self.epoch += 1
        self.scale = 1.0
        self._set_from_schedule()

    def refit(self, epochs: int) -> None:
        """--time changed the run's length: the schedule over ``epochs``, and the current epoch's LR from it."""
        self.fn = lr_lambda(epochs, self.lrf, self.cos)
        self._set_from_schedule()

    def _set_from_schedule(self) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * self.fn(self.epoch)

    def _multiply(self, factor: float) -> None:
        if factor != 1:
            for g in self.optimizer.param_groups:
                g["lr"] *= factor

    def state_dict(self) -> dict[str, float]:
        """The scale only: the groups' LRs travel in the optimizer's state, the epoch in the run state."""
        return {"lr_scale": float(self.scale)}

    def load_state_dict(self, state: dict, epoch: int) -> None:
        """Stand at ``epoch`` of a resumed run, its groups' LRs as the optimizer's state brought them."""
        self.epoch = epoch
        self.scale = float(state.get("lr_scale", 1.0))


class ModelEMA:
    """Exponential moving average of model weights with YOLOv5's ramped decay.

    decay(updates) = d * (1 - exp(-updates / tau)): early updates follow the model closely, later
    ones average over ~1/(1-d) steps. Kept in fp32 on every rank so validation can run anywhere.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, tau: float = 2000, updates: int = 0):
        self.ema = deepcopy(de_parallel(model)).eval()
        self.updates = updates
        self.decay_fn = lambda x: decay * (1 - math.exp(-x / tau))
        for p in self.ema.parameters():
            p.requires_grad_(False)
        self._pairs: tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]] | None = None

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay_fn(self.updates)
        averaged, current = self._tensors(de_parallel(model))
        torch._foreach_mul_(averaged, d)  # v = v * d + m * (1 - d), each tensor as before, in two launches
        torch._foreach_add_(averaged, current, alpha=1 - d)

    def _tensors(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The EMA's floating-point tensors and the model's, paired by name; found once per model, as
        building two state_dicts every step costs a slow host core milliseconds. The pairs are the parameters
        and buffers themselves, not detached views: a rollback, a resume and a checkpoint load copy into them
        in place, and a parameter whose data is replaced (``Module.to``) is still the same Parameter."""
        if self._pairs is None or self._pairs[0] is not model:
            msd = model.state_dict(keep_vars=True)
            pairs = [(v, msd[k]) for k, v in self.ema.state_dict(keep_vars=True).items()
                     if v.dtype.is_floating_point]
            self._pairs = model, [v for v, _ in pairs], [m for _, m in pairs]
        return self._pairs[1], self._pairs[2]

    def sync_buffers(self) -> None:
        """Every rank takes rank 0's EMA buffers. Each rank averages its own BatchNorm statistics (its local
        batches), so without this the ranks' EMAs drift apart and a validation would score each shard with a
        different model than the best.pt rank 0 saves. The parameters need nothing: they follow the model's,
        which DDP keeps identical."""
        dist.broadcast_tensors([b for b in self.ema.buffers() if b.dtype.is_floating_point])

    def state_dict(self) -> dict:
        """The averaged weights (fp32, on the CPU) and the update count that sets the next decay."""
        return {"weights": fp32_state_dict(self.ema), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.ema.load_state_dict(state["weights"])
        self.updates = state["updates"]


class EarlyStopping:
    """Stop when fitness has not improved for ``patience`` epochs (decided on rank 0, then broadcast)."""

    def __init__(self, patience: int = 100, best_fitness: float = 0.0, best_epoch: int = 0):
        self.patience = patience or float("inf")
        self.best_fitness = best_fitness
        self.best_epoch = best_epoch

    def __call__(self, epoch: int, fitness: float) -> bool:
        if fitness >= self.best_fitness:
            self.best_epoch, self.best_fitness = epoch, fitness
        stop = (epoch - self.best_epoch) >= self.patience
        if stop:
            LOGGER.info(f"Stopping early: no improvement in the last {self.patience} epochs; "
                        f"best was epoch {self.best_epoch}. Use --patience 0 to disable.")
        return stop

    def state_dict(self) -> dict[str, float]:
        return {"best_fitness": float(self.best_fitness), "best_epoch": int(self.best_epoch)}

    def load_state_dict(self, state: dict) -> None:
        self.best_fitness, self.best_epoch = state["best_fitness"], state["best_epoch"]
