#!/usr/bin/env python
"""Inference latency per image: checkpoints against each other and against their ONNX exports in ONNX Runtime.

    python bench/infer_speed.py --weights runs/train/exp/weights/best.pt           # 320 and 640, batch 1
    python bench/infer_speed.py --weights best.pt --imgsz 320 640 --batch-size 8 --runs 50
    python bench/infer_speed.py --weights yolo26n.pt yolov8n.pt --end-to-end       # NMS-free head vs NMS

Each checkpoint is exported once, --dynamic, into a temporary folder (export.py's own writer, so
the graph is the one users ship; an end-to-end head's graph outputs its (B, max_det, 6)
detections), then both backends run at each size. Every figure is ``--warmup`` untimed calls,
then the median of ``--runs`` calls timed with time.perf_counter, divided by the batch size. The
cells (model, backend, size) take turns, ``--rounds`` blocks of runs / rounds calls each, so a
slow spell of a shared machine costs every cell alike and the ratios stay fair.

- forward ms: the forward pass alone on a random float batch (no pre-processing, no NMS), as
  before. PyTorch runs as detect.py runs a checkpoint (BN folded; NHWC on CPU), ONNX Runtime
  with the same thread count (``--threads``, default: torch's).
- end-to-end ms (``--end-to-end``): what detect.py spends per image once the image is decoded,
  through its own pieces: ``letterbox_image`` of a decoded BGR image (``--source IMAGE``, read
  by detect.py's decoder, else a seeded synthetic 480x640 one), the batch stacked as detect.py's
  loader does, then ``Predictor``: to the device, float / 255 and layout, forward,
  ``postprocess`` (NMS for a normal head; an end-to-end head's own detections selected by score,
  no NMS: ``backend.end2end``) and ``unletterbox``. Thresholds are detect.py's defaults (conf
  0.25, IoU 0.45, max_det 1000); an end-to-end head keeps its own top-k (max_det 300, what
  export.py writes by default), so PyTorch and ONNX Runtime run the same head. Decoding the file
  and writing results are left out: they depend on the file and the flags, not on the model.
  This is the figure that shows what NMS costs a normal head against an end-to-end one.

The table gives, per model, backend and size: forward and end-to-end ms per image, how many
detections the image gave, each model's end-to-end time (forward time without --end-to-end)
over the first --weights' (so ``--weights yolo26n.pt yolov8n.pt`` prints yolo26n/yolov8n), and
PyTorch's forward time over this backend's. The first line names the CPU it ran on (model name
from /proc/cpuinfo), torch's thread count and whether the CPU has native bf16
(``precision.cpu_has_native_bf16``), since CPU latencies mean little without them. Needs onnx and
onnxruntime (requirements-export.txt).
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from yolotrain.models.yolo import round_to_stride  # noqa: E402  (the repository is put on the path first)
from yolotrain.utils.core import precision  # noqa: E402
from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range  # noqa: E402
from yolotrain.utils.data.images import read_image_bgr  # noqa: E402
from yolotrain.utils.data.sources import letterbox_image  # noqa: E402
from yolotrain.utils.infer.backends import Backend, OnnxBackend, TorchBackend, require  # noqa: E402
from yolotrain.utils.infer.export import DecodedOnly, ExportOptions, write_onnx  # noqa: E402
from yolotrain.utils.infer.predict import PredictOptions, Predictor  # noqa: E402

SYNTHETIC_HW = (480, 640)  # a typical photo's size (VGA, landscape)


@dataclass(frozen=True)
class Row:
    """One model, backend and size: ms per image, and the detections the test image gave (end-to-end only)."""

    model: str
    backend: str
    imgsz: int
    head: str  # "NMS" or "e2e" (the head's own detections)
    forward_ms: float
    e2e_ms: float | None = None
    dets: int | None = None


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--weights", nargs="+", required=True,
                   help="yolotrain checkpoints; ratios are to the first one")
    p.add_argument("--imgsz", nargs="+", type=IMGSZ, default=[320, 640], help="square input sides")
    p.add_argument("--batch-size", type=Range(int, min=1), default=1, help="images per call")
    p.add_argument("--warmup", type=Range(int, min=0), default=5, help="untimed calls first")
    p.add_argument("--runs", type=Range(int, min=1), default=30, help="timed calls (the median is reported)")
    p.add_argument("--rounds", type=Range(int, min=1), default=10,
                   help="the cells (model, backend, size) take turns this many times, runs / rounds calls each")
    p.add_argument("--threads", type=Range(int, min=0), default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--end-to-end", action="store_true",
                   help="also time detect.py's steps per image: letterbox, pre-process, forward, NMS, unletterbox")
    p.add_argument("--source", default=None,
                   help=f"image for --end-to-end (default: a seeded synthetic {SYNTHETIC_HW[0]}x{SYNTHETIC_HW[1]} one)")
    return p


def cpu_summary() -> str:
    """The CPU's model name (/proc/cpuinfo), torch's thread count and whether bf16 is native on it."""
    name = platform.processor() or platform.machine() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:  # not Linux
        pass
    bf16 = "yes" if precision.cpu_has_native_bf16() else "no"
    return f"CPU: {name}; {torch.get_num_threads()} torch threads; native bf16: {bf16}"


def test_image(source: str | None) -> np.ndarray:
    """The decoded BGR uint8 image the end-to-end figure letterboxes: ``source`` read by detect.py's
    decoder, else a fixed synthetic one (seed 0), so every run times the same pixels."""
    if source:
        return read_image_bgr(source)
    return np.random.default_rng(0).integers(0, 256, (*SYNTHETIC_HW, 3), dtype=np.uint8)


def unique_labels(paths: list[str]) -> list[str]:
    """Short names for the table: each file's stem, with as many parent folders as it takes to tell two
    apart (``y26/weights/best`` and ``v8/weights/best``, not ``best`` twice)."""
    parts = [Path(p).with_suffix("").parts for p in paths]
    for k in range(1, max(len(q) for q in parts) + 1):
        labels = ["/".join(q[-k:]) for q in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{i}:{p}" for i, p in enumerate(paths)]  # the same file named twice


def interleaved_ms(calls: list[Callable[[], object]], warmup: int, runs: int, rounds: int) -> list[float]:
    """Each call's median wall time in ms over ``runs`` timed calls, after ``warmup`` untimed ones. The calls
    take turns, ``rounds`` blocks of runs / rounds calls each, so a slow spell of a shared machine falls on
    every call alike instead of on whichever one was being timed then: the ratios between them stay fair."""
    times: list[list[float]] = [[] for _ in calls]
    block = max(runs // rounds, 1)
    with torch.no_grad():
        for call in calls:
            for _ in range(warmup):
                call()
        while len(times[0]) < runs:
            for call, spent in zip(calls, times):
                call()  # one untimed call after the switch: caches hold the other model's weights
                for _ in range(min(block, runs - len(spent))):
                    t0 = time.perf_counter()
                    call()
                    spent.append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def export_onnx(reference: TorchBackend, size: int, batch: int, path: Path) -> OnnxBackend:
    """The checkpoint written by export.py's writer (--dynamic, ``size`` as its nominal size) and opened as
    detect.py opens an .onnx file; an end-to-end head's graph ends in its own detections (meta.end2end)."""
    graph = DecodedOnly(copy.deepcopy(reference.model)).eval()
    meta = replace(reference.meta, format="onnx", dynamic=True, imgsz=size)
    options = ExportOptions(imgsz=size, batch=batch, dynamic=True)
    write_onnx(graph, torch.zeros(batch, 3, size, size), path, meta, options)
    return OnnxBackend(path, torch.device("cpu"))


