"""--cuda-graphs: a CUDA run's training forward, loss and backward, each step replayed as CUDA graphs.

On a GPU host a small model's step costs the host's launching of its kernels (about a thousand for yolov8n)
more than the GPU's arithmetic, so a step of 16 images costs about what a step of 64 does (docs/benchmarks.md,
"GPU training"). ``torch.cuda.make_graphed_callables`` captures the model's forward with the loss, and their
backward, once for the run's input shape; every step then copies its images and its targets (packed per image
into a fixed number of slots, models/heads/tal.pack_targets) into the captured inputs and replays two graphs. A
batch with more labels in one image than the slots hold is captured anew with enough slots (``slots_for``). A loss that
builds its targets on the host (the anchor-based family's) stays eager, and the graphs hold the model alone.
The optimizer, the EMA and validation stay eager. A loss captured with the model normalises by its own rank's
counts (an all-reduce cannot run inside a capture); eagerly, and for the anchor-based family's loss, the step
normalises by every rank's (models/heads/base.Ranks).

Under DDP (torchrun) each rank captures its own graphs: the graphed unit (``Replayable``) is what DDP wraps, so
DDP's forward broadcasts the BatchNorm buffers and prepares its reducer outside the graphs, and the gradients the
replayed backward hands the parameters are all-reduced outside them too, all at once after the backward rather
than overlapping it. No collective runs inside a capture, so a rank capturing anew alone waits for nobody.

What it relies on, checked before the run starts (``graphs_problems``, ``accumulation_problem``, by
utils/engine/step.problems): a fixed input
shape (no --rect, --multi-scale), no --compile, no --sync-bn on several ranks (its exchange runs in the forward),
and one backward per optimizer step. The graphed backward hands each parameter a view of its captured gradient;
the optimizer step's ``zero_grad`` lets go of it before the next replay writes there, which a second backward
into the same step's gradients would not.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from yolotrain.models.heads.base import ALONE, Criterion, PackedCriterion, Ranks
from yolotrain.models.heads.tal import pack_targets
from yolotrain.utils.core.logging import LOGGER

MIN_SLOTS = 32  # the fewest target slots per image a captured loss holds (slots_for)


def graphs_problems(device: torch.device, world_size: int, compile_: bool, rect: bool, multi_scale: bool,
                    sync_bn: bool = False) -> list[str]:
    """Why --cuda-graphs cannot run with these settings, one sentence each; [] when it can."""
    found = []
    if device.type != "cuda":
        found.append(f"--cuda-graphs needs a CUDA device (this run is on {device.type})")
    if sync_bn and world_size > 1:
        found.append("--cuda-graphs and --sync-bn: SyncBatchNorm exchanges statistics between ranks inside the "
                     "forward, which a graph cannot hold; choose one")
    if compile_:
        found.append("--cuda-graphs and --compile both change how the step is launched; choose one")
    if rect or multi_scale:
        found.append(f"--cuda-graphs needs one input shape for the run; --{'rect' if rect else 'multi-scale'} "
                     "changes it")
    return found


def accumulation_problem(batch: int, accumulate: int, nominal_batch: int) -> str | None:
    """--cuda-graphs needs one backward per optimizer step (see the module docstring); None when the run has it."""
    if accumulate > 1:
        return (f"--cuda-graphs needs an optimizer step after every backward; at --batch-size {batch} this run's "
                f"optimizer accumulates {accumulate} batches per step (it steps every {nominal_batch} images): "
                f"use --batch-size {nominal_batch} or more")
    return None


def input_signature(x: torch.Tensor) -> tuple:
    """What a captured graph fixes about its input: shape, memory layout, dtype and device."""
    return tuple(x.shape), x.stride(), x.dtype, x.device


def slots_for(labels: int) -> int:
    """Target slots per image for a graph that must hold ``labels`` in one image: a power of two, at least
    MIN_SLOTS, so a run captures its loss a few times at most."""
    return max(MIN_SLOTS, 1 << max(labels - 1, 0).bit_length())


class ModelLoss(nn.Module):
    """The model and its loss as one module, ``(images, packed targets) -> (loss, items)``: what the graphs
    capture when the loss takes packed targets (the criterion is not a module: its state is not the model's)."""

    def __init__(self, model: nn.Module, criterion: PackedCriterion) -> None:
        super().__init__()
        self.model = model
        self.criterion = criterion

    def forward(self, images: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.criterion.packed_loss(self.model(images), packed)


class Replayable(nn.Module):
    """The graphed unit (the model, or ModelLoss) behind one forward that replays the captured graphs for inputs of
    the captured signature and runs the unit eagerly for any other: the one module DDP wraps under --cuda-graphs,
    built before any capture, so every rank's DDP sees the same module however often a rank captures anew."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.unit = unit
        self.replay: Callable[..., Any] | None = None  # the captured forward (StepLoss captures it)
        self.signature: tuple | None = None  # the captured images' signature

    def forward(self, *args: torch.Tensor) -> Any:
        captured = self.replay is not None and input_signature(args[0]) == self.signature
        return (self.replay if captured else self.unit)(*args)


Capture = Callable[[nn.Module, tuple], Callable[..., Any]]  # (module, sample args) -> its replaying forward


class StepLoss:
    """The training step's forward and loss for the loop, ``(images, host targets) -> (loss, items)``: eager, or
    (``graphs``) captured at the first training batch and replayed for every batch of that image signature. Any
    other input (a smaller last batch) runs the unit eagerly; eval mode runs the model then the loss.

    Under --cuda-graphs ``model`` is the plain model and ``wrap`` what makes the step distributed (DDP on several
    ranks, applied to the ``Replayable``); without graphs ``model`` comes wrapped already. The capture's warm-up
    passes (three forwards and backwards on a copy of the first batch) would move the BatchNorm statistics; they
    are put back, so the run trains on what it would have eagerly."""

    def __init__(self, model: nn.Module, criterion: Criterion, graphs: bool = False,
                 wrap: Callable[[nn.Module], nn.Module] = lambda m: m, capture: Capture | None = None,
                 ranks: Ranks = ALONE) -> None:
        self.model, self.criterion, self.graphs = model, criterion, graphs
        self.ranks = ranks  # the eager loss's normalisers over every rank (a captured loss keeps its rank's)
        self.packed = isinstance(criterion, PackedCriterion)  # the loss goes into the graphs with the model
        self.replayable = Replayable(ModelLoss(model, criterion) if self.packed else model) if graphs else None
        self.net = wrap(self.replayable) if graphs else None  # what the step calls under --cuda-graphs
        self.capture = capture or capture_graphs  # a test's eager stand-in where there is no GPU
        self.slots = 0  # target slots per image the captured loss holds

    def __call__(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.graphs or not self.model.training:
            return self.criterion(self.model(images), targets, self.ranks if self.model.training else ALONE)
        graphed = self.replayable
        first = graphed.signature is None
        args: tuple[torch.Tensor, ...] = (images,)
        if self.packed:
            args = (images, pack_targets(targets, images.shape[0], images.device, self.slots))
        same = first or input_signature(images) == graphed.signature
        if same and (first or (self.packed and args[1].shape[1] > self.slots)):
            if self.packed:  # the first batch, or more labels in an image than the slots hold
                self.slots = slots_for(args[1].shape[1])
                args = (images, pack_targets(targets, images.shape[0], images.device, self.slots))
            graphed.replay = self.capture(graphed.unit, args)
            graphed.signature = input_signature(images)
        out = self.net(*args)  # replays at the captured signature, eager at any other
        return out if self.packed else self.criterion(out, targets, self.ranks)


def capture_graphs(module: nn.Module, args: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
    """``module``'s forward as a graphed callable for inputs like ``args`` (run under the step's autocast, whose
    weight-cast cache must be off); the module keeps its eager forward."""
    start = time.perf_counter()
    buffers = [b.detach().clone() for b in module.buffers()]
    sample = tuple(a.detach().clone() for a in args)  # the graph's own inputs: never a loader buffer refilled later
    torch.cuda.make_graphed_callables(module, sample, allow_unused_input=True, capture_error_mode="thread_local")
    replay = module.forward  # make_graphed_callables put it on the instance
    del module.forward  # the class's forward again: eval, other shapes, copies of the module
    with torch.no_grad():
        for b, saved in zip(module.buffers(), buffers):
            b.copy_(saved)
    what = "forward, loss and backward" if isinstance(module, ModelLoss) else "forward and backward"
    slots = f" and {args[1].shape[1]} target slots per image" if len(args) > 1 else ""
    LOGGER.info(f"--cuda-graphs: the training {what} captured for input {tuple(args[0].shape)}{slots} in "
                f"{time.perf_counter() - start:.1f} s; other input shapes run eagerly")
    return replay
