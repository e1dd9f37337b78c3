#!/usr/bin/env python
"""Export a checkpoint to ONNX and/or TorchScript, with its metadata, checked against the checkpoint.

    python export.py --weights runs/train/exp/weights/best.pt --include onnx torchscript
    python export.py --weights best.pt --include onnx --dynamic --simplify
    python export.py --weights best.pt --include onnx --source my_images/   # parity-check images

Files go beside the checkpoint (best.onnx, best.torchscript). The graph is the fused eval-mode
model ending in the decoded (B, N, 4 + nc) output, float RGB input in [0, 1]; NMS is the
caller's (detect.py and val.py accept these files). An end-to-end (NMS-free) model's graph ends
in its final (B, max_det, 6) detections instead (--no-end2end exports its NMS branch). Each file
is run on real images (--source, else the checkpoint's val split) against the checkpoint; the
largest box and score differences and whether the detections agree are reported, and a file
beyond tolerance (utils/infer/parity.py) is deleted and the command exits 1. ONNX needs the
optional packages of requirements-export.txt (onnx, onnxruntime; onnxslim for --simplify).
"""
from __future__ import annotations

import argparse
import sys

import torch

from yolotrain.models.yolo import round_to_stride
from yolotrain.utils.core import dist
from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range, add_device_flags, tool_command
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import UserError, run_entry_point
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.core.prologue import RunPrologue
from yolotrain.utils.infer.backends import TorchBackend, require
from yolotrain.utils.infer.export import FORMATS, ExportOptions, ExportResult, export_all, parity_images


def build_parser() -> argparse.ArgumentParser:
    """YOLOv5 export.py's flags for the two formats; numbers are range-checked at parse time."""
    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--weights", required=True, help="checkpoint to export: yolotrain, YOLOv5 or Ultralytics .pt")
    p.add_argument("--include", nargs="+", choices=list(FORMATS), default=["torchscript"],
                   help="formats to write (onnx needs onnx and onnxruntime: pip install -r requirements-export.txt)")
    p.add_argument("--imgsz", "--img", "--img-size", type=IMGSZ, default=None,
                   help="square input side (default: the training size), rounded up to the stride")
    p.add_argument("--batch-size", type=Range(int, min=1), default=1, help="fixed batch of the exported input")
    p.add_argument("--dynamic", action="store_true", help="any batch and any stride-multiple input size")
    p.add_argument("--half", action="store_true", help="FP16 weights and input (needs a CUDA --device)")
    p.add_argument("--opset", type=Range(int, min=11, max=23), default=17, help="ONNX opset version")
    p.add_argument("--simplify", action="store_true", help="simplify the ONNX graph with onnxslim (or onnxsim)")
    p.add_argument("--end2end", action=argparse.BooleanOptionalAction, default=None,
                   help="end-to-end (NMS-free) graph with final detections, or not (default: the model's own mode)")
    p.add_argument("--max-det", type=Range(int, min=1), default=None,
                   help="detections per image of an end-to-end graph (default: its head's, 300)")
    p.add_argument("--source", nargs="+", default=None,
                   help="images for the parity check (default: the val split of the data the checkpoint was trained "
                        "on; YOLOv5 and Ultralytics files name none, so give them images)")
    add_device_flags(p, default="cpu", distributed=False)
    return p


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_opt(opt: argparse.Namespace, info: dist.DistInfo) -> list[str]:
    """The formats to write, in order, once each; refuses what cannot work before anything is loaded."""
    if info.world_size > 1:
        raise UserError(f"export runs as one process ({tool_command('export')} ...), not under torchrun")
    formats = list(dict.fromkeys(opt.include))
    if "onnx" in formats:
        require("onnx", "exporting to ONNX")
        require("onnxruntime", "checking the ONNX export")
    return formats


def main(opt: argparse.Namespace, callbacks: Callbacks | None = None) -> list[ExportResult]:
    """Write and check each --include format; ``callbacks`` hear on_export_end as each file is kept."""
    with RunPrologue(threads=opt.threads) as run:  # logging and threads; one process, its device chosen here
        formats = check_opt(opt, run.info)
        device = dist.select_device(opt.device, info=run.info)
        return export(opt, formats, device, callbacks)


def export(opt: argparse.Namespace, formats: list[str], device: torch.device,
           callbacks: Callbacks | None) -> list[ExportResult]:
    """The checkpoint -> the parity images -> each format written beside it, checked, and announced."""
    if opt.half and device.type != "cuda":
        raise UserError("--half exports FP16 for CUDA and needs a CUDA --device (e.g. --device 0)")
    reference = TorchBackend.from_checkpoint(opt.weights, device)
    reference.configure(opt.end2end, opt.max_det)
    if opt.max_det is not None and not reference.end2end:
        raise UserError(f"{opt.weights}: --max-det sets an end-to-end graph's detections per image; this model's "
                        "graph ends before NMS (pass --max-det to detect.py or val.py instead)")
    imgsz = round_to_stride(opt.imgsz or reference.meta.imgsz, reference.meta.stride)
    options = ExportOptions(imgsz=imgsz, batch=opt.batch_size, dynamic=opt.dynamic, half=opt.half, opset=opt.opset,
                            simplify=opt.simplify)
    images = parity_images(opt.source, reference.meta.data, opt.batch_size)
    results = export_all(reference, formats, options, device, images, callbacks)
    files = " ".join(str(r.path) for r in results)
    LOGGER.info(f"Export complete: {files}\n"
                f"Detect:   {tool_command('detect')} --weights {results[0].path} --source IMAGES_OR_VIDEOS\n"
                f"Validate: {tool_command('val')} --weights {results[0].path}")
    return results


def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))


if __name__ == "__main__":
    sys.exit(cli())