def predictor_for(backend: Backend) -> Predictor:
    """detect.py's Predictor for ``backend`` on the CPU at detect.py's defaults (fp32; NHWC for a checkpoint)."""
    cpu = torch.device("cpu")
    channels_last = backend.meta.format == "pytorch" and precision.channels_last_default(None, cpu)
    return Predictor(backend, cpu, replace(PredictOptions(), channels_last=channels_last))


def end_to_end_call(predictor: Predictor, img: np.ndarray, size: int, batch: int) -> Callable[[], list[np.ndarray]]:
    """One detect.py batch from a decoded image: letterboxed per image and stacked as its loader does
    (LetterboxedImages, collate_items), then the Predictor (pre-process, forward, postprocess, unletterbox)."""
    def call() -> list[np.ndarray]:
        boxed = [letterbox_image(img, size) for _ in range(batch)]
        images = torch.stack([b[0] for b in boxed])
        return predictor(images, [b[1] for b in boxed])
    return call


@dataclass(frozen=True)
class Cell:
    """One model, backend and size to time: its forward pass on a random batch and, with an image, detect.py's steps."""

    model: str
    backend: str
    imgsz: int
    head: str  # "NMS" or "e2e"
    forward: Callable[[], object]
    end_to_end: Callable[[], list[np.ndarray]] | None


