"""The end-to-end (NMS-free) head of YOLO26 (Ultralytics 8.4's ``Detect`` with ``end2end``): two copies
of the anchor-free DFL head's branches over the same features.

- one-to-many (``cv2``, ``cv3``): trained with task-aligned assignment (several positives per object),
  like YOLOv8 / YOLO11; decoded it gives the usual (B, N, 4 + nc) form that NMS filters.
- one-to-one (``one2one_cv2``, ``one2one_cv3``): trained with one positive per object, so its
  scores already rank one box per object first; inference takes the top ``max_det`` scores and
  needs no NMS. While training it runs on *detached* features: its loss trains only its own
  branches, the backbone is shaped by the one-to-many loss alone (as Ultralytics 8.4 does).

``reg_max`` 1 (YOLO26) means no DFL: the box branch outputs the four distances (grid units) directly,
with no activation, as Ultralytics decodes them; ``reg_max`` > 1 keeps the DFL integral.

``forward``: training returns ``{"one2many": [...], "one2one": [...]}``, per level (B, 4 * reg_max + nc,
H, W), box channels first. In eval it returns ``(out, raw)`` with ``raw`` that same dict (only the
one-to-one entry when an inference backend turned ``raw_for_loss`` off: the other branch is not run) and ``out``:
- ``end2end`` True: (B, min(max_det, N), 6) rows [x1, y1, x2, y2 (input pixels), score, class] from
  the one-to-one branch, best score first (``topk_dets``);
- ``end2end`` False: the one-to-many branch as (B, N, 4 + nc) xywh + sigmoid scores, the DFL head's form.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from yolotrain.models.blocks import Conv
from yolotrain.models.heads.base import decode_outside_autocast
from yolotrain.models.heads.dfl import DFLDetect
from yolotrain.models.heads.dfl_loss import DFLLossGains
from yolotrain.models.heads.e2e_loss import E2EHead, E2ELoss
from yolotrain.models.heads.tal import TaskAlignedAssigner
from yolotrain.utils.core.hyp import Hyp

V10_O2O_TOPK = 1  # YOLOv10's one-to-one assignment: each GT's single best anchor
MAX_DET = 300  # Ultralytics' default number of end-to-end detections per image
BOX_BIAS = 2.0  # initial box output: with reg_max 1 a distance of 2 cells per side (Ultralytics 8.4's bias)


class E2EDetect(DFLDetect):
    """The DFL head's branches (``cv2``, ``cv3``: one-to-many) and their one-to-one copies; see the module
    docstring. The anchor points, strides and decoding are the DFL head's."""

    MIN_REG_MAX = 1
    family = "end-to-end"

    def __init__(self, nc: int, reg_max: int = 1, dw_cls: bool = True, *, ch: list[int] | tuple[int, ...]) -> None:
        super().__init__(nc, reg_max, dw_cls, ch=ch)
        self.max_det = MAX_DET
        self.end2end = True
        self.agnostic = False  # end-to-end top-k over anchors only: one class per box (Ultralytics' agnostic_nms)
        self.one2one_cv2 = copy.deepcopy(self.cv2)
        self.one2one_cv3 = copy.deepcopy(self.cv3)

    def forward(self, xs: list[torch.Tensor]) -> dict[str, list[torch.Tensor]] | tuple[torch.Tensor, dict]:
        feats = [x.detach() for x in xs] if self.training else xs  # one-to-one loss stays out of the backbone
        one2one = [torch.cat((self.one2one_cv2[i](x), self.one2one_cv3[i](x)), 1) for i, x in enumerate(feats)]
        if not self.training and self.end2end and not self.raw_for_loss:  # inference: the other branch is unused
            return decode_outside_autocast(self._dets, one2one), {"one2one": one2one}
        one2many = [torch.cat((self.cv2[i](x), self.cv3[i](x)), 1) for i, x in enumerate(xs)]
        raw = {"one2many": one2many, "one2one": one2one}
        if self.training:
            return raw
        if self.end2end:
            return decode_outside_autocast(self._dets, one2one), raw
        return decode_outside_autocast(self._decode, one2many), raw

    def _dets(self, raw: list[torch.Tensor]) -> torch.Tensor:
        """(B, k, 6) end-to-end detections from the one-to-one levels, k = min(max_det, N)."""
        boxes, cls = self._boxes(raw, xywh=False)
        return topk_dets(boxes.transpose(1, 2), cls.sigmoid().transpose(1, 2), self.max_det, self.agnostic)

    def class_branches(self) -> list[nn.Module]:
        return [self.cv3, self.one2one_cv3]

    def build_criterion(self, hyp: Hyp, imgsz: int) -> E2ELoss:
        return E2ELoss(self, DFLLossGains.from_hyp(hyp))

    def initialize_biases(self) -> None:
        """Both branch pairs start alike: class scores at sigmoid(b) = 5 / nc / cells (about 5 positive
        scores per 640 image and level, as the DFL head), box outputs at 2.0 (Ultralytics 8.4)."""
        for boxes, classes in ((self.cv2, self.cv3), (self.one2one_cv2, self.one2one_cv3)):
            for box, cls, s in zip(boxes, classes, self.stride.tolist()):
                box[-1].bias.data[:] = BOX_BIAS
                cls[-1].bias.data[: self.nc] = math.log(5 / self.nc / (640 / s) ** 2)


