"""What every detection head provides, so train.py, val.py and autoanchor never branch on the family.

A head is the model's last layer. It owns its maths:
- ``forward``: raw per-level outputs while training; in eval mode ``(decoded, raw)`` where
  ``decoded`` is (B, N, 4 + nc): box centre x, y, width, height in input pixels, then one score
  per class in [0, 1], which NMS turns into detections.
- ``end2end``: False for heads whose output needs NMS (anchor, DFL). An end-to-end (NMS-free) head
  has ``max_det`` (its top-k, settable) and, with ``end2end`` True, returns ``(dets, raw)`` in eval
  mode instead: dets (B, max_det, 6) = x1, y1, x2, y2 in input pixels, score, class index (float),
  sorted by score, with no NMS. ``yolotrain.utils.core.boxes.postprocess`` turns either form into the same
  per-image detections, so validation, plots, detect.py and export read only ``end2end``.
- ``build_criterion(hyp, imgsz)``: the loss that trains it (target assignment included).
- ``has_anchors``: whether the yaml holds anchors (its rows, the anchor count per level); ``family``, the
  recipe's key (utils/engine/recipe.py), which decides the rest (autoanchor, the hyp file, --optimizer auto),
  and the word exports carry as their ``family``.
- ``set_strides(strides)`` and ``initialize_biases()``: called once by ``Model`` after the
  strides are measured.
"""
from __future__ import annotations

from typing import Callable, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from yolotrain.utils.core.hyp import Hyp


class Ranks:
    """How a loss normalises over the ranks that train one step together. A loss divides sums by a count (the
    assigned scores, the matches); under data parallelism each rank would divide by its own count, so two ranks of
    8 images would step differently from one process of 16 whenever their counts differ. ``Ranks(world_size)``
    gives every rank the global count's share instead, one all-reduce of the counts per loss call, so N ranks
    take the one-process step (DDP averages what the ranks' backward of ``loss * world_size`` gives). The
    default, one process, leaves a loss's arithmetic exactly as it was. Set by the training step
    (utils/engine/step.py), never in validation, whose ranks run different numbers of batches."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size

    @property
    def alone(self) -> bool:
        return self.world_size == 1

    def share(self, counts: torch.Tensor, floor: float | None = None) -> torch.Tensor:
        """This rank's share of ``counts`` summed over every rank (the sum floored at ``floor`` first, as one
        process floors its own): the divisor that makes N ranks' step one process's."""
        if self.alone:
            return counts if floor is None else counts.clamp(min=floor)
        total = counts.detach().clone()
        torch.distributed.all_reduce(total)
        return (total if floor is None else total.clamp(min=floor)) / self.world_size


ALONE = Ranks()


class Criterion(Protocol):
    """A head's training loss: ``(total * batch size, detached items)`` for raw outputs and targets.

    targets rows are [image index in batch, class, xc, yc, w, h] normalised to the input image.
    ``loss_names`` name the items (results.csv columns, progress bar). ``ranks``: normalise by every rank's
    counts (the training step under DDP) rather than this rank's alone.
    """

    loss_names: tuple[str, ...]

    def set_progress(self, epoch: int, epochs: int) -> None:
        """Called at every epoch's start (0-based ``epoch`` of ``epochs``): a loss whose weights follow the schedule
        (YOLO26's ProgLoss) sets them here, as a pure function of the two, so a resumed run repeats them."""

    def __call__(self, preds: list[torch.Tensor], targets: torch.Tensor,
                 ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class PackedCriterion(Criterion, Protocol):
    """A loss that also takes its targets packed per image on the outputs' device (models/heads/tal.pack_targets):
    then it does device work only, with no host sync and no shape that depends on the values, which is what a
    CUDA graph can capture together with the model (utils/engine/graphs.py). ``criterion(preds, targets)`` is
    ``packed_loss(preds, pack_targets(targets, ...))``, and extra padding slots change no loss."""

    def packed_loss(self, preds: list[torch.Tensor], packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def decode_outside_autocast(decode: Callable[[list[torch.Tensor]], torch.Tensor],
                            raw: list[torch.Tensor]) -> torch.Tensor:
    """``decode(raw)``, in fp32 when autocast is on: bf16 keeps 8 bits of mantissa, which would round
    a box coordinate near 300 px to 2 px steps. Without autocast (fp32, or a .half() model) the raw
    outputs' own precision is kept."""
    device = raw[0].device.type
    if not torch.is_autocast_enabled(device):
        return decode(raw)
    with torch.autocast(device, enabled=False):
        return decode([r.float() for r in raw])


def ramp(like: torch.Tensor, n: int) -> torch.Tensor:
    """0, 1, ..., n - 1 in ``like``'s dtype and on its device, derived from ``like`` (not from a device
    argument), so a traced export records no device constant and runs on any device."""
    return like.new_ones(n).cumsum(0) - 1


def cell_centres(like: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The centres of an h x w grid's cells in grid units, (2, h * w) as (x + 0.5, y + 0.5), row-major: the
    one anchor-point rule, for the loss's assigner (tal.make_anchors) and for decoding (the heads)."""
    yv, xv = torch.meshgrid(ramp(like, h), ramp(like, w), indexing="ij")
    return torch.stack((xv, yv)).view(2, -1) + 0.5


class Head(nn.Module):
    """Base class of detection heads; see the module docstring for the contract."""

    has_anchors: ClassVar[bool] = False
    family: ClassVar[str]  # the training recipe's key (utils/engine/recipe.py): anchor-based, anchor-free, end-to-end
    end2end: bool = False  # eval output is final detections (B, max_det, 6), no NMS; see the module docstring
    # eval also returns every raw output the loss reads (training's validation loss); an inference backend turns
    # it off, so a head may skip work only the loss needs (the end-to-end head's one-to-many branch)
    raw_for_loss: bool = True
    nc: int
    nl: int
    stride: torch.Tensor

    def build_criterion(self, hyp: Hyp, imgsz: int) -> Criterion:
        raise NotImplementedError

    @property
    def supports_end2end(self) -> bool:
        """Whether the head can run end-to-end: such a head has ``max_det``, the top-k of its dets."""
        return hasattr(self, "max_det")

    def set_end2end(self, on: bool) -> None:
        """Switch between final detections (True) and the decoded form NMS reads (False); a head without an
        end-to-end branch can only be False, so asking it for True is refused rather than silently ignored."""
        if on and not self.supports_end2end:
            raise ValueError(f"{type(self).__name__} has no end-to-end (NMS-free) output")
        self.end2end = bool(on)

    def set_strides(self, strides: torch.Tensor) -> None:
        self.stride.copy_(strides)

    def class_branches(self) -> list[nn.Module]:
        """The convolutions that score classes, which an optimizer may give a higher LR (MuSGD's recipe)."""
        return []

    def initialize_biases(self) -> None:
        """Class (and objectness) priors for a fresh model; a head without priors does nothing."""
