"""Writing a checkpoint as ONNX or TorchScript, with its metadata, checked against the checkpoint.

The exported graph is the checkpoint's model (EMA weights) in eval mode with BatchNorm folded,
returning only the decoded (B, N, 4 + nc) tensor: boxes as centre/size in input pixels and one
score per class, NMS left to the caller (the usual convention; detect.py and val.py run the
project's NMS on it). An end-to-end model's graph (its head's ``end2end``, as export.py's
--end2end/--no-end2end left it) returns its final detections (B, max_det, 6) instead: x1, y1,
x2, y2, score, class, no NMS, ``max_det`` being the head's (export.py --max-det). Its input is
float RGB in [0, 1], (B, 3, H, W). The file carries ``ModelMeta`` (class names, stride, image
size, family, end2end and max_det, fixed or dynamic shape, the yolotrain commit) as ONNX
metadata_props / a TorchScript extra file, which detect.py and val.py read back.

Every export is written under a temporary name beside its final one, read back through the same
backend detect.py uses, and compared with the checkpoint on real images (utils/infer/parity.py):
at the export's shape, and for ``--dynamic`` also at a second batch and a non-square size. Only
a file that passes is renamed to its final name; a failing one is deleted (nothing wrong is
left to ship by mistake) and the export stops with the differences.
"""
from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.augment import letterbox, resize_long_side
from yolotrain.utils.data.config import load_data_config, prepare_dataset
from yolotrain.utils.data.images import read_image_bgr
from yolotrain.utils.data.labels import resolve_image_files
from yolotrain.utils.data.sources import letterbox_image, resolve_sources
from yolotrain.utils.infer.backends import (FORMATS, META_FILE, META_KEY, Backend, ExportedBackend, ModelMeta, OnnxBackend,
                                  TorchBackend, TorchScriptBackend, require, yolotrain_version)
from yolotrain.utils.infer.parity import FP16, FP32, ParityReport, compare

# QUIET: tracing warns about Python values it keeps as constants (the strides) and about the
# deprecation of torch.jit and of the TorchScript-based ONNX exporter; none is the user's to act on.


@dataclass(frozen=True)
class ExportOptions:
    imgsz: int  # square input side, a stride multiple
    batch: int  # the fixed batch (and the parity batch)
    dynamic: bool = False  # any batch and stride-multiple size
    half: bool = False  # FP16 weights and inputs (CUDA)
    opset: int = 17
    simplify: bool = False  # run onnxslim (or onnxsim) on the ONNX graph when installed


@dataclass(frozen=True)
class ExportResult:
    format: str
    path: Path
    reports: list[ParityReport]


@dataclass(frozen=True)
class ExportEvent:
    """on_export_end: one format was written and matched the checkpoint (``reports``: its parity checks)."""

    event: str
    format: str
    path: Path
    reports: list[ParityReport]


def export_end(callbacks: Callbacks | None, result: ExportResult) -> None:
    """on_export_end for one written format, when anyone listens."""
    if callbacks is not None and callbacks.wants("on_export_end"):
        callbacks.run("on_export_end", ExportEvent("on_export_end", result.format, result.path, result.reports))


class DecodedOnly(nn.Module):
    """The graph that is exported: the eval-mode model's first output (decoded boxes and scores, or an
    end-to-end head's final detections), without the raw levels."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)[0]


def parity_batches(images: list[np.ndarray], opts: ExportOptions, stride: int) -> list[torch.Tensor]:
    """uint8 batches the export is checked on: ``batch`` images letterboxed (square, as detect.py does) to
    the export size; for a dynamic export also two of them in a non-square input of half the height."""
    square = [letterbox_image(img, opts.imgsz)[0] for img in images[: opts.batch]]
    while len(square) < opts.batch:  # fewer images than the batch: repeat them
        square.append(square[len(square) % len(images)])
    batches = [torch.stack(square)]
    if opts.dynamic:
        hw = (max(stride, (opts.imgsz // 2 + stride - 1) // stride * stride), opts.imgsz)
        batches.append(torch.stack([_letterbox_chw(img, hw) for img in (images * 2)[:2]]))
    return batches


def _letterbox_chw(img: np.ndarray, hw: tuple[int, int]) -> torch.Tensor:
    """A BGR image in an (h, w) input, the letterbox of ``letterbox_image`` with another shape."""
    boxed = letterbox(resize_long_side(img, max(hw), augment=False), hw, auto=False, scaleup=False)[0]
    return torch.from_numpy(boxed.transpose((2, 0, 1))[::-1].copy())


def parity_images(source: list[str] | None, data: str | None, n: int) -> list[np.ndarray]:
    """Up to ``n`` readable images (BGR) to check exports on: from ``source``, else the checkpoint's val split."""
    if source:
        files = resolve_sources(source).images
        where = ", ".join(source)
    else:
        if not data:
            raise UserError("the checkpoint names no dataset to take parity-check images from: pass --source")
        try:
            config = load_data_config(data)
            prepare_dataset(config)
            files = resolve_image_files(config.val)
        except UserError as e:
            raise UserError(f"{e} (the parity check reads the checkpoint's val images; pass --source instead)") from None
        where = f"{data} val split"
    images = []
    for f in files:
        try:
            images.append(read_image_bgr(f))
        except UserError as e:
            LOGGER.warning(f"WARNING: parity check: skipped {e}")
        if len(images) == n:
            break
    if not images:
        raise UserError(f"{where}: no readable image for the parity check")
    return images


