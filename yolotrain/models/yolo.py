"""The detection model: layers built from a model yaml (models/parse.py), ending in a head (models/heads).

``Model`` runs the layers, measures the strides once, and lets the head set up its priors; what
the outputs mean, how they are trained and decoded is the head's business.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, NamedTuple

import thop
import torch
from torch import nn

from yolotrain.models.blocks import C3, Conv
from yolotrain.models.blocks_v10 import RepVGGDW
from yolotrain.models.heads.anchor import check_anchors_spec, plain_anchors, resample_anchors
from yolotrain.models.heads.base import Head
from yolotrain.models.parse import head_has_anchors, load_model_yaml, parse_model
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER

PROBE_SIZE = 256  # image side used to measure the strides of a freshly built model


class ModelInfo(NamedTuple):
    """Summary numbers of a model, as YOLOv5 prints them."""

    layers: int
    parameters: int
    gradients: int
    gflops: float


class Model(nn.Module):
    """A detection model built from a model yaml (path or dict): YOLOv5's format, or Ultralytics'
    ``scales`` format for the anchor-free families (models/parse.py).

    ``self.yaml`` is the plain dict (with ch, nc and anchors overrides applied, and the chosen
    ``scale`` of a ``scales`` yaml) that checkpoints store; ``Model(self.yaml)`` rebuilds the same
    architecture.
    """

    def __init__(
        self,
        cfg: str | Path | dict,
        ch: int = 3,
        nc: int | None = None,
        anchors: list[list[float]] | None = None,
        na: int | None = None,
        label: str | None = None,
    ) -> None:
        """``na`` (anchors per level, YOLOv5's hyp ``anchors``) resamples the yaml's (or the
        ``anchors`` override's) anchors to that count: placeholders that autoanchor then fits.
        ``label``: where a ``cfg`` dict was read from, for messages."""
        super().__init__()
        d, source = load_model_yaml(cfg)
        source = label or source
        d["ch"] = d.get("ch", ch)
        _apply_overrides(d, source, nc, anchors, na)
        self.yaml: dict[str, Any] = d
        self.source = source
        self.model, self.save = parse_model(copy.deepcopy(d), [d["ch"]], source=source)
        self.detect.set_strides(self._probe_strides(d["ch"]))
        self.detect.initialize_biases()
        initialize_weights(self)

    @property
    def detect(self) -> Head:
        """The detection head (last layer): it owns the loss and the output decoding (models/heads)."""
        return self.model[-1]

    @property
    def stride(self) -> torch.Tensor:
        """Strides of the detection levels, e.g. tensor([8., 16., 32.])."""
        return self.detect.stride

    @property
    def grid(self) -> int:
        """The multiple every input side is rounded to: the largest stride, at least 32 (the one rule for
        training, AutoBatch and the FLOPs probe)."""
        return max(int(self.stride.max()), 32)

    @property
    def end2end(self) -> bool:
        """Whether the eval output is the head's final detections (no NMS): what post-processing reads
        (yolotrain.utils.core.boxes.postprocess), so callers never ask which family the model is."""
        return bool(self.detect.end2end)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """What DDP (which reads this attribute) leaves out of its broadcast of buffers at every forward: the
        anchor head's anchors, the same on every rank by construction (autoanchor broadcasts its result once),
        which the anchor loss copies to the host only when they change."""
        return [name for name, _ in self.named_buffers() if name.rsplit(".", 1)[-1] == "anchors"]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        y: list[torch.Tensor | None] = []
        for m in self.model:
            if m.f != -1:  # input from earlier layers rather than the previous one
                x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
            x = m(x)
            y.append(x if m.i in self.save else None)
        return x

    def _probe_strides(self, ch: int) -> torch.Tensor:
        """Run a zero image through the net to read each level's stride (BN stats untouched)."""
        was_training = self.training
        self.train()
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
        try:
            with torch.no_grad():
                out = self.forward(torch.zeros(1, ch, PROBE_SIZE, PROBE_SIZE))
        except (RuntimeError, TypeError, ValueError) as e:
            raise UserError(f"{self.source}: the model does not run on a {PROBE_SIZE}x{PROBE_SIZE} image "
                            f"(check channel counts and 'from' indices): {e}") from None
        finally:
            self.train(was_training)
        if isinstance(out, dict):  # the end-to-end head's two branches share the levels
            out = out["one2many"]
        return torch.tensor([PROBE_SIZE / o.shape[-2] for o in out], dtype=torch.float32)

    def fuse(self) -> Model:
        """Fold every BatchNorm into its conv (and RepVGGDW's two branches into one), then give each C3 one conv
        for its two input convs (C3.merge_inputs), for faster inference; returns self."""
        n = 0
        for m in list(self.modules()):  # a RepVGGDW comes before its Convs, which it fuses itself
            if isinstance(m, RepVGGDW) and m.conv1 is not None:
                m.fuse_bn()
                n += 2
            elif isinstance(m, Conv) and m.bn is not None:
                m.fuse_bn()
                n += 1
        merged = sum(m.merge_inputs() for m in list(self.modules()) if isinstance(m, C3) and m.cv12 is None)
        LOGGER.debug(f"Fused {n} Conv+BN layers; merged the twin input convs of {merged} C3 blocks")
        return self

    def info(self, imgsz: int | tuple[int, int] = 640) -> ModelInfo:
        """Count layers/parameters and estimate GFLOPs at imgsz, and log one summary line."""
        n_p = sum(p.numel() for p in self.parameters())
        n_g = sum(p.numel() for p in self.parameters() if p.requires_grad)
        layers = len(list(self.modules()))
        gflops = self._gflops(imgsz)
        info = ModelInfo(layers, n_p, n_g, gflops)
        LOGGER.info(f"Model summary: {layers} layers, {n_p:,} parameters, {n_g:,} gradients, {gflops:.1f} GFLOPs")
        return info

    def _gflops(self, imgsz: int | tuple[int, int]) -> float:
        """thop on a stride-sized image, scaled to imgsz (cheap; FLOPs grow with pixel count), plus
        the attention products thop cannot see, counted for each attention map's size at imgsz."""
        h, w = (imgsz, imgsz) if isinstance(imgsz, int) else imgsz
        p = next(self.parameters())
        s = self.grid
        im = torch.zeros((1, self.yaml["ch"], s, s), device=p.device, dtype=p.dtype)
        model = copy.deepcopy(self)
        seen: list[tuple[nn.Module, int, int]] = []  # (module, map height, map width) on the probe image
        for m in model.modules():
            if hasattr(m, "matmul_macs"):
                m.register_forward_hook(lambda mod, inp, out: seen.append((mod, *inp[0].shape[-2:])))
        try:
            macs = thop.profile(model, inputs=(im,), verbose=False)[0]
        except Exception as e:  # a summary number must never stop training
            LOGGER.warning(f"GFLOPs not computed: thop failed with {type(e).__name__}: {e}")
            return 0.0
        extra = sum(m.matmul_macs(mh * h / s, mw * w / s) for m, mh, mw in seen)
        return macs / 1e9 * 2 * (h / s) * (w / s) + extra / 1e9 * 2


def de_parallel(model: nn.Module) -> nn.Module:
    """The model inside DataParallel/DDP wrappers and torch.compile's OptimizedModule (``_orig_mod``), in
    any nesting, else the model itself: checkpoints save its plain state_dict keys."""
    wrappers = (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, wrappers):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def round_to_stride(imgsz: int, stride: int) -> int:
    """``imgsz`` rounded up to a multiple of the largest stride, at least one stride (the feature pyramid
    needs it); training, export and detection round the same way, and a warning says when it changed."""
    size = max(math.ceil(imgsz / stride) * stride, stride)
    if size != imgsz:
        LOGGER.warning(f"--imgsz {imgsz} must be a multiple of the stride {stride}; using {size}")
    return size


def initialize_weights(model: nn.Module) -> None:
    """YOLOv5 init: BN eps/momentum tuned for detection, in-place activations to save memory."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = 1e-3
            m.momentum = 0.03
        elif isinstance(m, (nn.SiLU, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardswish)):
            m.inplace = True


def _apply_overrides(d: dict, source: str, nc: int | None, anchors: list | None, na: int | None) -> None:
    """The data yaml's class count and anchors, and the hyp file's anchor count, written into the model dict
    (anchors only for an anchor head: an anchor-free model has nothing to put them in)."""
    if nc is not None and nc != d.get("nc"):
        if "nc" in d:
            LOGGER.info(f"Overriding {source} nc={d['nc']} with nc={nc}")
        d["nc"] = int(nc)
    if not head_has_anchors(d):
        if anchors is not None or na is not None:
            LOGGER.info(f"{source} has an anchor-free head: the anchors given by the data or hyp file are not used")
        return
    if anchors is not None:
        LOGGER.info(f"Overriding {source} anchors with {anchors}")
        d["anchors"] = plain_anchors(anchors)
    if na is not None:
        base = check_anchors_spec(d.get("anchors"), f"{source}: 'anchors'")
        if na != len(base[0]) // 2:
            d["anchors"] = resample_anchors(base, na)
            LOGGER.info(f"Overriding {source} anchors with {na} per level (placeholders until "
                        f"autoanchor fits them): {d['anchors']}")
