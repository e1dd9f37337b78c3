"""YOLOv5-style detection model built from a model yaml, and its Detect head.

The yaml is parsed through an explicit registry (no eval), so a typo in a model file is a clear
``UserError`` naming the file and row instead of a traceback from deep inside torch.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from torch import nn

from models.blocks import C3, SPPF, Bottleneck, Concat, Conv
from utils.core.errors import UserError, did_you_mean
from utils.core.logging import LOGGER

MODELS_DIR = Path(__file__).resolve().parent
TOP_LEVEL_KEYS = ("nc", "depth_multiple", "width_multiple", "anchors", "backbone", "head", "ch")
UPSAMPLE_MODES = ("nearest", "bilinear", "bicubic")
PROBE_SIZE = 256  # image side used to measure the strides of a freshly built model


class Detect(nn.Module):
    """Per-level 1x1 convs that predict na boxes of (xywh, obj, nc classes) at every grid cell.

    ``anchors`` are kept in grid units (pixels / stride) because that is what the loss matches
    targets against; eval mode decodes to input-image pixels for NMS.
    """

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
        return torch.cat([self._decode(i, p) for i, p in enumerate(raw)], 1), raw

    def _decode(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """Raw level-i output -> (bs, na*ny*nx, no) with xywh in pixels (YOLOv5 v6 formula)."""
        bs, _, ny, nx, _ = p.shape
        grid = self._grid(nx, ny, p.device, p.dtype)
        stride = self.stride[i].to(p.dtype)
        anchor_px = (self.anchors[i] * self.stride[i]).view(1, self.na, 1, 1, 2).to(p.dtype)
        xy, wh, conf = p.sigmoid().split((2, 2, self.nc + 1), 4)
        xy = (xy * 2 + grid) * stride  # grid already holds the -0.5 offset
        wh = (wh * 2) ** 2 * anchor_px
        return torch.cat((xy, wh, conf), 4).view(bs, -1, self.no)

    def _grid(self, nx: int, ny: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Cell coordinates minus 0.5, shape (1, 1, ny, nx, 2); cached since shapes repeat."""
        key = (nx, ny, device, dtype)
        grid = self._grids.get(key)
        if grid is None:
            if len(self._grids) >= 32:  # rectangular val batches vary in shape: stay bounded
                self._grids.clear()
            yv, xv = torch.meshgrid(
                torch.arange(ny, device=device, dtype=dtype),
                torch.arange(nx, device=device, dtype=dtype),
                indexing="ij",
            )
            grid = (torch.stack((xv, yv), 2) - 0.5).view(1, 1, ny, nx, 2)
            self._grids[key] = grid
        return grid


# Names a model yaml may use, and the class each builds. Nothing outside this dict is reachable.
MODULES: dict[str, type[nn.Module]] = {
    "Conv": Conv,
    "Bottleneck": Bottleneck,
    "C3": C3,
    "SPPF": SPPF,
    "Concat": Concat,
    "Detect": Detect,
    "nn.Upsample": nn.Upsample,
}
CHANNEL_MODULES = (Conv, Bottleneck, C3, SPPF)  # args start with output channels
REPEAT_INSIDE = (C3,)  # take `number` as their own depth argument


class ModelInfo(NamedTuple):
    """Summary numbers of a model, as YOLOv5 prints them."""

    layers: int
    parameters: int
    gradients: int
    gflops: float


