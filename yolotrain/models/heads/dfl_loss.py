"""The anchor-free (YOLOv8/11-style) detection loss: task-aligned targets, BCE classes, CIoU + DFL boxes.

Each anchor predicts its box as four distances (left, top, right, bottom) from its cell centre,
each a distribution over reg_max integer bins in grid units; the distance is the distribution's
mean. Anchors are assigned by ``TaskAlignedAssigner`` (models/heads/tal.py) on detached
predictions; the classifier is trained towards the assigner's soft, alignment-normalised scores
on every anchor, the box of each positive by CIoU and its distributions by DFL (mass on the two
bins around the true distance), both weighted by that anchor's soft score. All three are divided
by the sum of the soft scores, so the loss does not depend on how many objects a batch holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from yolotrain.models.heads.base import ALONE, Ranks
from yolotrain.models.heads.tal import TaskAlignedAssigner, bbox2dist, bbox_ciou, dist2bbox, make_anchors, pack_targets, \
    unpack_targets
from yolotrain.utils.core.hyp import Hyp


class DistributionHead(Protocol):
    """What the loss reads from its head, at every call (so .to(device) and set_strides are seen).

    Raw training outputs are one tensor per level, (B, 4 * reg_max + nc, H_i, W_i): the four
    distance distributions' logits (side-major: left's reg_max bins, then top's, ...) then the
    class logits. ``stride`` (nl,) is in input pixels per cell; the input image is
    H_0 * stride_0 by W_0 * stride_0.
    """

    nc: int
    nl: int
    reg_max: int
    stride: torch.Tensor


@dataclass(frozen=True)
class DFLLossGains:
    """The loss's gains, used as written: unlike the anchor family, nothing scales them by layers,
    classes or image size (the soft-score normalisation already makes the terms size-free)."""

    box: float
    cls: float
    dfl: float

    @classmethod
    def from_hyp(cls, hyp: Hyp) -> DFLLossGains:
        return cls(box=hyp.box, cls=hyp.cls, dfl=hyp.dfl)


def distribution_mean(logits: torch.Tensor, reg_max: int) -> torch.Tensor:
    """(..., 4 * reg_max) distance logits -> (..., 4) expected distances in grid units (softmax . 0..reg_max-1)."""
    bins = torch.arange(reg_max, device=logits.device, dtype=logits.dtype)
    return logits.unflatten(-1, (4, reg_max)).softmax(-1) @ bins


def distribution_focal_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of (..., reg_max) logits against target distances (...) in [0, reg_max - 1).

    The target t is split between its two neighbouring bins, weight (floor(t) + 1 - t) on floor(t)
    and (t - floor(t)) on floor(t) + 1, whose mean is t exactly (Li et al., Generalized Focal Loss).
    """
    # target >= 0: truncation is floor. The clamp changes no valid target; a NaN one (diverged
    # predictions) would otherwise become a wild index, an IndexError instead of a NaN loss that
    # the training loop reports and stops on.
    left = target.long().clamp(0, logits.shape[-1] - 2)
    w_left = left + 1 - target
    logp = logits.log_softmax(-1)
    lp_left = logp.gather(-1, left[..., None]).squeeze(-1)
    lp_right = logp.gather(-1, (left + 1)[..., None]).squeeze(-1)
    return -(lp_left * w_left + lp_right * (1 - w_left))


