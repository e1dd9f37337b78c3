"""The anchor-free head of YOLOv8 / YOLO11 (and YOLOv5u): per level, every grid cell predicts its
box as four distances (left, top, right, bottom) from the cell centre, each a distribution over
``reg_max`` bins (Distribution Focal Loss), plus one score per class; no anchors, no objectness.

Inference takes the DFL integral of each distribution, turns the distances into a box around
the cell centre and applies a sigmoid to the class logits, giving the family-independent
(B, N, 4 + nc) form of ``models/heads/base.py``. Training (target assignment and the loss) is
``DFLLoss`` in models/heads/dfl_loss.py.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from yolotrain.models.blocks import DFL, Conv, DWConv
from yolotrain.models.heads.base import Head, cell_centres, decode_outside_autocast
from yolotrain.models.heads.dfl_loss import DFLLoss, DFLLossGains
from yolotrain.utils.core.hyp import Hyp

ANCHOR_CACHE = 32  # rectangular val batches vary in shape: the anchor-point cache stays bounded


class DFLDetect(Head):
    """Two branches per level: box (Conv 3x3, Conv 3x3, 1x1 -> 4 * reg_max) and class (-> nc).

    The class branch is YOLOv8's (Conv 3x3, Conv 3x3, 1x1) unless ``dw_cls``, which gives
    YOLO11's lighter one (depthwise 3x3 + 1x1 Conv, twice, then 1x1); the yaml chooses, so a
    model's architecture is readable from its file. Raw level outputs are (B, 4 * reg_max + nc, H, W),
    box logits first, the order ``DFLLoss`` reads.
    """

    has_anchors = False
    family = "anchor-free"
    MIN_REG_MAX: ClassVar[int] = 2  # bins per side; the end-to-end head also takes 1 (plain distances, no DFL)

    def __init__(self, nc: int, reg_max: int = 16, dw_cls: bool = False, *, ch: list[int] | tuple[int, ...]) -> None:
        super().__init__()
        if not isinstance(reg_max, int) or isinstance(reg_max, bool) or reg_max < self.MIN_REG_MAX:
            raise ValueError(f"reg_max must be an integer >= {self.MIN_REG_MAX}, got {reg_max!r}")
        self.nc = int(nc)
        self.nl = len(ch)
        self.reg_max = reg_max
        self.no = self.nc + 4 * reg_max
        self.dw_cls = bool(dw_cls)
        self.register_buffer("stride", torch.zeros(self.nl))
        c2 = max(16, ch[0] // 4, 4 * reg_max)  # box branch width
        c3 = max(ch[0], min(self.nc, 100))  # class branch width
        self.cv2 = nn.ModuleList(
            nn.Sequential(Conv(c, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4 * reg_max, 1)) for c in ch)
        self.cv3 = nn.ModuleList(self._cls_branch(c, c3) for c in ch)
        self.dfl: nn.Module = DFL(reg_max) if reg_max > 1 else nn.Identity()
        self._anchors: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cls_branch(self, c: int, c3: int) -> nn.Sequential:
        if self.dw_cls:
            return nn.Sequential(nn.Sequential(self._depthwise(c, 3), Conv(c, c3, 1)),
                                 nn.Sequential(self._depthwise(c3, 3), Conv(c3, c3, 1)),
                                 nn.Conv2d(c3, self.nc, 1))
        return nn.Sequential(Conv(c, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, self.nc, 1))

    def _depthwise(self, c: int, k: int) -> nn.Module:
        """The depthwise conv of the class branch (a subclass may build the same computation as another class)."""
        return DWConv(c, c, k)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        raw = [torch.cat((self.cv2[i](x), self.cv3[i](x)), 1) for i, x in enumerate(xs)]
        if self.training:
            return raw
        return decode_outside_autocast(self._decode, raw), raw

    def _decode(self, raw: list[torch.Tensor]) -> torch.Tensor:
        """Raw levels -> (B, N, 4 + nc): box centre x, y, width, height in input pixels, sigmoid scores.

        N runs over levels, then rows, then columns, like the flattened maps.
        """
        boxes, cls = self._boxes(raw, xywh=True)
        return torch.cat((boxes, cls.sigmoid()), 1).transpose(1, 2)

    def _boxes(self, raw: list[torch.Tensor], xywh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw levels -> boxes (B, 4, N) in input pixels (xywh, or xyxy) and class logits (B, nc, N)."""
        bs = raw[0].shape[0]
        x = torch.cat([r.view(bs, self.no, -1) for r in raw], 2)  # (B, no, N)
        box, cls = x.split((4 * self.reg_max, self.nc), 1)
        points, strides = self._anchor_points([tuple(r.shape[2:]) for r in raw], x)
        lt, rb = self.dfl(box).chunk(2, 1)  # grid units
        x1y1, x2y2 = points - lt, points + rb
        boxes = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1) if xywh else (x1y1, x2y2), 1) * strides
        return boxes, cls

    def anchor_points(
        self, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cell centres in grid units, (2, N) as (x + 0.5, y + 0.5), and each one's stride, (1, N),
        for levels of the given (H, W); cached per shape, since shapes repeat from batch to batch."""
        return self._anchor_points(shapes, torch.empty(0, device=device, dtype=dtype))

    def _anchor_points(self, shapes: list[tuple[int, int]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``anchor_points`` in ``like``'s dtype and device, built from ``like`` so a trace records no
        device; not cached while tracing, where a cached tensor would become a fixed constant."""
        key = (tuple(shapes), like.device, like.dtype)
        tracing = torch.jit.is_tracing()
        hit = None if tracing else self._anchors.get(key)
        if hit is None:
            if len(self._anchors) >= ANCHOR_CACHE:
                self._anchors.clear()
            points, strides = [], []
            for (h, w), s in zip(shapes, self.stride.tolist()):
                points.append(cell_centres(like, h, w))
                strides.append(like.new_full((1, h * w), s))
            hit = torch.cat(points, 1), torch.cat(strides, 1)
            if not tracing:
                self._anchors[key] = hit
        return hit

    def build_criterion(self, hyp: Hyp, imgsz: int) -> DFLLoss:
        return DFLLoss(self, DFLLossGains.from_hyp(hyp))

    def set_strides(self, strides: torch.Tensor) -> None:
        """Strides measured by Model; anchor points cached before (with other strides) are dropped."""
        self.stride.copy_(strides)
        self._anchors.clear()

    def class_branches(self) -> list[nn.Module]:
        return [self.cv3]

    def initialize_biases(self) -> None:
        """Class scores start at sigmoid(b) = 5 / nc / cells: about 5 positive class scores per 640 image
        and level, so the early loss is not swamped by confident false positives. The box bias is
        one constant over each side's bins, which the softmax ignores (YOLOv8 used 1.0, Ultralytics
        8.4 uses 2.0: the same model)."""
        for box, cls, s in zip(self.cv2, self.cv3, self.stride.tolist()):
            box[-1].bias.data[:] = 1.0
            cls[-1].bias.data[: self.nc] = math.log(5 / self.nc / (640 / s) ** 2)
