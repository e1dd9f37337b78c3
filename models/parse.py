"""Model yaml -> layers: loading and validating the file, and building its rows through a registry.

The yaml is parsed through an explicit registry (no eval), so a typo in a model file is a clear
``UserError`` naming the file and row instead of a traceback from deep inside torch.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from models.blocks import C3, SPPF, Bottleneck, Concat, Conv
from models.heads.anchor import Detect, check_anchors_spec
from models.heads.base import Head
from utils.core.errors import UserError, did_you_mean
from utils.core.logging import LOGGER

MODELS_DIR = Path(__file__).resolve().parent
TOP_LEVEL_KEYS = ("nc", "depth_multiple", "width_multiple", "anchors", "backbone", "head", "ch")
UPSAMPLE_MODES = ("nearest", "bilinear", "bicubic")


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


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


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
    if not isinstance(layers[-1], Head):
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
    elif issubclass(cls, Head):  # a detection head: nc, its own arguments, then each level's channels
        if not isinstance(f, list) or n != 1:
            raise UserError(f"{where}: Detect needs number 1 and a list of 'from' layers, one per level")
        if cls.has_anchors and len(args) >= 2:
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
