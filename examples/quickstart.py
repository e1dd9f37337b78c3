#!/usr/bin/env python
"""The Python API top to bottom: build, train (one process, then two), validate, predict and export.

    python examples/quickstart.py                   # the built-in shapes dataset, a few minutes on a CPU
    python examples/quickstart.py --data my.yaml --epochs 30 --imgsz 640 --device 0,1

Each step is one call; docs/python.md describes every method, option and callback.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the API is imported from the checkout, wherever this script runs from

from yolotrain.utils.data.config import load_data_config  # noqa: E402
from yolotrain import YOLO  # noqa: E402


def main(args: argparse.Namespace) -> None:
    common = dict(data=args.data, epochs=args.epochs, imgsz=args.imgsz, batch=args.batch, workers=args.workers,
                  project=args.project, exist_ok=True)

    # 1. build a model from its yaml, and listen to the run's epochs
    model = YOLO("yolov8n.yaml")
    model.add_callback("on_fit_epoch_end",
                       lambda e: print(f"[callback] epoch {e.epoch + 1}/{e.epochs}: "
                                       f"mAP50-95 {e.metrics.get('map', 0):.4f}"))

    # 2. train in this process; the model then holds best.pt
    run = model.train(name="one-process", device=args.device, **common)
    print(f"trained: {run.best} (mAP50-95 {run.metrics.get('map', 0):.4f}, {run.epochs} epochs, {run.stop})")

    # 3. the same run data-parallel: two ranks through torch's elastic launcher (gloo on CPU, NCCL on GPUs)
    ranks = dict(device=args.device) if "," in args.device else dict(nproc=2)
    two = YOLO("yolov8n.yaml").train(name="two-processes", **ranks, **common)
    print(f"trained on 2 ranks: {two.best}")

    # 4. validate best.pt on the val split
    scores = model.val(data=args.data, imgsz=args.imgsz, project=args.project, name="val", exist_ok=True)
    print(f"val: mAP50 {scores.map50:.4f} mAP50-95 {scores.map:.4f}, "
          f"{scores.speed_ms['inference']:.1f} ms inference per image")

    # 5. predict: a folder streams one Results per image (boxes, confidences, classes; plot(), save_txt(), to_json())
    images = args.images or load_data_config(args.data).val[0]
    boxes = 0
    for r in model.predict(images, conf=0.25, imgsz=args.imgsz):
        boxes += len(r.boxes)
    print(f"predict: {boxes} boxes in {images}")

    # 6. export to TorchScript (or onnx with requirements-export.txt); the file is checked against best.pt
    print(f"exported: {model.export(args.format, imgsz=args.imgsz)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"), help="dataset yaml")
    p.add_argument("--images", default=None, help="folder to predict on (default: the val split's)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="", help="'' (auto), cpu, 0, or 0,1 for two GPUs")
    p.add_argument("--format", default="torchscript", choices=("torchscript", "onnx"))
    p.add_argument("--project", default=str(ROOT / "runs" / "quickstart"))
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
