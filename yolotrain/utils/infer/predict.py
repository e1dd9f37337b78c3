"""Letterboxed images -> detections in original-image pixels: the inference half of detect.py.

The steps are val.py's (utils/eval/evaluate.py): the uint8 batch to the device, float / 255 in the
model's layout, the backend's output, ``postprocess`` per image (NMS of the decoded (B, N, 4 + nc)
form, or an end-to-end model's own detections filtered by score and class), ``unletterbox`` per
image. So at the same thresholds an image gets the boxes val.py gets for it (with
``multi_label``, val's setting, and ``val.py --no-rect``'s square input), and no image's boxes
depend on the other images of its batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from yolotrain.utils.core.boxes import postprocess
from yolotrain.utils.data.geometry import Placement, unletterbox
from yolotrain.utils.infer.backends import Backend, TorchBackend


@dataclass(frozen=True)
class PredictOptions:
    """NMS settings (YOLOv5 detect.py's defaults; an end-to-end model uses conf, classes and max_det only)
    and the numerics of the forward pass."""

    conf_thres: float = 0.25
    iou_thres: float = 0.45
    max_det: int = 1000
    classes: tuple[int, ...] | None = None  # keep only these class ids
    agnostic: bool = False  # one NMS over all classes
    multi_label: bool = False  # a box may carry several classes (val.py's mAP setting)
    half: bool = False  # checkpoints: FP16 on CUDA, bf16 autocast on CPU (an export's precision is its own)
    channels_last: bool = False


class Predictor:
    """Runs a backend on letterboxed uint8 batches and keeps the time spent per stage.

    ``times`` holds seconds spent in pre-processing (to device, float, layout), inference and NMS
    (or an end-to-end model's selection; with unletterboxing) over ``images`` images.
    """

    def __init__(self, backend: Backend, device: torch.device, opts: PredictOptions = PredictOptions()) -> None:
        self.device, self.opts = device, opts
        self.half = opts.half and device.type == "cuda"
        self.bf16 = opts.half and device.type == "cpu" and isinstance(backend, TorchBackend)
        self.memory_format = torch.channels_last if opts.channels_last else torch.contiguous_format
        backend.to(memory_format=self.memory_format)
        self.backend = backend.half() if self.half else backend
        self.times, self.images = np.zeros(3), 0

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, placements: list[Placement]) -> list[np.ndarray]:
        """(B, 3, H, W) uint8 RGB and each image's Placement -> per image (n, 6) float32 [x1, y1, x2, y2, conf, cls]."""
        o = self.opts
        t0 = time.perf_counter()
        x = images.to(self.device, non_blocking=True)
        x = (x.half() if self.half else x.float()).div_(255).contiguous(memory_format=self.memory_format)
        t1 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):  # boxes still decoded in fp32
            decoded = self.backend(x)[0]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so the inference time is not billed to NMS
        t2 = time.perf_counter()
        dets = postprocess(decoded.float(), self.backend.end2end, o.conf_thres, o.iou_thres, o.max_det,
                           list(o.classes) if o.classes else None, o.agnostic, o.multi_label)
        out = [unletterbox(d, p) for d, p in zip(dets, placements)]
        t3 = time.perf_counter()
        self.times += (t1 - t0, t2 - t1, t3 - t2)
        self.images += len(out)
        return out
