"""Network building blocks of the YOLOv5 v6 family (Conv, Bottleneck, C3, SPPF, Concat).

Kept separate from models/yolo.py so the yaml parser's registry is the only place that maps a
name in a model yaml to a class here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# YOLOv5's BatchNorm settings: a larger eps and slower momentum than torch's defaults keep the
# running statistics stable with the small per-GPU batches detection training uses.
BN_EPS = 1e-3
BN_MOMENTUM = 0.03


def autopad(k: int | list[int], p: int | list[int] | None = None, d: int = 1) -> int | list[int]:
    """Padding that keeps the spatial size for stride 1 ('same'), so strides alone set the scale."""
    if d > 1:
        k = d * (k - 1) + 1 if isinstance(k, int) else [d * (x - 1) + 1 for x in k]
    if p is None:
        p = k // 2 if isinstance(k, int) else [x // 2 for x in k]
    return p


class Conv(nn.Module):
    """Conv2d (no bias, BN provides it) -> BatchNorm2d -> SiLU; the unit every other block uses."""

    def __init__(
        self,
        c1: int,
        c2: int,
        k: int = 1,
        s: int = 1,
        p: int | None = None,
        g: int = 1,
        d: int = 1,
        act: bool | nn.Module = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, autopad(k, p, d), groups=g, dilation=d, bias=False)
        self.bn: nn.BatchNorm2d | None = nn.BatchNorm2d(c2, eps=BN_EPS, momentum=BN_MOMENTUM)
        if act is True:
            self.act: nn.Module = nn.SiLU()
        elif isinstance(act, nn.Module):
            self.act = act
        else:
            self.act = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bn is None:  # folded by fuse_bn()
            return self.forward_fuse(x)
        return self._activate(self.bn(self.conv(x)))

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        """The activation; out of place while autograd records it.

        For an in-place SiLU autograd must keep the input for the backward, so it clones it: a
        full extra copy of every activation per training step that saves no memory. The same kernel out of place gives bit-identical values
        and gradients; in-place stays for inference (no autograd), where it does save work.
        """
        if type(self.act) is nn.SiLU and self.act.inplace and x.requires_grad:
            return F.silu(x)
        return self.act(x)

    def forward_fuse(self, x: torch.Tensor) -> torch.Tensor:
        """Forward once BN has been folded into the conv weights (inference only)."""
        return self.act(self.conv(x))

    def fuse_bn(self) -> None:
        """Fold BN into the conv so inference skips one op per layer; irreversible."""
        if self.bn is not None:
            self.conv = fuse_conv_and_bn(self.conv, self.bn)
            self.bn = None


def fuse_conv_and_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """Return a Conv2d with bias that computes bn(conv(x)) with BN's running statistics."""
    fused = nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=conv.groups,
        bias=True,
    ).to(device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        fused.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1))
        conv_bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        fused.bias.copy_(bn.bias + (conv_bias - bn.running_mean) * scale)
    fused.requires_grad_(False)
    return fused


class Bottleneck(nn.Module):
    """1x1 squeeze then 3x3 conv, with a residual add when shapes allow (the C3 inner unit)."""

    def __init__(self, c1: int, c2: int, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_, c2, 3, 1, g=g)
        self.add = bool(shortcut) and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(nn.Module):
    """CSP block with 3 convs: half the channels go through n Bottlenecks, half skip, then merge."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c1, c_, 1, 1)
        self.cv3 = Conv(2 * c_, c2, 1)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, e=1.0) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: three chained k x k max-pools equal SPP's 5/9/13 pools."""

    def __init__(self, c1: int, c2: int, k: int = 5) -> None:
        super().__init__()
        c_ = c1 // 2
        self.cv1 = Conv(c1, c_, 1, 1)
        self.cv2 = Conv(c_ * 4, c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.m(x)
        y2 = self.m(y1)
        return self.cv2(torch.cat((x, y1, y2, self.m(y2)), 1))


class Concat(nn.Module):
    """Concatenate a list of feature maps along a dimension (channels by default)."""

    def __init__(self, dimension: int = 1) -> None:
        super().__init__()
        self.d = dimension

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, self.d)
