"""Network building blocks: the YOLOv5 v6 family (Conv, Bottleneck, C3, SPPF, Concat) and the
anchor-free YOLOv8 / YOLO11 ones (DWConv, C2f, C3k, C3k2, Attention, PSABlock, C2PSA, DFL).

Kept separate from models/yolo.py so the yaml parser's registry is the only place that maps a
name in a model yaml to a class here.
"""
from __future__ import annotations

import math

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
        return self._activate(self._normalise(self.conv(x)))

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """BatchNorm, as ``self.bn(x)`` computes it, without its ``num_batches_tracked`` counter.

        The counter only matters for a cumulative average (momentum None); with a fixed momentum it is
        read by nothing, yet adding 1 to it is a kernel launch per layer and training step, which on a GPU
        host with slow cores is a measurable part of a step. Outside training (which never counts) the module
        is called, so tools that see modules, such as thop's FLOP count, see it; other norms (SyncBatchNorm)
        keep their own forward."""
        bn = self.bn
        if not bn.training or type(bn) is not nn.BatchNorm2d or bn.momentum is None:
            return bn(x)
        return F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True, bn.momentum, bn.eps)

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


def stack_convs(a: nn.Conv2d, b: nn.Conv2d) -> nn.Conv2d:
    """One Conv2d (with bias) whose output is torch.cat((a(x), b(x)), 1); a and b must match in all but weights."""
    stacked = nn.Conv2d(a.in_channels, a.out_channels + b.out_channels, a.kernel_size, a.stride, a.padding,
                        a.dilation, a.groups, bias=True).to(device=a.weight.device, dtype=a.weight.dtype)
    with torch.no_grad():
        stacked.weight.copy_(torch.cat((a.weight, b.weight)))
        stacked.bias.copy_(torch.cat([c.bias if c.bias is not None else torch.zeros_like(c.weight[:, 0, 0, 0])
                                      for c in (a, b)]))
    stacked.requires_grad_(False)
    return stacked


class DWConv(Conv):
    """Depthwise Conv (groups = gcd(c1, c2)): spatial mixing at a fraction of a full conv's cost,
    paired with a 1x1 Conv in YOLO11's class branch."""

    def __init__(self, c1: int, c2: int, k: int = 1, s: int = 1, d: int = 1, act: bool | nn.Module = True) -> None:
        super().__init__(c1, c2, k, s, g=math.gcd(c1, c2), d=d, act=act)


class Bottleneck(nn.Module):
    """Two convs (kernels ``k``, 1x1 then 3x3 in YOLOv5's C3; 3x3 twice in C2f/C3k2) with a residual
    add when shapes allow."""

    def __init__(
        self, c1: int, c2: int, shortcut: bool = True, g: int = 1, e: float = 0.5,
        k: tuple[int, int] = (1, 3),
    ) -> None:
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = Conv(c1, c_, k[0], 1)
        self.cv2 = Conv(c_, c2, k[1], 1, g=g)
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
        self.cv12: Conv | None = None  # cv1 and cv2 as one conv, once merge_inputs() has run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cv12 is not None:
            a, b = self.cv12(x).chunk(2, 1)
            return self.cv3(torch.cat((self.m(a), b), 1))
        return self.cv3(torch.cat((self.m(self.cv1(x)), self.cv2(x)), 1))

    def merge_inputs(self) -> bool:
        """Inference only, after BN folding: cv1 and cv2 read the same input through the same kind of conv,
        so one conv with their weights stacked gives both outputs in one call (a small map costs per call,
        not per FLOP). Irreversible, like fuse_bn; False (nothing changed) when the two differ."""
        a, b = self.cv1, self.cv2
        same = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups")
        if a.bn is not None or b.bn is not None or type(a.act) is not type(b.act) or \
                any(getattr(a.conv, k) != getattr(b.conv, k) for k in same):
            return False
        self.cv12 = Conv(1, 1, act=a.act)  # a shell for the stacked conv: no BN, the same activation
        self.cv12.conv, self.cv12.bn = stack_convs(a.conv, b.conv), None
        self.cv1 = self.cv2 = None
        return True