class Model(nn.Module):
    """A detection model built from a YOLOv5-format model yaml (path or dict).

    ``self.yaml`` is the plain dict (with ch, nc and anchors overrides applied) that checkpoints
    store; ``Model(self.yaml)`` rebuilds the same architecture.
    """

    def __init__(
        self,
        cfg: str | Path | dict,
        ch: int = 3,
        nc: int | None = None,
        anchors: list[list[float]] | None = None,
        na: int | None = None,
    ) -> None:
        """``na`` (anchors per level, YOLOv5's hyp ``anchors``) resamples the yaml's (or the
        ``anchors`` override's) anchors to that count: placeholders that autoanchor then fits."""
        super().__init__()
        d, source = load_model_yaml(cfg)
        d["ch"] = d.get("ch", ch)
        if nc is not None and nc != d.get("nc"):
            if "nc" in d:
                LOGGER.info(f"Overriding {source} nc={d['nc']} with nc={nc}")
            d["nc"] = int(nc)
        if anchors is not None:
            LOGGER.info(f"Overriding {source} anchors with {anchors}")
            d["anchors"] = _plain_anchors(anchors)
        if na is not None:
            base = check_anchors_spec(d.get("anchors"), f"{source}: 'anchors'")
            if na != len(base[0]) // 2:
                d["anchors"] = resample_anchors(base, na)
                LOGGER.info(f"Overriding {source} anchors with {na} per level (placeholders until "
                            f"autoanchor fits them): {d['anchors']}")
        self.yaml: dict[str, Any] = d
        self.source = source
        self.model, self.save = parse_model(copy.deepcopy(d), [d["ch"]], source=source)
        det = self.detect
        det.stride.copy_(self._probe_strides(d["ch"]))
        check_anchor_order(det)
        det.anchors /= det.stride.view(-1, 1, 1)
        self._initialize_biases()
        initialize_weights(self)

    @property
    def detect(self) -> Detect:
        """The Detect head (last layer)."""
        return self.model[-1]

    @property
    def stride(self) -> torch.Tensor:
        """Strides of the detection levels, e.g. tensor([8., 16., 32.])."""
        return self.detect.stride

    def forward(self, x: torch.Tensor) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        y: list[torch.Tensor | None] = []
        for m in self.model:
            if m.f != -1:  # input from earlier layers rather than the previous one
                x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
            x = m(x)
            y.append(x if m.i in self.save else None)
        return x

    def _probe_strides(self, ch: int) -> torch.Tensor:
        """Run a zero image through the net to read each level's stride (BN stats untouched)."""
        was_training = self.training
        self.train()
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
        try:
            with torch.no_grad():
                out = self.forward(torch.zeros(1, ch, PROBE_SIZE, PROBE_SIZE))
        except (RuntimeError, TypeError, ValueError) as e:
            raise UserError(f"{self.source}: the model does not run on a {PROBE_SIZE}x{PROBE_SIZE} image "
                            f"(check channel counts and 'from' indices): {e}") from None
        finally:
            self.train(was_training)
        return torch.tensor([PROBE_SIZE / o.shape[-2] for o in out], dtype=torch.float32)

    def _initialize_biases(self) -> None:
        """YOLOv5 priors: ~8 objects per 640 image and ~0.6/nc class probability at start."""
        det = self.detect
        for conv, s in zip(det.m, det.stride.tolist()):
            b = conv.bias.data.view(det.na, -1)
            b[:, 4] += math.log(8 / (640 / s) ** 2)
            b[:, 5 : 5 + det.nc] += math.log(0.6 / (det.nc - 0.99))

    def fuse(self) -> Model:
        """Fold every BatchNorm into its conv for faster inference; returns self."""
        n = 0
        for m in self.modules():
            if isinstance(m, Conv) and m.bn is not None:
                m.fuse_bn()
                n += 1
        LOGGER.debug(f"Fused {n} Conv+BN layers")
        return self

    def info(self, imgsz: int | tuple[int, int] = 640) -> ModelInfo:
        """Count layers/parameters and estimate GFLOPs at imgsz, and log one summary line."""
        n_p = sum(p.numel() for p in self.parameters())
        n_g = sum(p.numel() for p in self.parameters() if p.requires_grad)
        layers = len(list(self.modules()))
        gflops = self._gflops(imgsz)
        info = ModelInfo(layers, n_p, n_g, gflops)
        LOGGER.info(f"Model summary: {layers} layers, {n_p:,} parameters, {n_g:,} gradients, {gflops:.1f} GFLOPs")
        return info

    def _gflops(self, imgsz: int | tuple[int, int]) -> float:
        """thop on a stride-sized image, scaled to imgsz (cheap; FLOPs grow with pixel count)."""
        h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
        try:
            import thop
        except ImportError:
            LOGGER.warning("thop is not installed: GFLOPs not computed")
            return 0.0
        p = next(self.parameters())
        s = max(int(self.stride.max()), 32)
        im = torch.zeros((1, self.yaml["ch"], s, s), device=p.device, dtype=p.dtype)
        try:
            macs = thop.profile(copy.deepcopy(self), inputs=(im,), verbose=False)[0]
        except Exception as e:  # a summary number must never stop training
            LOGGER.warning(f"GFLOPs not computed: thop failed with {type(e).__name__}: {e}")
            return 0.0
        return macs / 1e9 * 2 * (h / s) * (w / s)


