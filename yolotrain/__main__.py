"""``python -m yolotrain <tool> [flags]`` (``yolotrain <tool>`` installed): every tool from one entry point, the same
as its script.

    python -m yolotrain train --data my.yaml          # = python train.py --data my.yaml
    python -m yolotrain weights yolov5s.pt            # YOLOv5/Ultralytics .pt -> yolotrain .pt
    python -m yolotrain coco --data my.yaml --out gt.json
"""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

# tool -> what it does; each is the module yolotrain.app.<tool>, imported only when it runs
TOOLS: dict[str, str] = {
    "train": "train a detector (train.py)",
    "val": "score checkpoints or exports on a split (val.py)",
    "detect": "run a detector on images and videos (detect.py)",
    "export": "export a checkpoint to ONNX / TorchScript (export.py)",
    "tune": "search hyperparameters with Optuna (tune.py)",
    "convert": "COCO or Pascal VOC annotations to a YOLO dataset",
    "weights": "a YOLOv5 or Ultralytics checkpoint to a yolotrain one",
    "coco": "a split's ground truth as COCO json",
    "shards": "a dataset as tar shards with an index, to train from",
}


def tool_cli(tool: str) -> Callable[[list[str] | None], int]:
    """The ``cli`` of ``tool``: its module is imported here, so one tool's run imports no other tool."""
    return importlib.import_module(f"yolotrain.app.{tool}").cli


def command() -> str:
    """How the user started this: the installed ``yolotrain`` console command or ``python -m yolotrain``."""
    return "yolotrain" if os.path.basename(sys.argv[0]) == "yolotrain" else "python -m yolotrain"


def usage() -> str:
    me = command()
    lines = [f"usage: {me} <tool> [flags]   ({me} <tool> --help for its flags)", "", "tools:"]
    return "\n".join(lines + [f"  {name:<9} {text}" for name, text in TOOLS.items()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    tool, rest = argv[0], argv[1:]
    if tool not in TOOLS:
        print(f"{usage()}\n\n{command()}: unknown tool '{tool}'", file=sys.stderr)
        return 2
    sys.argv = [f"{command()} {tool}", *rest]  # argparse's prog, in --help and errors
    code = tool_cli(tool)(rest)
    return 0 if code is None else code  # torch's @record returns None for argparse's --help exit


if __name__ == "__main__":
    sys.exit(main())
