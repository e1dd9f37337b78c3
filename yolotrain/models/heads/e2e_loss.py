"""YOLO26's end-to-end (NMS-free) detection loss: two branches, consistent dual assignment, ProgLoss, STAL.

The head predicts every anchor twice, with a one-to-many branch and a one-to-one branch of the same
shapes. Both are trained like the anchor-free loss (models/heads/dfl_loss.py): task-aligned targets
(models/heads/tal.py), BCE on the classes towards the assigner's soft scores, CIoU on the boxes,
normalised by the sum of the soft scores. What differs, as in Ultralytics 8.4's E2ELoss:

- Consistent dual assignment: the one-to-many branch takes each GT's top 10 anchors; the one-to-one
  branch ranks the same candidates with the same metric (top 7), settles conflicts, then keeps only
  each GT's best one (topk2 = 1). One positive per object is what lets inference skip NMS, and
  sharing the metric keeps that positive among the one-to-many branch's, so the two agree.
- ProgLoss: the total is ``o2m * L_one2many + o2o * L_one2one``; o2m falls linearly over the epochs
  from 0.8 (epoch 0) to 0.1 (the last epoch) and o2o = 1 - o2m. Early on the dense one-to-many
  signal trains the features; by the end the one-to-one branch, the one used at inference, dominates.
  The weights change once per epoch (Ultralytics updates them at each epoch's end, i.e. for the next).
- STAL (small-target-aware label assignment): for choosing candidates only, a GT side shorter than
  the second stride (16 px on P3-P5; the only stride on a one-level head) is widened to it about
  the GT's centre, so a tiny object between anchor centres still gets positives. Ultralytics 8.4
  takes ``stride[1]``, not the smallest stride; so does this loss.
- Without DFL (reg_max 1): the four box channels are the left/top/right/bottom distances themselves,
  raw, in grid units (no activation), decoded with ``dist2bbox`` like the DFL means. The ``dfl``
  gain then weights an L1 term instead of DFL: predicted and target distances in pixels divided by
  the input width (left, right) or height (top, bottom), |difference| averaged over the four sides,
  weighted by the soft score like CIoU. With reg_max > 1 the branches use DFL as DFLLoss does.

Reported items are the one-to-one branch's (box, cls, dfl), gain-scaled but not weighted by o2o, as
Ultralytics logs them: they track the branch that inference uses, the same way in every epoch.
"""
from __future__ import annotations

from typing import Protocol

import torch

from yolotrain.models.heads.base import ALONE, Ranks
from yolotrain.models.heads.dfl_loss import AnchorGrid, DFLLossGains, Geometry, anchor_geometry, branch_items
from yolotrain.models.heads.tal import TaskAlignedAssigner, pack_targets

O2M_TOPK = 10  # one-to-many positives per GT
O2O_TOPK, O2O_TOPK2 = 7, 1  # one-to-one: ranked among the top 7, narrowed to the best 1
O2M_START, O2M_END = 0.8, 0.1  # ProgLoss: one-to-many weight at the first and the last epoch


class E2EHead(Protocol):
    """What the loss reads from its head. ``stride`` (nl,) in input pixels per cell, set before the loss
    is built (Model measures it in its constructor). In training the head returns
    ``{"one2many": levels, "one2one": levels}``, each level (B, 4 * reg_max + nc, H_i, W_i): box
    channels (the distances when reg_max is 1, else side-major DFL logits), then class logits.
    """

    nc: int
    nl: int
    reg_max: int
    stride: torch.Tensor


def prog_weights(epoch: int, epochs: int, start: float = O2M_START, end: float = O2M_END) -> tuple[float, float]:
    """ProgLoss's (one-to-many, one-to-one) weights for 0-based ``epoch`` of ``epochs``.

    A pure function of its arguments, so a resumed run gets the weights of the epoch it resumes at.
    Epoch 0 gives (start, 1 - start), the last epoch (and beyond) (end, 1 - end); Ultralytics'
    ``E2ELoss.decay`` with its update count equal to the epoch.
    """
    o2m = max(1 - epoch / max(epochs - 1, 1), 0) * (start - end) + end
    return o2m, max(1.0 - o2m, 0.0)


def stal_side(strides: torch.Tensor) -> float:
    """The side STAL floors GTs to when choosing candidates: the second stride, or the only one.

    Reads the strides back to the host once (the loss is built once per run)."""
    values = [float(s) for s in strides.detach().cpu().tolist()]
    if not values or min(values) <= 0:
        raise ValueError(f"head strides are not set ({values}): build the loss after Model has measured them")
    return values[1] if len(values) > 1 else values[0]


