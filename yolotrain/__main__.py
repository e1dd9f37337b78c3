"""``python -m yolotrain <tool> [flags]``: every tool from one entry point, the same as its script.

    python -m yolotrain train --data my.yaml          # = python train.py --data my.yaml
    python -m yolotrain weights yolov5s.pt            # YOLOv5/Ultralytics .pt -> yolotrain .pt
    python -m yolotrain coco --data my.yaml --out gt.json
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from yolotrain.app import coco, convert, detect, export, shards, train, tune, val, weights

TOOLS: dict[str, tuple[Callable[[list[str] | None], int], str]] = {
    "train": (train.cli, "train a detector (train.py)"),
    "val": (val.cli, "score checkpoints or exports on a split (val.py)"),
    "detect": (detect.cli, "run a detector on images and videos (detect.py)"),
    "export": (export.cli, "export a checkpoint to ONNX / TorchScript (export.py)"),
    "tune": (tune.cli, "search hyperparameters with Optuna (tune.py)"),
    "convert": (convert.cli, "COCO or Pascal VOC annotations to a YOLO dataset"),
    "weights": (weights.cli, "a YOLOv5 or Ultralytics checkpoint to a yolotrain one"),
    "coco": (coco.cli, "a split's ground truth as COCO json"),
    "shards": (shards.cli, "a dataset as tar shards with an index, to train from"),
}


def usage() -> str:
    lines = ["usage: python -m yolotrain <tool> [flags]   (python -m yolotrain <tool> --help for its flags)", "",
             "tools:"]
    return "\n".join(lines + [f"  {name:<9} {text}" for name, (_, text) in TOOLS.items()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    tool, rest = argv[0], argv[1:]
    if tool not in TOOLS:
        print(f"{usage()}\n\npython -m yolotrain: unknown tool '{tool}'", file=sys.stderr)
        return 2
    sys.argv = [f"python -m yolotrain {tool}", *rest]  # argparse's prog, in --help and errors
    code = TOOLS[tool][0](rest)
    return 0 if code is None else code  # torch's @record returns None for argparse's --help exit


if __name__ == "__main__":
    sys.exit(main())
