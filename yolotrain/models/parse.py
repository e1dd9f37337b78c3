"""Model yaml -> layers: loading and validating the file, and building its rows through a registry.

The yaml is parsed through an explicit registry (no eval), so a typo in a model file is a clear
``UserError`` naming the file and row instead of a traceback from deep inside torch.

Two ways to size a model:
- YOLOv5's: ``depth_multiple`` and ``width_multiple`` in the file (models/yolov5{n,s,m,l,x}.yaml).
- Ultralytics' ``scales: {n: [depth, width, max_channels], s: ...}`` (models/yolov8.yaml,
  yolo11.yaml, yolov5u.yaml: one file per family; yolov10{n,s,m,b,l,x}.yaml: one file per size, whose
  sizes differ in more than the table). The size is the ``scale:`` key if the yaml
  has one, else the size letter in the requested file name: ``yolov8n.yaml`` means yolov8.yaml
  at scale n (the letter right after ``yolo[v]<digits>``; ``yolov5nu.yaml`` -> yolov5u.yaml, n).
  A name naming a family file with no letter (``yolov8.yaml``) and no ``scale:`` key is an error,
  as is a key that contradicts the name. The chosen size is written into the dict as ``scale``,
  so the dict a checkpoint stores rebuilds the same size without any file name. Channels are
  ``make_divisible(min(c, max_channels) * width, 8)``; for the m, l and x scales every C3k2 row
  gets ``c3k`` True (YOLO11's rule: those sizes use C3k stages).

Anchors (top-level ``anchors``) are required only when the last row is an anchor head (Detect);
an anchor-free head (DFLDetect, E2EDetect) needs none. Top-level ``end2end`` (bool) and ``reg_max``
(positive integer) are Ultralytics 8.4's keys: ``end2end: True`` makes the head row the end-to-end
head (models/registry.py says which class each row builds).
"""
from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from torch import nn

from yolotrain.models.blocks import C3k2, Concat
from yolotrain.models.heads.anchor import check_anchors_spec
from yolotrain.models.heads.base import Head
from yolotrain.models.registry import (CHANNEL_MODULES, MODULES, REPEAT_INSIDE, head_args, head_class, head_has_anchors,
                             head_names, row_class)
from yolotrain.utils.core.errors import UserError, did_you_mean
from yolotrain.utils.core.fileio import shipped
from yolotrain.utils.core.logging import LOGGER

MODELS_DIR = Path(__file__).resolve().parent
TOP_LEVEL_KEYS = ("nc", "depth_multiple", "width_multiple", "scales", "scale", "anchors", "backbone", "head", "ch",
                  "end2end", "reg_max")
SIZE_IN_NAME = re.compile(r"yolov?\d+([nsmblx])")  # yolov8n, yolo11s, yolov5nu, yolov10b: the letter is the scale
C3K_SCALES = ("m", "l", "x")
UPSAMPLE_MODES = ("nearest", "bilinear", "bicubic")


class Scaling(NamedTuple):
    """How rows are sized: depth and width multipliers, the channel cap before widening, the scale letter."""

    depth: float = 1.0
    width: float = 1.0
    max_channels: float = math.inf
    scale: str | None = None


def make_divisible(x: float, divisor: int = 8) -> int:
    """Smallest multiple of divisor >= x, so channel counts suit hardware kernels."""
    return int(math.ceil(x / divisor) * divisor)


# ----------------------------------------------------------------------------------------------
# yaml loading and validation


def load_model_yaml(cfg: str | Path | dict) -> tuple[dict, str]:
    """Return (a deep copy of the model dict, a label for error messages)."""
    name_scale = None
    if isinstance(cfg, dict):
        d, source = copy.deepcopy(cfg), "model yaml"
    else:
        path = _find_model_yaml(Path(cfg))
        name_scale = _size_in_name(Path(cfg).name)
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
    if "scales" in d:
        d["scale"] = _choose_scale(d, name_scale, source)
    return d, source