class SPPF(nn.Module):
    """Spatial pyramid pooling, fast: ``n`` chained k x k max-pools (three 5x5 pools equal SPP's 5/9/13).

    Two forms, told apart by whether the row gives ``n``: YOLOv5 / YOLOv8 / YOLO11 rows (``[c2, k]``)
    get three pools after an activated 1x1 conv; YOLO26's rows (``[c2, k, n, shortcut]``, Ultralytics
    8.4) leave that first 1x1 conv linear (the pools see signed features) and may add the input back
    when ``shortcut`` and the widths match. Keeping ``n=None`` for the old form keeps every existing
    model's outputs and imported weights unchanged.
    """

    def __init__(self, c1: int, c2: int, k: int = 5, n: int | None = None, shortcut: bool = False) -> None:
        super().__init__()
        c_ = c1 // 2
        self.n = 3 if n is None else int(n)
        if self.n < 1:
            raise ValueError(f"SPPF needs at least one pooling step, got n={n}")
        self.cv1 = Conv(c1, c_, 1, 1, act=n is None)
        self.cv2 = Conv(c_ * (self.n + 1), c2, 1, 1)
        self.m = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)
        self.add = bool(shortcut) and c1 == c2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        for _ in range(self.n):
            y.append(self.m(y[-1]))
        out = self.cv2(torch.cat(y, 1))
        return out + x if self.add else out


