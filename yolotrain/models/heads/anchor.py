"""The anchor-based head of YOLOv5 v6: per level, na anchors predict (xywh, objectness, nc classes).

Targets are matched to anchors by width/height ratio (``AnchorLoss``); inference decodes boxes
from the anchors and multiplies objectness into the class scores, giving the family-independent
(B, N, 4 + nc) form of ``models/heads/base.py``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from yolotrain.models.heads.anchor_loss import AnchorLoss, AnchorLossGains
from yolotrain.models.heads.base import Head, decode_outside_autocast, ramp
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.core.logging import LOGGER

GRID_CACHE = 32  # rectangular val batches vary in shape: the grid cache stays bounded


class Detect(Head):
    """Per-level 1x1 convs that predict na boxes of (xywh, obj, nc classes) at every grid cell.

    ``anchors`` are kept in grid units (pixels / stride) because that is what the loss matches
    targets against; eval mode decodes to input-image pixels for NMS.
    """

    has_anchors = True
    family = "anchor-based"

    def __init__(self, nc: int, anchors: list[list[float]], ch: list[int] | tuple[int, ...]) -> None:
        super().__init__()
        self.nc = int(nc)
        self.no = self.nc + 5
        self.nl = len(anchors)
        self.na = len(anchors[0]) // 2
        self.register_buffer("anchors", torch.tensor(anchors, dtype=torch.float32).view(self.nl, self.na, 2))
        self.register_buffer("stride", torch.zeros(self.nl))
        self.m = nn.ModuleList(nn.Conv2d(c, self.no * self.na, 1) for c in ch)
        self._grids: dict[tuple, torch.Tensor] = {}

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        raw = []
        for i, x in enumerate(xs):
            x = self.m[i](x)
            bs, _, ny, nx = x.shape
            raw.append(x.view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous())
        if self.training:
            return raw
        return decode_outside_autocast(lambda r: torch.cat([self._decode(i, p) for i, p in enumerate(r)], 1), raw), raw

    def _decode(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """Raw level-i output -> (bs, na*ny*nx, 4 + nc): xywh in pixels (YOLOv5 v6 formula), obj * cls."""
        bs, _, ny, nx, _ = p.shape
        grid = self._grid(nx, ny, p)
        stride = self.stride[i].to(p.dtype)
        anchor_px = (self.anchors[i] * self.stride[i]).view(1, self.na, 1, 1, 2).to(p.dtype)
        xy, wh, obj, cls = p.sigmoid().split((2, 2, 1, self.nc), 4)
        xy = (xy * 2 + grid) * stride  # grid already holds the -0.5 offset
        wh = (wh * 2) ** 2 * anchor_px
        return torch.cat((xy, wh, cls * obj), 4).view(bs, -1, 4 + self.nc)

    def _grid(self, nx: int, ny: int, like: torch.Tensor) -> torch.Tensor:
        """Cell coordinates minus 0.5, shape (1, 1, ny, nx, 2), in ``like``'s dtype and device; cached
        since shapes repeat, but not while tracing, where a cached grid would become a fixed constant."""
        key = (nx, ny, like.device, like.dtype)
        tracing = torch.jit.is_tracing()
        grid = None if tracing else self._grids.get(key)
        if grid is None:
            if len(self._grids) >= GRID_CACHE:
                self._grids.clear()
            yv, xv = torch.meshgrid(ramp(like, ny), ramp(like, nx), indexing="ij")
            grid = (torch.stack((xv, yv), 2) - 0.5).view(1, 1, ny, nx, 2)
            if not tracing:
                self._grids[key] = grid
        return grid

    def build_criterion(self, hyp: Hyp, imgsz: int) -> AnchorLoss:
        return AnchorLoss(self, AnchorLossGains.from_hyp(hyp, self.nl, self.nc, imgsz))

    def set_strides(self, strides: torch.Tensor) -> None:
        """Strides measured by Model; the yaml's pixel anchors become grid units."""
        self.stride.copy_(strides)
        check_anchor_order(self)
        self.anchors /= self.stride.view(-1, 1, 1)

    def initialize_biases(self) -> None:
        """YOLOv5 priors: ~8 objects per 640 image and ~0.6/nc class probability at start."""
        for conv, s in zip(self.m, self.stride.tolist()):
            b = conv.bias.data.view(self.na, -1)
            b[:, 4] += math.log(8 / (640 / s) ** 2)
            b[:, 5 : 5 + self.nc] += math.log(0.6 / (self.nc - 0.99))


def check_anchor_order(det: Detect) -> None:
    """Flip anchors if they are listed large-to-small while strides go small-to-large."""
    area = det.anchors.prod(-1).mean(-1).view(-1)
    da = area[-1] - area[0]
    ds = det.stride[-1] - det.stride[0]
    if da and da.sign() != ds.sign():
        LOGGER.info("Reversing anchor order to match strides")
        det.anchors[:] = det.anchors.flip(0)


def check_anchors_spec(anchors: Any, where: str) -> list[list[float]]:
    """Anchors must be per-level lists of (w, h) pixel pairs, the same count on every level."""
    if isinstance(anchors, int) and not isinstance(anchors, bool):
        raise UserError(f"{where}: anchors given as a count ({anchors}) are not supported; "
                        "list (w, h) pixel pairs per level, e.g. [[10,13, 16,30, 33,23], ...]")
    ok = isinstance(anchors, list) and anchors and all(isinstance(a, list) and a for a in anchors)
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for a in anchors for v in a)
    if not ok or any(len(a) % 2 or len(a) != len(anchors[0]) for a in anchors):
        raise UserError(f"{where}: anchors must be a list of per-level lists of positive (w, h) pixel "
                        f"pairs, the same number on every level; got {anchors!r}")
    return anchors


def resample_anchors(anchors: list[list[float]], n: int) -> list[list[float]]:
    """Each level's anchors resampled to n pairs, evenly spaced in log size between its smallest
    and largest (one anchor spans half to twice itself); the model builds with a sensible shape
    per level, and autoanchor replaces these with fitted ones."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"resample_anchors: n must be a positive integer, got {n!r}")
    out = []
    for level in anchors:
        pairs = sorted(zip(level[0::2], level[1::2]), key=lambda p: p[0] * p[1])
        logs = [(math.log(w), math.log(h)) for w, h in pairs]
        if len(logs) == 1:
            (lw, lh), step = logs[0], math.log(2)
            logs = [(lw - step, lh - step), (lw + step, lh + step)]
        new = []
        for j in range(n):
            t = (len(logs) - 1) * (j / (n - 1) if n > 1 else 0.5)
            i = min(int(t), len(logs) - 2)
            f = t - i
            new += [round(math.exp(a + (b - a) * f), 2) for a, b in zip(logs[i], logs[i + 1])]
        out.append(new)
    return out


def plain_anchors(anchors: Any) -> list[list[float]]:
    """Anchors override (list, array or tensor) -> nested list of Python numbers for self.yaml."""
    if hasattr(anchors, "tolist"):
        anchors = anchors.tolist()
    out = []
    for level in anchors:
        flat = level.tolist() if hasattr(level, "tolist") else level
        flat = [v for pair in flat for v in (pair if isinstance(pair, (list, tuple)) else [pair])]
        out.append([float(v) for v in flat])
    return out
