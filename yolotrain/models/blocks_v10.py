"""YOLOv10's building blocks (Ultralytics' yolov10*.yaml): SCDown, RepVGGDW, CIB, C2fCIB and PSA.

Kept beside models/blocks.py (the shared units: Conv, C2f, Attention) so each module stays small;
models/registry.py names them for the yamls. Every one is made of our ``Conv`` units, so the
importer maps Ultralytics' tensors onto them name for name and ``Model.fuse`` folds their BatchNorms.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from yolotrain.models.blocks import Attention, C2f, Conv


class SCDown(nn.Module):
    """Spatial-channel decoupled downsampling: a 1x1 Conv sets the width, then a linear depthwise
    k x k Conv with stride s halves the map; far cheaper than one full strided k x k conv."""

    def __init__(self, c1: int, c2: int, k: int = 3, s: int = 2) -> None:
        super().__init__()
        self.cv1 = Conv(c1, c2, 1, 1)
        self.cv2 = Conv(c2, c2, k, s, g=c2, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv2(self.cv1(x))


class RepVGGDW(nn.Module):
    """Large-kernel depthwise unit: a 7x7 and a 3x3 depthwise Conv (both linear) summed, then SiLU.

    Training keeps the two branches; ``fuse_bn`` (called by ``Model.fuse``) folds each BatchNorm and
    adds the 3x3 kernel into the centre of the 7x7, so inference runs one depthwise conv with the same
    output. The structural re-parameterisation of RepVGG, for a depthwise layer.
    """

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = Conv(c, c, 7, 1, 3, g=c, act=False)
        self.conv1: Conv | None = Conv(c, c, 3, 1, 1, g=c, act=False)
        self.dim = c
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv1 is None:  # folded by fuse_bn()
            return self.act(self.conv(x))
        return self.act(self.conv(x) + self.conv1(x))

    def fuse_bn(self) -> None:
        """Fold both BatchNorms, then the 3x3 branch into the 7x7 one (zero-padded to 7x7); irreversible."""
        if self.conv1 is None:
            return
        self.conv.fuse_bn()
        self.conv1.fuse_bn()
        big, small = self.conv.conv, self.conv1.conv
        pad = (big.kernel_size[0] - small.kernel_size[0]) // 2
        with torch.no_grad():
            big.weight.add_(F.pad(small.weight, [pad] * 4))
            big.bias.add_(small.bias)
        self.conv1 = None


class CIB(nn.Module):
    """Compact inverted block: depthwise 3x3, 1x1 to 2 x hidden, depthwise 3x3 (or RepVGGDW's 7x7 when
    ``lk``), 1x1 to c2, depthwise 3x3, with a residual add when ``shortcut`` and the widths match.
    Spatial mixing is all depthwise, so a stage costs little more than its two 1x1 convs."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, e: float = 0.5, lk: bool = False) -> None:
        super().__init__()
        c_ = int(c2 * e)
        mid = RepVGGDW(2 * c_) if lk else Conv(2 * c_, 2 * c_, 3, g=2 * c_)
        self.cv1 = nn.Sequential(Conv(c1, c1, 3, g=c1), Conv(c1, 2 * c_, 1), mid, Conv(2 * c_, c2, 1),
                                 Conv(c2, c2, 3, g=c2))
        self.add = bool(shortcut) and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv1(x) if self.add else self.cv1(x)


class C2fCIB(C2f):
    """C2f whose stages are CIBs: YOLOv10's rank-guided replacement for C2f in its deepest stages.
    Argument order follows the yamls: shortcut, lk (large-kernel CIB), g, e."""

    def __init__(
        self, c1: int, c2: int, n: int = 1, shortcut: bool = False, lk: bool = False, g: int = 1, e: float = 0.5,
    ) -> None:
        super().__init__(c1, c2, n, shortcut, g, e)
        self.m = nn.ModuleList(CIB(self.c, self.c, shortcut, e=1.0, lk=bool(lk)) for _ in range(n))


class PSA(nn.Module):
    """Partial self-attention: one attention + feed-forward layer (each with a residual add) on half the
    channels, the other half passed through, then a 1x1 merge. Input and output widths match."""

    def __init__(self, c1: int, c2: int, e: float = 0.5) -> None:
        super().__init__()
        if c1 != c2:
            raise ValueError(f"PSA keeps the channel count: input {c1} and output {c2} must be equal")
        self.c = int(c1 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv(2 * self.c, c1, 1)
        self.attn = Attention(self.c, attn_ratio=0.5, num_heads=max(self.c // 64, 1))
        self.ffn = nn.Sequential(Conv(self.c, self.c * 2, 1), Conv(self.c * 2, self.c, 1, act=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.cv1(x).split((self.c, self.c), dim=1)
        b = b + self.attn(b)
        b = b + self.ffn(b)
        return self.cv2(torch.cat((a, b), 1))