class Concat(nn.Module):
    """Concatenate a list of feature maps along a dimension (channels by default)."""

    def __init__(self, dimension: int = 1) -> None:
        super().__init__()
        self.d = dimension

    def forward(self, x: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(x, self.d)


class C2f(nn.Module):
    """YOLOv8's CSP block: one 1x1 conv split in two halves; n Bottlenecks chain on the second half
    and every intermediate output joins the final 1x1 conv, so gradients reach each stage directly."""

    def __init__(self, c1: int, c2: int, n: int = 1, shortcut: bool = False, g: int = 1, e: float = 0.5) -> None:
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut, g, e=1.0, k=(3, 3)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class C3k(C3):
    """C3 whose Bottlenecks use k x k kernels for both convs: YOLO11's heavier C3k2 stage."""

    def __init__(
        self, c1: int, c2: int, n: int = 1, shortcut: bool = True, g: int = 1, e: float = 0.5, k: int = 3,
    ) -> None:
        super().__init__(c1, c2, n, shortcut, g, e)
        c_ = int(c2 * e)
        self.m = nn.Sequential(*(Bottleneck(c_, c_, shortcut, g, e=1.0, k=(k, k)) for _ in range(n)))


class C3k2(C2f):
    """YOLO11's C2f: each stage is a Bottleneck (3x3, 3x3, half width), a two-Bottleneck C3k when
    ``c3k`` (the parser sets it for the m/l/x scales), or a Bottleneck followed by PSABlock
    attention when ``attn``. Argument order follows the yamls: c3k, e, attn, g, shortcut."""

    def __init__(
        self, c1: int, c2: int, n: int = 1, c3k: bool = False, e: float = 0.5, attn: bool = False, g: int = 1,
        shortcut: bool = True,
    ) -> None:
        super().__init__(c1, c2, n, shortcut, g, e)
        self.m = nn.ModuleList(self._stage(bool(c3k), bool(attn), shortcut, g) for _ in range(n))

    def _stage(self, c3k: bool, attn: bool, shortcut: bool, g: int) -> nn.Module:
        if attn:
            return nn.Sequential(Bottleneck(self.c, self.c, shortcut, g, k=(3, 3)),
                                 PSABlock(self.c, attn_ratio=0.5, num_heads=max(self.c // 64, 1)))
        if c3k:
            return C3k(self.c, self.c, 2, shortcut, g)
        return Bottleneck(self.c, self.c, shortcut, g, k=(3, 3))


class Attention(nn.Module):
    """Multi-head self-attention over all H*W positions, with 1x1 convs for q/k/v and the output
    and a depthwise 3x3 on v as positional encoding (attention alone is blind to position).

    Keys and queries use ``attn_ratio`` of the head width, so the attention map is cheaper than v.
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_ratio: float = 0.5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.key_dim = int(self.head_dim * attn_ratio)
        self.scale = self.key_dim ** -0.5
        self.qkv = Conv(dim, dim + 2 * self.key_dim * num_heads, 1, act=False)
        self.proj = Conv(dim, dim, 1, act=False)
        self.pe = Conv(dim, dim, 3, 1, g=dim, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        n = h * w
        q, k, v = self.qkv(x).view(b, self.num_heads, 2 * self.key_dim + self.head_dim, n).split(
            (self.key_dim, self.key_dim, self.head_dim), dim=2)
        attn = ((q * self.scale).transpose(-2, -1) @ k).softmax(dim=-1)  # (b, heads, n, n)
        out = (v @ attn.transpose(-2, -1)).view(b, c, h, w) + self.pe(v.reshape(b, c, h, w))
        return self.proj(out)

    def matmul_macs(self, h: float, w: float) -> float:
        """Multiply-accumulates of the two attention products on an h x w map: thop counts modules
        only, so Model.info adds these (they grow with the square of the pixel count)."""
        n = h * w
        return self.num_heads * n * n * (self.key_dim + self.head_dim)


class PSABlock(nn.Module):
    """Attention then a 2x-wide 1x1 feed-forward, each with a residual add (a transformer layer on convs)."""

    def __init__(self, c: int, attn_ratio: float = 0.5, num_heads: int = 4, shortcut: bool = True) -> None:
        super().__init__()
        self.attn = Attention(c, num_heads=num_heads, attn_ratio=attn_ratio)
        self.ffn = nn.Sequential(Conv(c, c * 2, 1), Conv(c * 2, c, 1, act=False))
        self.add = bool(shortcut)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x) if self.add else self.attn(x)
        return x + self.ffn(x) if self.add else self.ffn(x)


class C2PSA(nn.Module):
    """CSP wrapper around n PSABlocks: attention runs on half the channels only, which keeps its
    quadratic cost down on the stride-32 map where YOLO11 places it. Input and output widths match."""

    def __init__(self, c1: int, c2: int, n: int = 1, e: float = 0.5) -> None:
        super().__init__()
        if c1 != c2:
            raise ValueError(f"C2PSA keeps the channel count: input {c1} and output {c2} must be equal")
        self.c = int(c1 * e)
        self.cv1 = Conv(c1, 2 * self.c, 1, 1)
        self.cv2 = Conv(2 * self.c, c1, 1)
        self.m = nn.Sequential(*(PSABlock(self.c, attn_ratio=0.5, num_heads=max(self.c // 64, 1)) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.cv1(x).split((self.c, self.c), dim=1)
        return self.cv2(torch.cat((a, self.m(b)), 1))


class DFL(nn.Module):
    """The Distribution Focal Loss integral: each box side is predicted as logits over reg_max
    bins 0..reg_max-1 (grid units), and its distance is the softmax-weighted mean bin.

    Kept as a fixed 1x1 conv with weights 0..reg_max-1 (no gradient) so it counts as a parameter
    like the reference models; fusing leaves it alone.
    """

    def __init__(self, reg_max: int = 16) -> None:
        super().__init__()
        self.reg_max = reg_max
        self.conv = nn.Conv2d(reg_max, 1, 1, bias=False).requires_grad_(False)
        with torch.no_grad():
            self.conv.weight.copy_(torch.arange(reg_max, dtype=torch.float32).view(1, reg_max, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 4 * reg_max, N) logits, side-major -> (B, 4, N) distances (left, top, right, bottom)."""
        b, _, n = x.shape
        p = x.view(b, 4, self.reg_max, n).transpose(2, 1).softmax(1)  # (B, reg_max, 4, N)
        return self.conv(p).view(b, 4, n)