def de_parallel(model: nn.Module) -> nn.Module:
    """The wrapped model of a DataParallel/DDP wrapper, else the model itself."""
    wrappers = (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)
    return model.module if isinstance(model, wrappers) else model


def initialize_weights(model: nn.Module) -> None:
    """YOLOv5 init: BN eps/momentum tuned for detection, in-place activations to save memory."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = 1e-3
            m.momentum = 0.03
        elif isinstance(m, (nn.SiLU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardswish)):
            m.inplace = True


def check_anchor_order(det: Detect) -> None:
    """Flip anchors if they are listed large-to-small while strides go small-to-large."""
    area = det.anchors.prod(-1).mean(-1).view(-1)
    da = area[-1] - area[0]
    ds = det.stride[-1] - det.stride[0]
    if da and da.sign() != ds.sign():
        LOGGER.info("Reversing anchor order to match strides")
        det.anchors[:] = det.anchors.flip(0)


def make_divisible(x: float, divisor: int = 8) -> int:
    """Smallest multiple of divisor >= x, so channel counts suit hardware kernels."""
    return int(math.ceil(x / divisor) * divisor)


# ----------------------------------------------------------------------------------------------
# yaml loading and validation


def load_model_yaml(cfg: str | Path | dict) -> tuple[dict, str]:
    """Return (a deep copy of the model dict, a label for error messages)."""
    if isinstance(cfg, dict):
        d, source = copy.deepcopy(cfg), "model yaml"
    else:
        path = _find_model_yaml(Path(cfg))
        source = str(path)
        try:
            d = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise UserError(f"{source}: not valid YAML: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{source}: cannot read model yaml: {e}") from None
    if not isinstance(d, dict):
        raise UserError(f"{source}: a model yaml must be a mapping with keys nc, anchors, backbone, head; "
                        f"got {type(d).__name__}")
    _check_top_level(d, source)
    return d, source


def _find_model_yaml(path: Path) -> Path:
    """The path itself, else the same file name inside models/ (so 'yolov5s.yaml' just works)."""
    if path.is_file():
        return path
    bundled = MODELS_DIR / path.name
    if path.parent == Path(".") and bundled.is_file():
        return bundled
    known = sorted(p.name for p in MODELS_DIR.glob("*.yaml"))
    raise UserError(f"{path}: model yaml not found.{did_you_mean(path.name, known)}"
                    f" Bundled models: {', '.join(known)}")


def _check_top_level(d: dict, source: str) -> None:
    """Reject unknown or missing keys and bad multipliers before building anything."""
    for key in d:
        if key not in TOP_LEVEL_KEYS:
            raise UserError(f"{source}: unknown key '{key}'.{did_you_mean(key, TOP_LEVEL_KEYS)}"
                            f" Allowed keys: {', '.join(TOP_LEVEL_KEYS)}")
    for key in ("backbone", "head", "anchors"):
        if key not in d:
            raise UserError(f"{source}: missing key '{key}'")
    for key in ("backbone", "head"):
        if not isinstance(d[key], list):
            raise UserError(f"{source}: '{key}' must be a list of [from, number, module, args] rows")
    for key in ("depth_multiple", "width_multiple"):
        v = d.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise UserError(f"{source}: '{key}' must be a positive number, got {v!r}")
    if "ch" in d and not _is_pos_int(d["ch"]):
        raise UserError(f"{source}: 'ch' must be a positive integer, got {d['ch']!r}")


def _check_nc(d: dict, source: str) -> int:
    if "nc" not in d:
        raise UserError(f"{source}: missing key 'nc' (number of classes)")
    if not _is_pos_int(d["nc"]):
        raise UserError(f"{source}: 'nc' must be a positive integer, got {d['nc']!r}")
    return d["nc"]


def check_anchors_spec(anchors: Any, where: str) -> list[list[float]]:
    """Anchors must be per-level lists of (w, h) pixel pairs, the same count on every level."""
    if isinstance(anchors, int) and not isinstance(anchors, bool):
        raise UserError(f"{where}: anchors given as a count ({anchors}) are not supported; "
                        "list (w, h) pixel pairs per level, e.g. [[10,13, 16,30, 33,23], ...]")
    ok = isinstance(anchors, list) and anchors and all(isinstance(a, list) and a for a in anchors)
    ok = ok and all(_is_number(v) and v > 0 for a in anchors for v in a)
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


def _plain_anchors(anchors: Any) -> list[list[float]]:
    """Anchors override (list, array or tensor) -> nested list of Python numbers for self.yaml."""
    if hasattr(anchors, "tolist"):
        anchors = anchors.tolist()
    out = []
    for level in anchors:
        flat = level.tolist() if hasattr(level, "tolist") else level
        flat = [v for pair in flat for v in (pair if isinstance(pair, (list, tuple)) else [pair])]
        out.append([float(v) for v in flat])
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# ----------------------------------------------------------------------------------------------
# parsing


def parse_model(d: dict, ch: int | list[int], source: str = "model yaml") -> tuple[nn.Sequential, list[int]]:
    """Build the layers from the yaml rows; returns (nn.Sequential, indices whose output is reused)."""
    _check_top_level(d, source)
    nc = _check_nc(d, source)
    anchors = check_anchors_spec(d["anchors"], source)
    gd, gw = d.get("depth_multiple", 1.0), d.get("width_multiple", 1.0)
    na = len(anchors[0]) // 2
    no = na * (nc + 5)
    # chs[j] = output channels of layer j; before layer 0 it holds only the image channels (-1)
    chs = [ch[-1] if isinstance(ch, (list, tuple)) else ch]
    layers, save = [], set()
    rows = [("backbone", k, r) for k, r in enumerate(d["backbone"])] + [("head", k, r) for k, r in enumerate(d["head"])]
    if not rows:
        raise UserError(f"{source}: backbone and head have no rows")
    for i, (section, k, row) in enumerate(rows):
        where = f"{source}: {section} row {k} {row!r}"
        f, n, cls, args = _check_row(row, i, where)
        args = _resolve_args(args, cls, nc, anchors, where)
        n = max(round(n * gd), 1) if n > 1 else n
        m, c2 = _build_layer(cls, f, n, args, chs, gw, no, where)
        m.i, m.f, m.kind = i, f, cls.__name__  # read by Model.forward and the layer table
        m.np = sum(p.numel() for p in m.parameters())
        LOGGER.debug(f"{i:>3}{str(f):>18}{n:>3}{m.np:10.0f}  {m.kind:<24}{args}")
        save.update(x for x in ([f] if isinstance(f, int) else f) if x != -1)
        layers.append(m)
        if i == 0:
            chs = []
        chs.append(c2)
    if not isinstance(layers[-1], Detect):
        raise UserError(f"{source}: the last row of head must be a Detect layer")
    return nn.Sequential(*layers), sorted(save)


def _check_row(row: Any, i: int, where: str) -> tuple[int | list[int], int, type[nn.Module], list]:
    """Validate one [from, number, module, args] row; 'from' becomes absolute (except -1)."""
    if not isinstance(row, list) or len(row) != 4:
        raise UserError(f"{where}: a row must be [from, number, module, args]")
    f, n, name, args = row
    if not isinstance(name, str) or name not in MODULES:
        raise UserError(f"{where}: unknown module {name!r}.{did_you_mean(str(name), MODULES)}"
                        f" Known modules: {', '.join(MODULES)}")
    if not _is_pos_int(n):
        raise UserError(f"{where}: number must be a positive integer, got {n!r}")
    if not isinstance(args, list):
        raise UserError(f"{where}: args must be a list, got {args!r}")
    return _check_from(f, i, where), n, MODULES[name], args


def _check_from(f: Any, i: int, where: str) -> int | list[int]:
    """-1 means the previous layer; other indices must point at an earlier layer."""
    items = f if isinstance(f, list) else [f]
    if not items or not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        raise UserError(f"{where}: 'from' must be an integer or a list of integers, got {f!r}")
    out = []
    for x in items:
        if x == -1:
            out.append(-1)
            continue
        j = x + i if x < 0 else x
        if i == 0 or not 0 <= j < i:
            valid = "only -1 (the input image)" if i == 0 else f"-1 or {-i}..{i - 1}"
            raise UserError(f"{where}: 'from' index {x} is out of range for layer {i} (valid: {valid})")
        out.append(j)
    return out if isinstance(f, list) else out[0]


def _resolve_args(args: list, cls: type[nn.Module], nc: int, anchors: list, where: str) -> list:
    """Substitute the few names a yaml may use; any other string is a mistake."""
    out = []
    for a in args:
        if isinstance(a, str):
            if a == "nc":
                a = nc
            elif a == "anchors":
                a = anchors
            elif a == "None":
                a = None
            elif not (cls is nn.Upsample and a in UPSAMPLE_MODES):
                allowed = ["nc", "anchors", "None"] + (list(UPSAMPLE_MODES) if cls is nn.Upsample else [])
                raise UserError(f"{where}: argument {a!r} is not allowed.{did_you_mean(a, allowed)}"
                                f" Strings allowed here: {', '.join(allowed)}")
        out.append(a)
    return out


def _build_layer(
    cls: type[nn.Module], f: int | list[int], n: int, args: list, chs: list[int],
    gw: float, no: int, where: str,
) -> tuple[nn.Module, int]:
    """Instantiate one row (repeated n times when the class does not repeat itself)."""
    if cls in CHANNEL_MODULES:
        if not args or not _is_pos_int(args[0]):
            raise UserError(f"{where}: first argument of {cls.__name__} must be the output channel count")
        c1, c2 = chs[f if isinstance(f, int) else f[0]], args[0]
        if c2 != no:  # the layer feeding Detect directly keeps its exact width
            c2 = make_divisible(c2 * gw, 8)
        args = [c1, c2, *args[1:]]
        if cls in REPEAT_INSIDE:
            args.insert(2, n)
            n = 1
    elif cls is Concat:
        c2 = sum(chs[j] for j in (f if isinstance(f, list) else [f]))
    elif cls is Detect:
        if not isinstance(f, list) or n != 1:
            raise UserError(f"{where}: Detect needs number 1 and a list of 'from' layers, one per level")
        if len(args) >= 2:
            anchors = check_anchors_spec(args[1], where)
            if len(anchors) != len(f):
                raise UserError(f"{where}: {len(anchors)} anchor levels but {len(f)} input layers")
        if not args or not _is_pos_int(args[0]):
            raise UserError(f"{where}: first argument of Detect must be nc (a positive integer)")
        args = [*args, [chs[j] for j in f]]
        c2 = 0  # nothing consumes Detect's output
    else:
        c2 = chs[f if isinstance(f, int) else f[0]]
    try:
        m = nn.Sequential(*(cls(*args) for _ in range(n))) if n > 1 else cls(*args)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{where}: cannot build {cls.__name__} with args {args}: {e}") from None
    return m, c2