class V10Detect(E2EDetect):
    """YOLOv10's head (Ultralytics' ``v10Detect``): the end-to-end head with DFL boxes (reg_max 16) and the
    depthwise class branch, its layers and outputs E2EDetect's. Only the loss differs: ``V10Loss``,
    the YOLOv10 paper's recipe, so a yaml row naming ``v10Detect`` trains the way the family was published."""

    def __init__(self, nc: int, reg_max: int = 16, dw_cls: bool = True, *, ch: list[int] | tuple[int, ...]) -> None:
        super().__init__(nc, reg_max, dw_cls, ch=ch)

    def _depthwise(self, c: int, k: int) -> nn.Module:
        """``Conv(g=c)``, as v10Detect builds its class branch: DWConv's computation, under the class name the
        importer matches."""
        return Conv(c, c, k, g=c)

    def build_criterion(self, hyp: Hyp, imgsz: int) -> V10Loss:
        return V10Loss(self, DFLLossGains.from_hyp(hyp))


class V10Loss(E2ELoss):
    """YOLOv10's dual assignment: one-to-many top 10 and one-to-one top 1 (same metric), the two losses
    summed with weight 1 each at every epoch (no ProgLoss) and no STAL; boxes by CIoU + DFL.

    Ultralytics kept this recipe as ``E2EDetectLoss`` (8.4 trains its v10 yamls with YOLO26's loss);
    everything but the assigners and weights is E2ELoss's, items included (the one-to-one branch's).
    """

    def __init__(self, head: E2EHead, gains: DFLLossGains) -> None:
        super().__init__(head, gains, stal=False)
        self.one2one = TaskAlignedAssigner(topk=V10_O2O_TOPK)
        self.o2m = self.o2o = 1.0

    def set_progress(self, epoch: int, epochs: int) -> None:
        """Fixed weights: nothing follows the schedule."""


def topk_dets(boxes: torch.Tensor, scores: torch.Tensor, max_det: int, agnostic: bool = False) -> torch.Tensor:
    """Boxes (B, N, 4) and scores (B, N, nc) -> (B, k, 6) [box, score, class], best first, k = min(max_det, N).

    Two top-k passes, as Ultralytics 8.4 selects (so imported weights give its boxes): first the k
    anchors whose best class scores highest, then the k best (anchor, class) pairs among those, so
    one anchor may give several classes. No NMS: the one-to-one branch scores one box per object.
    ``agnostic``: one pass over the anchors' best classes, so each box has one class.
    """
    nc = scores.shape[-1]
    k = min(int(max_det), scores.shape[1])
    if agnostic:
        best, labels = scores.max(-1)
        top, anchor_idx = best.topk(k, dim=1)
        picked = boxes.gather(1, anchor_idx.unsqueeze(-1).expand(-1, -1, boxes.shape[-1]))
        return torch.cat((picked, top.unsqueeze(-1), labels.gather(1, anchor_idx).unsqueeze(-1).to(top.dtype)), -1)
    anchor_idx = scores.amax(-1).topk(k, dim=1).indices  # (B, k)
    scores = scores.gather(1, anchor_idx.unsqueeze(-1).expand(-1, -1, nc))
    top, idx = scores.flatten(1).topk(k, dim=1)
    anchor_idx = anchor_idx.gather(1, idx // nc)
    picked = boxes.gather(1, anchor_idx.unsqueeze(-1).expand(-1, -1, boxes.shape[-1]))
    return torch.cat((picked, top.unsqueeze(-1), (idx % nc).unsqueeze(-1).to(top.dtype)), -1)