def cells_for(label: str, weights: str, opt: argparse.Namespace, img: np.ndarray | None, folder: Path) -> list[Cell]:
    """Cells for one checkpoint: PyTorch and its ONNX export at every size (rounded to its stride)."""
    reference = TorchBackend.from_checkpoint(weights, torch.device("cpu"))
    sizes = [round_to_stride(s, reference.meta.stride) for s in opt.imgsz]
    session = export_onnx(reference, max(sizes), opt.batch_size, folder / f"{len(list(folder.iterdir()))}.onnx")
    cells = []
    for size in sizes:
        for name, predictor in {"PyTorch": predictor_for(reference), "ONNX Runtime": predictor_for(session)}.items():
            x = torch.rand(opt.batch_size, 3, size, size, generator=torch.Generator().manual_seed(0))
            x = x.contiguous(memory_format=predictor.memory_format)
            call = None if img is None else end_to_end_call(predictor, img, size, opt.batch_size)
            cells.append(Cell(label, name, size, "e2e" if predictor.backend.end2end else "NMS",
                              partial(predictor.backend, x), call))
    return cells


def time_cells(cells: list[Cell], opt: argparse.Namespace) -> list[Row]:
    """Every cell's forward (then end-to-end) time, the cells taking turns (interleaved_ms)."""
    forward = interleaved_ms([c.forward for c in cells], opt.warmup, opt.runs, opt.rounds)
    if cells[0].end_to_end is None:
        return [Row(c.model, c.backend, c.imgsz, c.head, f / opt.batch_size) for c, f in zip(cells, forward)]
    e2e = interleaved_ms([c.end_to_end for c in cells], opt.warmup, opt.runs, opt.rounds)
    return [Row(c.model, c.backend, c.imgsz, c.head, f / opt.batch_size, e / opt.batch_size, len(c.end_to_end()[0]))
            for c, f, e in zip(cells, forward, e2e)]


def print_table(rows: list[Row], first: str, end_to_end: bool) -> None:
    """The table: ms per image, detections, the ratio to the first model (end-to-end time when measured,
    else forward) at the same backend and size, and PyTorch's forward time over this backend's."""
    key = (lambda r: r.e2e_ms) if end_to_end else (lambda r: r.forward_ms)
    base = {(r.backend, r.imgsz): key(r) for r in rows if r.model == first}
    pytorch = {(r.model, r.imgsz): r.forward_ms for r in rows if r.backend == "PyTorch"}
    width = max(len("model"), *(len(r.model) for r in rows))
    ratio = f"{'e2e' if end_to_end else 'fwd'} / {first}"
    print(f"{'model':<{width}} {'backend':<12} {'head':<4} {'imgsz':>5} {'forward ms':>10} {'end-to-end ms':>13} "
          f"{'dets':>5} {ratio:>{max(len(ratio), 8)}} {'PyTorch/this fwd':>16}")
    for r in rows:
        e2e = f"{r.e2e_ms:>13.2f}" if r.e2e_ms is not None else f"{'-':>13}"
        dets = f"{r.dets:>5}" if r.dets is not None else f"{'-':>5}"
        b = base.get((r.backend, r.imgsz))
        rel = f"{key(r) / b:.2f}x" if b else "-"
        speed = f"{pytorch[(r.model, r.imgsz)] / r.forward_ms:.2f}x"
        print(f"{r.model:<{width}} {r.backend:<12} {r.head:<4} {r.imgsz:>5} {r.forward_ms:>10.2f} {e2e} {dets} "
              f"{rel:>{max(len(ratio), 8)}} {speed:>16}")


def main(argv: list[str] | None = None) -> list[Row]:
    opt = build_parser().parse_args(argv)
    require("onnx", "exporting to ONNX")
    if opt.threads:
        torch.set_num_threads(opt.threads)
    img = test_image(opt.source) if opt.end_to_end else None
    labels = unique_labels(opt.weights)
    with tempfile.TemporaryDirectory() as tmp:
        cells = [c for label, weights in zip(labels, opt.weights) for c in cells_for(label, weights, opt, img, Path(tmp))]
        rows = time_cells(cells, opt)
    print(cpu_summary())
    image = "" if img is None else \
        f"; image {img.shape[0]}x{img.shape[1]} ({opt.source or 'synthetic, seed 0'}), conf 0.25, IoU 0.45"
    print(f"batch {opt.batch_size}, median of {opt.runs} runs after {opt.warmup} warmup, in {opt.rounds} interleaved "
          f"rounds, ms per image{image}")
    print_table(rows, labels[0], opt.end_to_end)
    return rows


if __name__ == "__main__":
    main()
