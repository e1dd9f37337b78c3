"""The names a model yaml may use and the class each builds, and which head a yaml's last row makes.

Kept apart from models/parse.py (which validates and builds rows) so both the yaml checks and the
layer builder ask one place. Nothing outside ``MODULES`` is reachable from a yaml.

Ultralytics' model files name every anchor-free head ``Detect`` and choose its kind with top-level
keys; ours name the anchor head ``Detect`` (YOLOv5) and the DFL head ``DFLDetect``. A yaml whose
top level says ``end2end: True`` (YOLO26, Ultralytics 8.4) builds the end-to-end head from a
``Detect`` (or ``DFLDetect`` / ``E2EDetect``) row, so Ultralytics' yolo26.yaml reads as it is;
``reg_max`` at the top level sizes that head's box branch (``DFLDetect``'s too when its row omits it).
YOLOv10's ``v10Detect`` row is always end-to-end (reg_max 16, depthwise class branch), as in Ultralytics.
"""
from __future__ import annotations

from torch import nn

from yolotrain.models.blocks import C2PSA, C3, SPPF, Bottleneck, C2f, C3k2, Concat, Conv, DWConv
from yolotrain.models.blocks_v10 import CIB, PSA, C2fCIB, SCDown
from yolotrain.models.heads.anchor import Detect
from yolotrain.models.heads.base import Head
from yolotrain.models.heads.dfl import DFLDetect
from yolotrain.models.heads.e2e import E2EDetect, V10Detect

MODULES: dict[str, type[nn.Module]] = {
    "Conv": Conv,
    "DWConv": DWConv,
    "Bottleneck": Bottleneck,
    "C3": C3,
    "C2f": C2f,
    "C3k2": C3k2,
    "C2PSA": C2PSA,
    "SPPF": SPPF,
    "SCDown": SCDown,
    "CIB": CIB,
    "C2fCIB": C2fCIB,
    "PSA": PSA,
    "Concat": Concat,
    "Detect": Detect,
    "DFLDetect": DFLDetect,
    "E2EDetect": E2EDetect,
    "v10Detect": V10Detect,
    "nn.Upsample": nn.Upsample,
}
CHANNEL_MODULES = (Conv, DWConv, Bottleneck, C3, C2f, C3k2, C2PSA, SPPF, SCDown, CIB, C2fCIB,
                   PSA)  # args start with output channels
REPEAT_INSIDE = (C3, C2f, C3k2, C2PSA, C2fCIB)  # take `number` as their own depth argument
E2E_ROW_NAMES = ("Detect", "DFLDetect", "E2EDetect")  # head rows an `end2end: True` yaml builds as E2EDetect


def row_class(name: str, d: dict) -> type[nn.Module] | None:
    """The class a row's module name builds in the yaml ``d`` (None for an unknown name)."""
    if d.get("end2end") is True and name in E2E_ROW_NAMES:
        return E2EDetect
    return MODULES.get(name)


def head_class(d: dict) -> type[Head] | None:
    """The head class the yaml's last row names, or None when that row is not a registered head."""
    rows = d.get("head")
    row = rows[-1] if isinstance(rows, list) and rows else None
    if not (isinstance(row, list) and len(row) == 4 and isinstance(row[2], str)):
        return None
    cls = row_class(row[2], d)
    return cls if isinstance(cls, type) and issubclass(cls, Head) else None


def head_has_anchors(d: dict) -> bool:
    """Whether the model needs anchors: yes unless its last row is a known anchor-free head."""
    cls = head_class(d)
    return cls is None or cls.has_anchors


def head_names() -> list[str]:
    """The registered head names, for error messages."""
    return [k for k, v in MODULES.items() if issubclass(v, Head)]


def head_args(cls: type[nn.Module], args: list, d: dict, rows: list) -> list:
    """A DFL / end-to-end head row's args completed from the top level: ``reg_max`` when the row
    omits it, and (end-to-end) the depthwise class branch exactly when the model has C3k2 rows,
    Ultralytics' rule for its ``Detect``. A row's own values win."""
    args = list(args)
    if cls is E2EDetect:
        if len(args) < 2:
            args = [*args[:1], d.get("reg_max", 16)]
        if len(args) < 3:
            args.append(any(isinstance(r, list) and len(r) == 4 and r[2] == "C3k2" for r in rows))
    elif cls is DFLDetect and len(args) < 2 and "reg_max" in d:
        args = [*args[:1], d["reg_max"]]
    return args