def _size_in_name(name: str) -> str | None:
    """The scale letter of a sized model file name ('yolov8n.yaml' -> 'n'), else None."""
    m = SIZE_IN_NAME.search(Path(name).stem)
    return m.group(1) if m else None


def _family_name(name: str) -> str | None:
    """The family file a sized name stands for ('yolov8n.yaml' -> 'yolov8.yaml'), else None."""
    m = SIZE_IN_NAME.search(name)
    return name[: m.start(1)] + name[m.end(1):] if m else None


def _find_model_yaml(path: Path) -> Path:
    """The path itself, else the same file name among the shipped models (so 'yolov5s.yaml' and YOLOv5's
    'models/yolov5s.yaml' work from any folder and installed);
    then the same two places for the family file of a sized name (yolov8n.yaml -> yolov8.yaml)."""
    family = _family_name(path.name)
    for name in [path.name] + ([family] if family else []):
        found = shipped(path.with_name(name), "models")  # as typed, else 'yolov5s.yaml', 'models/yolov5s.yaml'
        if found.is_file():
            return found
    known = _bundled_names()
    raise UserError(f"{path}: model yaml not found.{did_you_mean(path.name, known)}"
                    f" Bundled models: {', '.join(known)}")


def _bundled_names() -> list[str]:
    """Every name --cfg accepts from models/: the files, and each family file's sized names."""
    names = []
    for p in sorted(MODELS_DIR.glob("*.yaml")):
        try:
            d = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            d = None
        scales = d.get("scales") if isinstance(d, dict) else None
        m = re.search(r"yolov?\d+", p.stem)
        if isinstance(scales, dict) and m and _size_in_name(p.name) not in scales:
            names += [f"{p.stem[: m.end()]}{k}{p.stem[m.end():]}.yaml" for k in scales]
        else:
            names.append(p.name)
    return names


def _choose_scale(d: dict, name_scale: str | None, source: str) -> str:
    """The size of a ``scales`` yaml: its ``scale`` key, else the letter in the file name (module docstring)."""
    scales = d["scales"]
    choices = ", ".join(map(str, scales))
    scale = d.get("scale")
    if scale is None:
        if name_scale is None:
            raise UserError(f"{source}: 'scales' ({choices}) but no size chosen: add a 'scale' key (e.g. 'scale: n') "
                            f"or put the size in the file name (yolov8n.yaml is yolov8.yaml at scale n)")
        scale = name_scale
    elif name_scale is not None and name_scale != scale and name_scale in scales:
        raise UserError(f"{source}: 'scale: {scale}' contradicts the size '{name_scale}' in the file name")
    if scale not in scales:
        raise UserError(f"{source}: scale {scale!r} is not one of the yaml's scales ({choices})")
    return scale


def _check_top_level(d: dict, source: str) -> None:
    """Reject unknown or missing keys and bad multipliers before building anything."""
    for key in d:
        if key not in TOP_LEVEL_KEYS:
            raise UserError(f"{source}: unknown key '{key}'.{did_you_mean(key, TOP_LEVEL_KEYS)}"
                            f" Allowed keys: {', '.join(TOP_LEVEL_KEYS)}")
    for key in ("backbone", "head"):
        if key not in d:
            raise UserError(f"{source}: missing key '{key}'")
    if "end2end" in d and not isinstance(d["end2end"], bool):
        raise UserError(f"{source}: 'end2end' must be true or false, got {d['end2end']!r}")
    if "reg_max" in d and not _is_pos_int(d["reg_max"]):
        raise UserError(f"{source}: 'reg_max' must be a positive integer, got {d['reg_max']!r}")
    if "anchors" not in d and head_has_anchors(d):
        raise UserError(f"{source}: missing key 'anchors'")
    for key in ("backbone", "head"):
        if not isinstance(d[key], list):
            raise UserError(f"{source}: '{key}' must be a list of [from, number, module, args] rows")
    for key in ("depth_multiple", "width_multiple"):
        v = d.get(key, 1.0)
        if not _is_pos_number(v):
            raise UserError(f"{source}: '{key}' must be a positive number, got {v!r}")
    if "ch" in d and not _is_pos_int(d["ch"]):
        raise UserError(f"{source}: 'ch' must be a positive integer, got {d['ch']!r}")
    if "scales" in d:
        _check_scales(d, source)
    elif "scale" in d:
        raise UserError(f"{source}: 'scale' needs a 'scales' table to choose from")


