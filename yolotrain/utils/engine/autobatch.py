"""--batch-size -1 (AutoBatch): the largest global batch that fits every rank's GPU, chosen once.

Each rank measures the peak memory of a forward and backward pass of the run's model (its yaml and
class count, the run's image size, layout and precision) at a few batch sizes, fits a line through
the points and takes the batch that leaves FREE_FRACTION of its GPU free. The ranks keep the
smallest per-rank batch, times the world size. ``resolve_config`` (utils/engine/config.py) stores
the result in the frozen config, so opt.yaml and checkpoints hold it and a resume reuses it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from yolotrain.models.heads.base import Criterion
from yolotrain.models.yolo import Model
from yolotrain.utils.core import dist, precision
from yolotrain.utils.core.cli import Range
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.core.logging import LOGGER

AUTO_BATCH = -1  # YOLOv5's and Ultralytics' spelling of "choose the batch size for me"
FREE_FRACTION = 0.20
"""Share of each GPU's usable memory left free: YOLOv5's AutoBatch default (80 % used). The measure is
the allocator's peak of allocated bytes in one step; allocator fragmentation, cuDNN workspaces that
differ per size, the EMA and optimizer copies and the validation batches come on top of it."""
PROFILE_BATCHES = (1, 2, 4, 8, 16)  # YOLOv5's and Ultralytics' profile sizes, per rank
PROFILE_BOXES = 32
"""Labels per profiled image: the loss's target assignment grows with them, so the profile includes a
busy image's worth rather than none."""
GiB = 2**30

Measure = Callable[[int], "int | None"]  # batch -> peak bytes, None when it ran out of memory


BATCH_SIZE = Range(int, min=1, also={AUTO_BATCH: "AutoBatch"})  # --batch-size's argparse type


@dataclass(frozen=True)
class BatchFit:
    """One rank's profile: the points measured, the line through them and the batch it allows."""

    points: tuple[tuple[int, int], ...]  # (batch, peak bytes) that ran
    failed: int | None  # the first batch that ran out of memory, if any
    total_bytes: int  # memory this rank may use on its GPU
    slope: float  # bytes per image
    intercept: float  # bytes at batch 0: the model, its gradients, the workspace
    batch: int  # per rank
    free: float = FREE_FRACTION

    def describe(self) -> str:
        """The fit in one line, for the log."""
        measured = ", ".join(f"{b}: {m / GiB:.2f}" for b, m in self.points)
        oom = f", out of memory at {self.failed}" if self.failed else ""
        limit = self.total_bytes * (1 - self.free)
        fits = self.intercept + self.slope * self.batch <= limit
        keeps = "keeps" if fits else "(the smallest) leaves less than"
        return (f"AutoBatch: peak GiB per batch {measured}{oom}; fit {self.slope / GiB:.4f} GiB per image + "
                f"{self.intercept / GiB:.2f} GiB; batch {self.batch} per rank {keeps} {self.free:.0%} of "
                f"{self.total_bytes / GiB:.1f} GiB free (uses <= {limit / GiB:.1f} GiB)")