class DFLLoss:
    """Loss for an anchor-free head's raw training outputs against normalised targets.

    Returns (total * batch size, shape (1,)) and the detached [box, cls, dfl] items, as AnchorLoss.
    It computes in float32 (float64 if the outputs are), outside autocast. Give it the loader's host
    targets: padding them there needs no device sync, and the loss has none of its own (the
    foreground is never gathered by a boolean mask: box and DFL terms run on every anchor with
    weight 0 off the foreground).
    """

    loss_names = ("box", "cls", "dfl")

    def __init__(self, head: DistributionHead, gains: DFLLossGains,
                 assigner: TaskAlignedAssigner | None = None) -> None:
        self.head, self.gains = head, gains
        self.assigner = assigner if assigner is not None else TaskAlignedAssigner()
        self.grid = AnchorGrid()

    def set_progress(self, epoch: int, epochs: int) -> None:
        """The same loss at every epoch."""

    def __call__(self, preds: list[torch.Tensor], targets: torch.Tensor,
                 ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]:
        return self.packed_loss(preds, pack_targets(targets, preds[0].shape[0], preds[0].device), ranks)

    def packed_loss(self, preds: list[torch.Tensor], packed: torch.Tensor,
                    ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of targets packed per image on the outputs' device (``tal.pack_targets``): device work
        only, so a CUDA graph can capture it with the model (utils/engine/graphs.py)."""
        with torch.autocast(preds[0].device.type, enabled=False):
            return self._loss(preds, packed, ranks)

    def _loss(self, preds: list[torch.Tensor], packed: torch.Tensor,
              ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = torch.promote_types(preds[0].dtype, torch.float32)
        geo = anchor_geometry(preds, self.head.stride, packed, dtype, self.grid)
        items = branch_items(preds, geo, self.assigner, self.head, self.gains, dtype, ranks)
        return (items.sum() * preds[0].shape[0]).reshape(1), items.detach()


class Geometry(NamedTuple):
    """What a batch's loss needs besides the outputs: anchors and padded GTs (shared by an end-to-end
    head's two branches)."""

    points: torch.Tensor  # (A, 2) anchor centres, grid units
    strides: torch.Tensor  # (A, 1) pixels per grid unit
    image_whwh: torch.Tensor  # (4,) input width, height, width, height in pixels
    gt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # unpack_targets' labels, boxes (pixels), mask


class AnchorGrid:
    """A loss's anchors for its outputs' shapes, made once per (shapes, dtype, device, head stride tensor and its
    in-place version): a run at one input size has the same anchors at every step, and making them is some twenty
    kernel launches a step on a GPU. The stride is recognised by identity and version (no device read), so
    ``set_strides`` and ``.to(device)`` are seen. Every entry stays: a run sees a handful of shapes, and a CUDA
    graph that captured the loss (utils/engine/graphs.py) reads its shape's anchors in place, so they must
    outlive a validation pass at other shapes."""

    def __init__(self) -> None:
        # key -> (the stride tensor, held so its id cannot pass to another tensor; the anchors)
        self._made: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def __call__(self, shapes: list[tuple[int, int]], stride: torch.Tensor, dtype: torch.dtype,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(points (A, 2) and strides (A, 1) as make_anchors gives them, the input's (height, width) and (width,
        height, width, height) in pixels)."""
        key = (tuple(shapes), dtype, device, id(stride), stride._version)
        if key not in self._made:
            scaled = stride.to(device=device, dtype=dtype)
            points, strides = make_anchors(shapes, scaled)  # grid units
            image_hw = torch.stack((shapes[0][0] * scaled[0], shapes[0][1] * scaled[0]))
            self._made[key] = (stride, (points, strides, image_hw, image_hw.flip(0).repeat(2)))
        return self._made[key][1]


def anchor_geometry(preds: list[torch.Tensor], stride: torch.Tensor, packed: torch.Tensor,
                    dtype: torch.dtype, grid: AnchorGrid | None = None) -> Geometry:
    """Anchors of the levels' shapes (from ``grid`` when given) and the batch's GTs, packed per image on the
    outputs' device (``tal.pack_targets``), in pixels."""
    shapes = [(p.shape[2], p.shape[3]) for p in preds]
    points, strides, image_hw, image_whwh = (grid or AnchorGrid())(shapes, stride, dtype, preds[0].device)
    return Geometry(points, strides, image_whwh, unpack_targets(packed.to(dtype), image_hw))


def branch_items(preds: list[torch.Tensor], geo: Geometry, assigner: TaskAlignedAssigner, head: DistributionHead,
                 gains: DFLLossGains, dtype: torch.dtype, ranks: Ranks = ALONE) -> torch.Tensor:
    """One set of output levels' gain-scaled (box, cls, dfl) losses, shape (3,), with its own assignment.

    With ``reg_max`` 1 (no bins: the box channels are the distances, YOLO26) the third term is L1 on the
    distances as fractions of the input's width (left, right) or height (top, bottom), mean over the
    sides, in place of DFL."""
    nc, reg_max = head.nc, head.reg_max
    points, strides = geo.points, geo.strides
    flat = torch.cat([p.flatten(2) for p in preds], 2).to(dtype).transpose(1, 2)  # (B, A, 4 * reg_max + nc)
    box_out, cls_logits = flat.split((4 * reg_max, nc), -1)
    dists = box_out if reg_max == 1 else distribution_mean(box_out, reg_max)  # grid units
    pred_boxes = dist2bbox(dists, points)  # xyxy, grid units
    assigned = assigner(cls_logits.detach().sigmoid(), pred_boxes.detach() * strides, points * strides, *geo.gt)

    score_sum = ranks.share(assigned.scores.sum(), floor=1)  # the assigned scores' sum: this rank's, or its share
    lcls = F.binary_cross_entropy_with_logits(cls_logits, assigned.scores, reduction="sum") / score_sum
    weight = assigned.scores.sum(-1)  # (B, A): the positive's soft score, 0 off the foreground
    # Off the foreground the target is the prediction itself: finite values and gradients, times weight 0.
    target = torch.where(assigned.fg[..., None], assigned.boxes / strides, pred_boxes.detach())
    lbox = ((1.0 - bbox_ciou(pred_boxes, target)) * weight).sum() / score_sum
    if reg_max == 1:
        scale = strides / geo.image_whwh  # grid units -> fractions of the input's width / height
        per_anchor = ((dists - bbox2dist(points, target)) * scale).abs().mean(-1)
    else:
        target_dist = bbox2dist(points, target, reg_max - 1 - 0.01)
        per_anchor = distribution_focal_loss(box_out.unflatten(-1, (4, reg_max)), target_dist).mean(-1)
    ldist = (per_anchor * weight).sum() / score_sum
    return torch.stack((lbox * gains.box, lcls * gains.cls, ldist * gains.dfl))