def _check_scales(d: dict, source: str) -> None:
    """``scales`` maps a size letter to [depth, width, max_channels]; it replaces the two multipliers."""
    both = [k for k in ("depth_multiple", "width_multiple") if k in d]
    if both:
        named = " and ".join(repr(k) for k in both)
        raise UserError(f"{source}: 'scales' and {named} both size the model; keep one")
    scales = d["scales"]
    if not isinstance(scales, dict) or not scales:
        raise UserError(f"{source}: 'scales' must map size names to [depth, width, max_channels], got {scales!r}")
    for k, v in scales.items():
        if not (isinstance(v, list) and len(v) == 3 and all(_is_pos_number(x) for x in v)):
            raise UserError(f"{source}: scales[{k!r}] must be [depth, width, max_channels] (positive numbers), "
                            f"got {v!r}")
    scale = d.get("scale")
    if scale is not None and scale not in scales:
        choices = ", ".join(map(str, scales))
        raise UserError(f"{source}: scale {scale!r} is not one of the yaml's scales ({choices})")


def _check_nc(d: dict, source: str) -> int:
    if "nc" not in d:
        raise UserError(f"{source}: missing key 'nc' (number of classes)")
    if not _is_pos_int(d["nc"]):
        raise UserError(f"{source}: 'nc' must be a positive integer, got {d['nc']!r}")
    return d["nc"]


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _is_pos_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def parse_model(d: dict, ch: int | list[int], source: str = "model yaml") -> tuple[nn.Sequential, list[int]]:
    """Build the layers from the yaml rows; returns (nn.Sequential, indices whose output is reused)."""
    _check_top_level(d, source)
    nc = _check_nc(d, source)
    anchors = check_anchors_spec(d["anchors"], source) if "anchors" in d else None
    if anchors is not None and not head_has_anchors(d):
        LOGGER.warning(f"{source}: 'anchors' are not used by the anchor-free {head_class(d).__name__} head")
    sizing = _scaling(d, source)
    gd = sizing.depth
    # the width of a layer feeding an anchor head directly is kept exact (YOLOv5's rule)
    no = len(anchors[0]) // 2 * (nc + 5) if anchors is not None and head_has_anchors(d) else None
    # chs[j] = output channels of layer j; before layer 0 it holds only the image channels (-1)
    chs = [ch[-1] if isinstance(ch, (list, tuple)) else ch]
    layers, save = [], set()
    rows = [("backbone", k, r) for k, r in enumerate(d["backbone"])] + [("head", k, r) for k, r in enumerate(d["head"])]
    if not rows:
        raise UserError(f"{source}: backbone and head have no rows")
    for i, (section, k, row) in enumerate(rows):
        where = f"{source}: {section} row {k} {row!r}"
        f, n, cls, args = _check_row(row, i, where, d)
        args = _resolve_args(args, cls, nc, anchors, where)
        if issubclass(cls, Head):
            args = head_args(cls, args, d, [r for _, _, r in rows])
        n = max(round(n * gd), 1) if n > 1 else n
        m, c2 = _build_layer(cls, f, n, args, chs, sizing, no, where)
        m.i, m.f, m.kind = i, f, cls.__name__  # read by Model.forward and the layer table
        m.np = sum(p.numel() for p in m.parameters())
        LOGGER.debug(f"{i:>3}{str(f):>18}{n:>3}{m.np:10.0f}  {m.kind:<24}{args}")
        save.update(x for x in ([f] if isinstance(f, int) else f) if x != -1)
        layers.append(m)
        if i == 0:
            chs = []
        chs.append(c2)
    if not isinstance(layers[-1], Head):
        raise UserError(f"{source}: the last row of head must be a detection head ({', '.join(head_names())})")
    return nn.Sequential(*layers), sorted(save)