def fit_batch(measure: Measure, total_bytes: int, sizes: Sequence[int] = PROFILE_BATCHES,
              free: float = FREE_FRACTION) -> BatchFit:
    """Measure ``sizes`` in order until one runs out of memory, fit memory = a + b * batch (a single point:
    through the origin) and return the largest batch within (1 - free) * total_bytes, below any failed size."""
    points: list[tuple[int, int]] = []
    failed = None
    for b in sizes:
        used = measure(b)
        if used is None:
            failed = b
            break
        points.append((b, int(used)))
    if not points:
        raise UserError(f"--batch-size -1 (AutoBatch): out of GPU memory at batch {failed}, the smallest size tried "
                        f"(of {', '.join(map(str, sizes))}); give a --batch-size, a smaller --imgsz or a smaller model")
    xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    slope, intercept = np.polyfit(xs, ys, 1) if len(points) > 1 else (ys[0] / xs[0], 0.0)
    limit = total_bytes * (1 - free)
    batch = int((limit - intercept) // slope) if slope > 0 else int(xs[-1])  # flat: noise, keep what ran
    if failed is not None:
        batch = min(batch, failed - 1)
    return BatchFit(tuple(points), failed, int(total_bytes), float(slope), float(intercept), max(batch, 1), free)


def global_batch(per_rank: Sequence[int], world_size: int) -> int:
    """The global batch every rank can hold: the smallest rank's batch times the world size, so it
    splits evenly (a multiple of the world size)."""
    return min(per_rank) * world_size


def synthetic_targets(batch: int, nc: int, boxes: int = PROFILE_BOXES) -> torch.Tensor:
    """(batch * boxes, 6) labels [image, class, x, y, w, h] (normalised), fixed by a seed."""
    g = torch.Generator().manual_seed(0)
    n = batch * boxes
    image = torch.arange(batch).repeat_interleave(boxes).float()
    cls = torch.randint(0, nc, (n,), generator=g).float()
    xy = torch.rand(n, 2, generator=g) * 0.6 + 0.2
    wh = torch.rand(n, 2, generator=g) * 0.3 + 0.02
    return torch.cat([image[:, None], cls[:, None], xy, wh], 1)


def profile_step(model: nn.Module, criterion: Criterion, batch: int, imgsz: int, nc: int, amp: bool,
                 memory_format: torch.memory_format) -> None:
    """One forward, loss and backward of ``batch`` random images with synthetic labels, on the model's
    device under the run's precision: the work whose memory AutoBatch measures."""
    device = next(model.parameters()).device
    imgs = torch.rand(batch, 3, imgsz, imgsz, device=device).contiguous(memory_format=memory_format)
    with torch.autocast(device.type, dtype=precision.amp_dtype(device), enabled=amp):
        loss, _ = criterion(model(imgs), synthetic_targets(batch, nc))
    loss.sum().backward()


def cuda_measure(model: nn.Module, hyp: Hyp, imgsz: int, nc: int, amp: bool,
                 memory_format: torch.memory_format) -> Measure:
    """``measure(batch)``: the peak allocated bytes of ``profile_step`` on the model's GPU; None when it
    runs out of memory."""
    device = next(model.parameters()).device
    criterion = model.detect.build_criterion(hyp, imgsz)

    def measure(batch: int) -> int | None:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            profile_step(model, criterion, batch, imgsz, nc, amp, memory_format)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            model.zero_grad(set_to_none=True)

    return measure


def cuda_usable_bytes(device: torch.device) -> int:
    """Memory this process may use on its GPU: what is free now plus what its allocator already holds
    (the CUDA context and other processes' memory are not ours to fill)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device))


def profile_size(imgsz: int, grid: int, multi_scale: bool) -> int:
    """The largest training image side: --multi-scale draws up to 1.5 x imgsz (utils/engine/loop.py)."""
    return (int(imgsz * 1.5) + grid - 1) // grid * grid if multi_scale else imgsz


def auto_batch_size(source: object, nc: int, hyp: Hyp, args: argparse.Namespace, device: torch.device,
                    world_size: int, amp: bool, channels_last: bool) -> int:
    """The global batch for --batch-size -1: every rank profiles the model built from ``source`` on its
    own GPU and the smallest rank's batch wins. A CUDA device is required."""
    if device.type != "cuda":
        raise UserError("--batch-size -1 (AutoBatch) needs a CUDA device; give a batch size")
    model = Model(source, nc=nc).to(device).train()
    grid = model.grid
    imgsz = profile_size(max((args.imgsz + grid - 1) // grid * grid, grid), grid, bool(args.multi_scale))
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model.to(memory_format=memory_format)
    measure = cuda_measure(model, hyp, imgsz, nc, amp, memory_format)
    try:
        fit: BatchFit | str = fit_batch(measure, cuda_usable_bytes(device))
    except UserError as e:  # the other ranks must hear of it, not wait in the gather
        fit = str(e)
    del model, measure  # the profiled model's memory goes back before training builds its own
    torch.cuda.empty_cache()
    numerics = f"autocast {str(precision.amp_dtype(device)).removeprefix('torch.')}" if amp else "fp32"
    return agree_on_batch(fit, world_size, f"imgsz {imgsz}, {numerics}")


def agree_on_batch(fit: BatchFit | str, world_size: int, note: str = "") -> int:
    """Every rank's fit (or its profile's error message) gathered and logged; the global batch all of
    them can hold (``global_batch``), or a UserError on every rank if one failed. Call it on every rank."""
    fits = dist.all_gather_object(fit)
    failed = [f"rank {r}: {f}" if world_size > 1 else f for r, f in enumerate(fits) if isinstance(f, str)]
    if failed:
        raise UserError("; ".join(failed))
    per_rank = [f.batch for f in fits]
    batch = global_batch(per_rank, world_size)
    for rank, f in enumerate(fits):
        LOGGER.info(f"{f.describe()} (rank {rank}{', ' + note if note else ''})")
    ranks = f", the least of the ranks' {per_rank}" if world_size > 1 else ""
    LOGGER.info(f"AutoBatch: --batch-size {batch} ({batch // world_size} per rank{ranks})")
    return batch