class E2ELoss:
    """Loss of an end-to-end head's raw training outputs against normalised targets (see the module docstring).

    Returns (total * batch size, shape (1,)) and the one-to-one branch's detached [box, cls, dfl] items;
    for reg_max 1 the third item is the L1 distance term (the column keeps the family's name, dfl).
    ``set_progress`` sets the ProgLoss weights; until it is called they are epoch 0's. Outputs given as
    a plain list of levels (no dict) are taken as the one-to-one branch alone: the items are the same,
    which is all a validation loss reads. Computes in float32 (float64 if the outputs are), outside
    autocast; no host sync per call (STAL's side is read from the strides once, here).
    """

    loss_names = ("box", "cls", "dfl")

    def __init__(self, head: E2EHead, gains: DFLLossGains, stal: bool = True) -> None:
        self.head, self.gains = head, gains
        side = stal_side(head.stride) if stal else 0.0
        self.one2many = TaskAlignedAssigner(topk=O2M_TOPK, min_side=side)
        self.one2one = TaskAlignedAssigner(topk=O2O_TOPK, topk2=O2O_TOPK2, min_side=side)
        self.o2m, self.o2o = prog_weights(0, 1)
        self._on_device: torch.Tensor | None = None  # (o2m, o2o) where the outputs are, for the loss's arithmetic
        self.grid = AnchorGrid()

    def set_progress(self, epoch: int, epochs: int) -> None:
        """Called at every epoch's start: ProgLoss's weights for that epoch (``prog_weights``). The device copy
        changes in place, so a CUDA graph that captured the loss reads each epoch's weights."""
        self.o2m, self.o2o = prog_weights(epoch, epochs)
        if self._on_device is not None:
            self._on_device.copy_(torch.tensor((self.o2m, self.o2o), dtype=torch.float64))

    def weights(self, device: torch.device) -> torch.Tensor:
        """(o2m, o2o) as a float64 tensor on ``device``."""
        if self._on_device is None or self._on_device.device != device:
            self._on_device = torch.tensor((self.o2m, self.o2o), dtype=torch.float64, device=device)
        return self._on_device

    def __call__(self, preds: dict[str, list[torch.Tensor]] | list[torch.Tensor], targets: torch.Tensor,
                 ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]:
        one2one = preds["one2one"] if isinstance(preds, dict) else preds
        return self.packed_loss(preds, pack_targets(targets, one2one[0].shape[0], one2one[0].device), ranks)

    def packed_loss(self, preds: dict[str, list[torch.Tensor]] | list[torch.Tensor], packed: torch.Tensor,
                    ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of targets packed per image on the outputs' device (``tal.pack_targets``): device work
        only, so a CUDA graph can capture it with the model (utils/engine/graphs.py)."""
        one2one = preds["one2one"] if isinstance(preds, dict) else preds
        with torch.autocast(one2one[0].device.type, enabled=False):
            return self._loss(preds, packed, ranks)

    def _loss(self, preds: dict[str, list[torch.Tensor]] | list[torch.Tensor], packed: torch.Tensor,
              ranks: Ranks = ALONE) -> tuple[torch.Tensor, torch.Tensor]:
        one2many, one2one = (preds["one2many"], preds["one2one"]) if isinstance(preds, dict) else (None, preds)
        dtype = torch.promote_types(one2one[0].dtype, torch.float32)
        o2m, o2o = self.weights(one2one[0].device).to(dtype).unbind()
        geo = self.geometry(one2one, packed, dtype)
        o2o_items = self.branch(one2one, geo, self.one2one, dtype, ranks)
        total = o2o_items.sum() * o2o
        if one2many is not None:
            if [p.shape for p in one2many] != [p.shape for p in one2one]:
                raise ValueError("one2many and one2one outputs must have the same shapes")
            total = total + self.branch(one2many, geo, self.one2many, dtype, ranks).sum() * o2m
        return (total * one2one[0].shape[0]).reshape(1), o2o_items.detach()

    def geometry(self, preds: list[torch.Tensor], packed: torch.Tensor, dtype: torch.dtype) -> Geometry:
        """Anchors and GTs, computed once per call for both branches (dfl_loss.anchor_geometry)."""
        return anchor_geometry(preds, self.head.stride, packed, dtype, self.grid)

    def branch(self, preds: list[torch.Tensor], geo: Geometry, assigner: TaskAlignedAssigner,
               dtype: torch.dtype, ranks: Ranks = ALONE) -> torch.Tensor:
        """One branch's gain-scaled (box, cls, dfl-or-L1) losses, shape (3,), with its own assignment
        (the anchor-free loss's, dfl_loss.branch_items)."""
        return branch_items(preds, geo, assigner, self.head, self.gains, dtype, ranks)
