"""yolotrain from Python: ``from yolotrain import YOLO`` (docs/python.md).

    model = YOLO("yolov8n.yaml")
    run = model.train(data="data/shapes.yaml", epochs=3)    # TrainResult: save_dir, best, last, metrics
    model.val()                                              # ValResult: map50, map, per_class, speed_ms
    for r in model.predict("photos/"):                       # Results per image or frame
        print(r.boxes.xyxy, r.boxes.conf, r.boxes.cls)
    model.export("onnx")                                     # the checked file's path
    yolotrain.convert_coco("instances_val2017.json", "datasets/coco-yolo")

The names below are imported on first use (PEP 562), so a process that runs one tool (``python val.py``,
``python -m yolotrain detect``) imports that tool alone, not every tool and the optional packages behind them.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yolotrain.utils.core.callbacks import CallbackError
    from yolotrain.utils.core.errors import Preempted, UserError
    from yolotrain.utils.data.convert import convert_coco, convert_voc
    from yolotrain.utils.engine.state import TrainResult
    from yolotrain.utils.infer.results import Results
    from yolotrain.model import YOLO
    from yolotrain.results import ValResult

_HOMES = {
    "YOLO": "yolotrain.model",
    "Results": "yolotrain.utils.infer.results",
    "ValResult": "yolotrain.results",
    "TrainResult": "yolotrain.utils.engine.state",
    "UserError": "yolotrain.utils.core.errors",
    "CallbackError": "yolotrain.utils.core.callbacks",
    "Preempted": "yolotrain.utils.core.errors",
    "convert_coco": "yolotrain.utils.data.convert",
    "convert_voc": "yolotrain.utils.data.convert",
}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'yolotrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # found once; later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
