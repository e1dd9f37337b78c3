"""yolotrain from Python: ``from yolotrain import YOLO`` (docs/python.md).

    model = YOLO("yolov8n.yaml")
    run = model.train(data="data/shapes.yaml", epochs=3)    # TrainResult: save_dir, best, last, metrics
    model.val()                                              # ValResult: map50, map, per_class, speed_ms
    for r in model.predict("photos/"):                       # Results per image or frame
        print(r.boxes.xyxy, r.boxes.conf, r.boxes.cls)
    model.export("onnx")                                     # the checked file's path
    yolotrain.convert_coco("instances_val2017.json", "datasets/coco-yolo")
"""
from __future__ import annotations

from utils.core.callbacks import CallbackError
from utils.core.errors import Preempted, UserError
from utils.data.convert import convert_coco, convert_voc
from utils.engine.state import TrainResult
from utils.infer.results import Results
from yolotrain.model import YOLO
from yolotrain.results import ValResult

__all__ = ["YOLO", "Results", "ValResult", "TrainResult", "UserError", "CallbackError", "Preempted", "convert_coco",
           "convert_voc"]