def export_all(reference: TorchBackend, formats: list[str], opts: ExportOptions, device: torch.device,
               images: list[np.ndarray], callbacks: Callbacks | None = None) -> list[ExportResult]:
    """Export the checkpoint behind ``reference`` to each format beside it, each checked on ``images`` (BGR);
    ``callbacks`` hear on_export_end as each format is kept.

    ``reference`` must not have run yet: the exported graph is copied from it first, so the heads'
    grid caches are empty when traced.
    """
    check_half_onnx(formats, opts)
    weights = Path(reference.meta.source)
    graph = DecodedOnly(copy.deepcopy(reference.model)).eval()
    if opts.half:
        graph.half()
        reference.half()
    meta = replace(reference.meta, imgsz=opts.imgsz, dynamic=opts.dynamic, batch=None if opts.dynamic else opts.batch,
                   half=opts.half, version=yolotrain_version())
    batches = [b.to(device) for b in parity_batches(images, opts, meta.stride)]
    example = torch.zeros(opts.batch, 3, opts.imgsz, opts.imgsz, device=device,
                          dtype=torch.float16 if opts.half else torch.float32)
    results = []
    for fmt in formats:
        results.append(export_one(fmt, weights, graph, example, meta, opts, reference, batches, device))
        export_end(callbacks, results[-1])
    return results


def check_half_onnx(formats: list[str], opts: ExportOptions) -> None:
    """--half ONNX must be checked on CUDA: without onnxruntime's CUDA provider the FP16 graph would be run
    and judged on the CPU instead, a silent fallback that checks another path than the one shipped."""
    if not (opts.half and "onnx" in formats):
        return
    ort = require("onnxruntime", "checking the ONNX export")
    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        raise UserError(f"--half --include onnx: onnxruntime {getattr(ort, '__version__', '')} has no CUDA provider "
                        f"here (only {', '.join(providers)}), so the FP16 export cannot be checked on the GPU; "
                        "pip install onnxruntime-gpu, or export ONNX without --half")


def export_one(fmt: str, weights: Path, graph: nn.Module, example: torch.Tensor, meta: ModelMeta,
               opts: ExportOptions, reference: Backend, batches: list[torch.Tensor],
               device: torch.device) -> ExportResult:
    """Write one format under a temporary name, check it, and rename it, or delete it and raise UserError."""
    final = weights.with_suffix(FORMATS[fmt])
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    meta = replace(meta, format=fmt)
    try:
        LOGGER.info(f"{fmt}: exporting {weights} -> {final} ({meta.input_rule()})")
        if fmt == "onnx":
            write_onnx(graph, example, tmp, meta, opts)
            exported: ExportedBackend = OnnxBackend(tmp, device)
        else:
            write_torchscript(graph, example, tmp, meta)
            exported = TorchScriptBackend(tmp, device)
        reports = [compare(exported, reference, b, FP16 if opts.half else FP32) for b in batches]
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for r in reports:
        LOGGER.info(f"{fmt} parity: {r}")
    failed = [r for r in reports if not r.passed]
    if failed:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{final}: the exported model does not match {weights} ({failed[0]}); the file was "
                        "not kept")
    os.replace(tmp, final)
    LOGGER.info(f"{fmt}: {final} ({final.stat().st_size / 2**20:.1f} MB) matches the checkpoint")
    return ExportResult(fmt, final, reports)


def write_onnx(graph: nn.Module, example: torch.Tensor, path: Path, meta: ModelMeta, opts: ExportOptions) -> None:
    """torch.onnx's TorchScript-based exporter (needs no onnxscript), then metadata and optional simplification."""
    onnx = require("onnx", "exporting to ONNX")
    require("onnxruntime", "checking the ONNX export")
    # an end-to-end graph's rows are its max_det at any size; a decoded one has a row per anchor point
    rows = {} if meta.end2end else {1: "anchors"}
    dynamic_axes = {"images": {0: "batch", 2: "height", 3: "width"}, "output0": {0: "batch", **rows}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # see QUIET
        torch.onnx.export(graph, (example,), str(path), dynamo=False, opset_version=opts.opset,
                          input_names=["images"], output_names=["output0"], do_constant_folding=True,
                          dynamic_axes=dynamic_axes if opts.dynamic else None)
    model = onnx.load(str(path))
    if opts.simplify:
        model = simplify_onnx(model)
    onnx.checker.check_model(model)
    entry = model.metadata_props.add()
    entry.key, entry.value = META_KEY, meta.to_json()
    onnx.save(model, str(path))


def simplify_onnx(model: Any) -> Any:
    """onnxslim, else onnxsim, when installed (both optional); the parity check then covers the result."""
    try:
        import onnxslim
        return onnxslim.slim(model)
    except ImportError:
        pass
    try:
        import onnxsim
        simplified, ok = onnxsim.simplify(model)
        return simplified if ok else model
    except ImportError:
        LOGGER.warning("WARNING: --simplify needs onnxslim (pip install onnxslim) or onnxsim; exported unsimplified")
        return model


def write_torchscript(graph: nn.Module, example: torch.Tensor, path: Path, meta: ModelMeta) -> None:
    """torch.jit.trace of the decoded graph, with the metadata as an extra file in the archive."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # see QUIET
        traced = torch.jit.trace(graph, example, strict=False)
        torch.jit.save(traced, str(path), _extra_files={META_FILE: meta.to_json()})