def _scaling(d: dict, source: str) -> Scaling:
    """The yaml's sizing: its chosen ``scales`` row, else YOLOv5's multipliers (no channel cap)."""
    if "scales" not in d:
        return Scaling(d.get("depth_multiple", 1.0), d.get("width_multiple", 1.0))
    if d.get("scale") is None:
        choices = ", ".join(map(str, d["scales"]))
        raise UserError(f"{source}: a model dict with 'scales' needs 'scale' (one of {choices})")
    depth, width, max_channels = d["scales"][d["scale"]]
    return Scaling(depth, width, max_channels, d["scale"])


def _check_row(row: Any, i: int, where: str, d: dict) -> tuple[int | list[int], int, type[nn.Module], list]:
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
    return _check_from(f, i, where), n, row_class(name, d), args


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


def _resolve_args(args: list, cls: type[nn.Module], nc: int, anchors: list | None, where: str) -> list:
    """Substitute the few names a yaml may use; any other string is a mistake."""
    out = []
    for a in args:
        if isinstance(a, str):
            if a == "nc":
                a = nc
            elif a == "anchors":
                if anchors is None:
                    raise UserError(f"{where}: argument 'anchors' names the top-level key 'anchors', "
                                    "which this yaml does not have")
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
    sizing: Scaling, no: int | None, where: str,
) -> tuple[nn.Module, int]:
    """Instantiate one row (repeated n times when the class does not repeat itself)."""
    kwargs: dict[str, Any] = {}
    if cls in CHANNEL_MODULES:
        if not args or not _is_pos_int(args[0]):
            raise UserError(f"{where}: first argument of {cls.__name__} must be the output channel count")
        c1, c2 = chs[f if isinstance(f, int) else f[0]], args[0]
        if c2 != no:  # the layer feeding an anchor head directly keeps its exact width
            c2 = make_divisible(min(c2, sizing.max_channels) * sizing.width, 8)
        args = [c1, c2, *args[1:]]
        if cls in REPEAT_INSIDE:
            args.insert(2, n)
            n = 1
        if cls is C3k2 and sizing.scale in C3K_SCALES:
            args[3:4] = [True]  # c3k, whether or not the row gave it
    elif cls is Concat:
        c2 = sum(chs[j] for j in (f if isinstance(f, list) else [f]))
    elif issubclass(cls, Head):  # a detection head: nc, its own arguments, and ch= each level's channels
        if not isinstance(f, list) or n != 1:
            raise UserError(f"{where}: {cls.__name__} needs number 1 and a list of 'from' layers, one per level")
        if cls.has_anchors and len(args) >= 2:
            anchors = check_anchors_spec(args[1], where)
            if len(anchors) != len(f):
                raise UserError(f"{where}: {len(anchors)} anchor levels but {len(f)} input layers")
        if not args or not _is_pos_int(args[0]):
            raise UserError(f"{where}: first argument of {cls.__name__} must be nc (a positive integer)")
        kwargs["ch"] = [chs[j] for j in f]
        c2 = 0  # nothing consumes the head's output
    else:
        c2 = chs[f if isinstance(f, int) else f[0]]
    try:
        m = nn.Sequential(*(cls(*args, **kwargs) for _ in range(n))) if n > 1 else cls(*args, **kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UserError(f"{where}: cannot build {cls.__name__} with args {args}: {e}") from None
    return m, c2
