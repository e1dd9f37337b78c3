"""--cuda-graphs: a CUDA run's training forward and backward, each replayed as one CUDA graph per step.

On a GPU host a small model's step costs the host's launching of its kernels (about a thousand for yolov8n)
more than the GPU's arithmetic, so a step of 16 images costs about what a step of 64 does (docs/benchmarks.md,
"GPU training"). ``torch.cuda.make_graphed_callables`` captures the model's forward and its backward once, for
the run's input shape; every step then copies its images into the captured input and replays two graphs. The
loss, the optimizer, the EMA and validation stay eager.

What it relies on, checked before the run starts (``graphs_problem``, ``accumulation_problem``): one process
(DDP's all-reduce hooks would run outside the graphs), a fixed input shape (no --rect, --multi-scale), no
--compile, and one backward per optimizer step. The graphed backward hands each parameter a view of its
captured gradient; the optimizer step's ``zero_grad`` lets go of it before the next replay writes there, which a
second backward into the same step's gradients would not.
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from utils.core.logging import LOGGER


def graphs_problem(device: torch.device, world_size: int, compile_: bool, rect: bool, multi_scale: bool) -> str | None:
    """Why --cuda-graphs cannot run with these settings, as a message; None when it can."""
    if device.type != "cuda":
        return f"--cuda-graphs needs a CUDA device (this run is on {device.type})"
    if world_size > 1:
        return (f"--cuda-graphs runs one process per job (this job has {world_size}): DDP's gradient all-reduce would "
                "run outside the graphs")
    if compile_:
        return "--cuda-graphs and --compile both change how the step is launched; choose one"
    if rect or multi_scale:
        return f"--cuda-graphs needs one input shape for the run; --{'rect' if rect else 'multi-scale'} changes it"
    return None


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


class GraphedForward:
    """The training model's forward for the loop: captured at the first training batch, then replayed for every
    batch of that signature; any other input (a smaller last batch, eval mode) runs the eager module.

    The capture's warm-up passes (three forwards and backwards on a copy of the first batch) would move the
    BatchNorm statistics; they are put back, so the run trains on what it would have eagerly."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.signature: tuple | None = None
        self.replay: Any = None

    def __call__(self, x: torch.Tensor) -> Any:
        if not self.model.training:
            return self.model(x)
        if self.signature is None:  # the first training batch: capture, then its signature is the graphs'
            self.replay = capture(self.model, x)
            self.signature = input_signature(x)
        if input_signature(x) == self.signature:
            return self.replay(x)
        return self.model(x)


def capture(model: nn.Module, x: torch.Tensor) -> Any:
    """The model's forward as a graphed callable for inputs like ``x`` (run under the step's autocast, whose
    weight-cast cache must be off); the module itself keeps its eager forward."""
    start = time.perf_counter()
    buffers = [b.detach().clone() for b in model.buffers()]
    sample = x.detach().clone()  # the graph's own input buffer: never a loader buffer that is refilled later
    torch.cuda.make_graphed_callables(model, (sample,), allow_unused_input=True, capture_error_mode="thread_local")
    replay = model.forward  # make_graphed_callables put it on the instance
    del model.forward  # the class's forward again: eval, other shapes, copies of the module
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    LOGGER.info(f"--cuda-graphs: the training forward and backward captured for input {tuple(x.shape)} in "
                f"{time.perf_counter() - start:.1f} s; other input shapes run eagerly")
    return replay
