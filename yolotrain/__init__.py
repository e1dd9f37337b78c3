"""yolotrain from Python: ``from yolotrain import YOLO`` (docs/python.md).

    model = YOLO("yolov8n.yaml")
    run = model.train(data="data/shapes.yaml", epochs=3)    # TrainResult: save_dir, best, last, metrics
    model.val()                                              # ValResult: map50, map, per_class, speed_ms
    for r in model.predict("photos/"):                       # Results per image or frame
        print(r.boxes.xyxy, r.boxes.conf, r.boxes.cls)
    model.export("onnx")                                     # the checked file's path

Importing this package has no side effects: the engine loads when a YOLO is made.
"""
from __future__ import annotations

from typing import Any

from utils.core.callbacks import CallbackError
from utils.core.errors import Preempted, UserError

__all__ = ["YOLO", "Results", "ValResult", "TrainResult", "UserError", "CallbackError", "Preempted", "convert_coco",
           "convert_voc"]


def __getattr__(name: str) -> Any:
    """The API's names, imported when first used (the engine pulls in torch, the converters do not)."""
    if name == "YOLO":
        from yolotrain.model import YOLO
        return YOLO
    if name in ("Results", "ValResult"):
        from yolotrain import results
        return getattr(results, name)
    if name == "TrainResult":
        from utils.engine.state import TrainResult
        return TrainResult
    if name in ("convert_coco", "convert_voc"):
        from utils.data import convert
        return getattr(convert, name)
    raise AttributeError(f"module 'yolotrain' has no attribute '{name}'")
