#!/usr/bin/env python
"""Inference latency per image: the PyTorch checkpoint against its ONNX export in ONNX Runtime.

    python bench/infer_speed.py --weights runs/train/exp/weights/best.pt           # 320 and 640, batch 1
    python bench/infer_speed.py --weights best.pt --imgsz 320 640 --batch-size 8 --runs 50

The checkpoint is exported once, --dynamic, into a temporary folder (export.py's own writer, so
the graph is the one users ship), then both backends run the same random batch at each size:
``--warmup`` calls left out, then the median of ``--runs`` timed calls of the forward pass alone
(no pre-processing, no NMS), divided by the batch size. PyTorch runs as detect.py runs a
checkpoint on the device (BN folded; NHWC on CPU), ONNX Runtime with the same thread count
(``--threads``, default: torch's). Needs onnx and onnxruntime (requirements-export.txt).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.yolo import round_to_stride  # noqa: E402  (the repository is put on the path first)
from utils.core import dist  # noqa: E402
from utils.core.cli import IMGSZ, ArgumentParser, Range  # noqa: E402
from utils.infer.backends import OnnxBackend, TorchBackend, require  # noqa: E402
from utils.infer.export import DecodedOnly, ExportOptions, write_onnx  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--weights", required=True, help="yolotrain checkpoint")
    p.add_argument("--imgsz", nargs="+", type=IMGSZ, default=[320, 640], help="square input sides")
    p.add_argument("--batch-size", type=Range(int, min=1), default=1, help="images per call")
    p.add_argument("--warmup", type=Range(int, min=0), default=5, help="untimed calls first")
    p.add_argument("--runs", type=Range(int, min=1), default=30, help="timed calls (the median is reported)")
    p.add_argument("--threads", type=Range(int, min=0), default=0, help="CPU threads (0: torch's default)")
    return p


def median_ms(call, x: torch.Tensor, warmup: int, runs: int) -> float:
    """Median wall time of ``call(x)`` in ms over ``runs`` calls, after ``warmup`` untimed ones."""
    with torch.no_grad():
        for _ in range(warmup):
            call(x)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            call(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> list[tuple[int, float, float]]:
    opt = build_parser().parse_args(argv)
    require("onnx", "exporting to ONNX")
    if opt.threads:
        torch.set_num_threads(opt.threads)
    cpu = torch.device("cpu")
    reference = TorchBackend.from_checkpoint(opt.weights, cpu)
    graph = DecodedOnly(copy.deepcopy(reference.model)).eval()
    sizes = [round_to_stride(s, reference.meta.stride) for s in opt.imgsz]
    channels_last = dist.channels_last_default(None, cpu)
    reference.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        options = ExportOptions(imgsz=max(sizes), batch=opt.batch_size, dynamic=True)
        write_onnx(graph, torch.zeros(opt.batch_size, 3, max(sizes), max(sizes)), path,
                   replace(reference.meta, format="onnx", dynamic=True, imgsz=max(sizes)), options)
        session = OnnxBackend(path, cpu)
        for s in sizes:
            x = torch.rand(opt.batch_size, 3, s, s, generator=torch.Generator().manual_seed(0))
            xt = x.contiguous(memory_format=torch.channels_last) if channels_last else x
            pt = median_ms(reference, xt, opt.warmup, opt.runs) / opt.batch_size
            ort = median_ms(session, x, opt.warmup, opt.runs) / opt.batch_size
            rows.append((s, pt, ort))
    print(f"{opt.weights}: batch {opt.batch_size}, {torch.get_num_threads()} threads, median of {opt.runs} runs")
    print(f"{'imgsz':>6} {'PyTorch ms/img':>15} {'ONNX Runtime ms/img':>20} {'ratio':>7}")
    for s, pt, ort in rows:
        print(f"{s:>6} {pt:>15.1f} {ort:>20.1f} {pt / ort:>6.2f}x")
    return rows


if __name__ == "__main__":
    main()
