"""Scoring a detector on a split, sharded over ranks: predictions -> matched records -> metrics.

Every rank scores a contiguous shard of whole batches (``InferenceSampler``); per-image records
go to rank 0, which puts them in COCO image-id order (sorted image paths, the ids
``utils/eval/coco.py`` writes), evaluates once and broadcasts the result, so the numbers do not
depend on the world size. Nothing is written here: callers (val.py, training) save labels,
json and pictures from the returned ``EvalResult``.
"""
from __future__ import annotations

import time
from copy import deepcopy
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from yolotrain.utils.core import dist, watchdog
from yolotrain.utils.core.boxes import postprocess
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.geometry import unletterbox
from yolotrain.utils.eval import coco
from yolotrain.utils.eval.metrics import ConfusionMatrix, DetectionMetrics, ImageStats, evaluate, match_image


@dataclass(frozen=True)
class EvalOptions:
    """How to score: thresholds, numerics, and what to keep for the caller's files."""

    conf_thres: float = 0.001
    iou_thres: float = 0.6
    max_det: int = 300
    half: bool = False  # reduced precision: FP16 weights on CUDA, bf16 autocast on CPU (boxes decoded in fp32)
    channels_last: bool = False
    fuse: bool = True  # score a BN-folded copy (False: the model is already fused, or must stay as it is)
    keep_detections: bool = False  # gather every detection to rank 0 (for --save-txt / --save-json)
    keep_batches: int = 0  # rank 0 keeps its first N batches with their detections (for pictures)
    skip_first_timing: bool = False  # leave each rank's first batch (one-off allocations) out of the speed
    verbose: bool = False  # per-class table
    prefix: str = "val: "


@dataclass
class SampleBatch:
    """One batch as scored, kept for pictures: uint8 images, label rows, paths and detections."""

    images: torch.Tensor
    targets: torch.Tensor
    paths: tuple[str, ...]
    detections: list[torch.Tensor]


@dataclass
class EvalResult:
    """What one validation pass produced; identical on every rank except the rank-0-only fields."""

    metrics: DetectionMetrics
    loss: list[float] = field(default_factory=list)  # mean criterion items (criterion.loss_names), when computed
    speed_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # pre-process, inference, NMS (post-process) per image
    images: int = 0
    confusion: np.ndarray | None = None  # (nc + 1, nc + 1) int64 matrix[pred, true] at conf 0.25 / IoU 0.45
    detections: list[tuple[int, np.ndarray]] | None = None  # rank 0: (dataset index, (n, 6) original pixels)
    batches: list[SampleBatch] = field(default_factory=list)  # rank 0: its first keep_batches batches


@dataclass
class _Shard:
    """What one rank sends to rank 0: per-image records and sums, plus detections when kept."""

    records: list[tuple[int, ImageStats]]
    loss: torch.Tensor | None
    n_batches: int
    times: np.ndarray
    timed_images: int  # images behind ``times`` (a rank's first batch is left out when asked...)
    cold: tuple[np.ndarray, int]  # ...and then used only when nothing else was timed
    confusion: np.ndarray
    detections: list[tuple[int, np.ndarray]]


def prepare_model(model: torch.nn.Module, device: torch.device, opts: EvalOptions) -> torch.nn.Module:
    """The network to score: a fused copy (or the model itself), in eval mode, layout and precision."""
    net = deepcopy(model).fuse() if opts.fuse else model
    net.eval()
    net.to(memory_format=torch.channels_last if opts.channels_last else torch.contiguous_format)
    return net.half() if opts.half and device.type == "cuda" else net


@torch.no_grad()
def evaluate_model(model: torch.nn.Module, loader, device: torch.device, names: list[str], info: DistInfo,
                   opts: EvalOptions = EvalOptions(), criterion=None) -> EvalResult:
    """Score ``model`` on this rank's shard of ``loader``; every rank returns the whole split's metrics.

    ``criterion`` (the head's training loss) adds the validation loss. A model in training mode
    is put back in training mode afterwards.
    """
    was_training = model.training
    net = prepare_model(model, device, opts)
    shard, batches = _score_shard(net, loader, device, names, info, opts, criterion)
    if was_training:
        model.train()
    result = _reduce(shard, names, opts, loader.dataset.im_files)
    result.batches = batches
    return result


def _score_shard(net, loader, device, names, info: DistInfo, opts: EvalOptions, criterion) -> tuple[_Shard, list]:
    """Inference, post-processing (NMS, or an end-to-end head's own selection) and per-image matching over
    this rank's batches. ``net.end2end`` (a Model's head, a backend's metadata) picks the post-processing."""
    end2end = bool(getattr(net, "end2end", False))
    half = opts.half and device.type == "cuda"
    memory_format = torch.channels_last if opts.channels_last else torch.contiguous_format
    dataset = loader.dataset
    records, detections, confusion, batches = [], [], ConfusionMatrix(len(names)), []
    loss = torch.zeros(len(criterion.loss_names), device=device) if criterion is not None else None
    n_batches, times, timed_images, cold = 0, np.zeros(3), 0, (np.zeros(3), 0)
    bar = tqdm(loader, desc=f"{opts.prefix}{'Class':>20}{'Images':>11}{'Instances':>11}{'P':>11}{'R':>11}"
               f"{'mAP50':>11}{'mAP50-95':>11}", bar_format="{l_bar}{bar:10}{r_bar}", disable=not info.is_main,
               leave=False)
    for batch in watchdog.beats(bar):  # each batch is progress: a long validation is not a hang
        t0 = time.perf_counter()
        imgs = batch.images.to(device, non_blocking=True)
        imgs = (imgs.half() if half else imgs.float()).div_(255).contiguous(memory_format=memory_format)
        synchronize(device)
        t1 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.half and device.type == "cpu"):
            preds, train_out = net(imgs)
        if criterion is not None:
            loss += criterion(raw_float(train_out), batch.targets)[1]  # host targets, as in training
        synchronize(device)
        t2 = time.perf_counter()
        dets = postprocess(preds.float(), end2end, opts.conf_thres, opts.iou_thres, max_det=opts.max_det,
                           multi_label=True)
        synchronize(device)
        t3 = time.perf_counter()
        host_dets = detections_to_host(dets)
        if opts.skip_first_timing and n_batches == 0:
            cold = (np.array((t1 - t0, t2 - t1, t3 - t2)), len(imgs))
        else:
            times += (t1 - t0, t2 - t1, t3 - t2)
            timed_images += len(imgs)
        if info.is_main and n_batches < opts.keep_batches:  # rank 0 holds the split's first batches
            batches.append(SampleBatch(batch.images.clone(), batch.targets, batch.paths, dets))  # loader memory is reused
        n_batches += 1
        for det, index, placed in zip(host_dets, batch.indices.tolist(), batch.placements):
            pred = unletterbox(det, placed)
            h0, w0 = placed.orig_hw
            gt, gt_cls = coco.gt_xyxy(dataset.labels[index], w0, h0)  # as in ground_truth.json
            records.append((index, match_image(pred[:, :4], pred[:, 4], pred[:, 5], gt, gt_cls)))
            confusion.process_image(pred, gt, gt_cls)
            if opts.keep_detections:
                detections.append((index, pred))
    shard = _Shard(records, None if loss is None else loss.cpu(), n_batches, times, timed_images, cold,
                   confusion.matrix, detections)
    return shard, batches


def raw_float(raw):
    """A head's raw outputs in fp32: a list of levels, or an end-to-end head's dict of branches of them."""
    if isinstance(raw, dict):
        return {k: raw_float(v) for k, v in raw.items()}
    return [x.float() for x in raw]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a timed section is charged for its own kernels rather than the
    next section's first blocking call (CUDA runs asynchronously; the CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def detections_to_host(dets: list[torch.Tensor]) -> list[torch.Tensor]:
    """A batch's per-image detections on the host with one device-to-host copy instead of one per image
    (each copy waits for the device); values unchanged. Host tensors are returned as they are."""
    if all(d.device.type == "cpu" for d in dets):
        return list(dets)
    return list(torch.cat(dets).cpu().split([len(d) for d in dets]))


def _reduce(shard: _Shard, names: list[str], opts: EvalOptions, im_files: list[str]) -> EvalResult:
    """Gather every rank's shard to rank 0, evaluate once in COCO image-id order, broadcast.

    The order is the images' sorted paths (yolotrain.utils.eval.coco ids), not the loader's rect order, so
    score ties across images resolve as COCOeval resolves them on val.py's json files. Rank 0's
    result also holds all detections in that order when they were kept.
    """
    gathered = dist.gather_object(shard)
    result, detections = None, None
    if gathered is not None:
        image_id = coco.image_ids(im_files)

        def order(item: tuple) -> int:
            return image_id[im_files[item[0]]]

        records = sorted((r for part in gathered for r in part.records), key=order)
        detections = sorted((d for part in gathered for d in part.detections), key=order)
        metrics = evaluate([s for _, s in records], nc=len(names), names=names)
        total_batches = max(sum(p.n_batches for p in gathered), 1)
        losses = [p.loss for p in gathered if p.loss is not None]
        mean_loss = (sum(losses) / total_batches).tolist() if losses else []
        timed, spent = sum(p.timed_images for p in gathered), sum(p.times for p in gathered)
        if not timed:  # every rank had a single batch: report the cold ones rather than nothing
            timed, spent = sum(p.cold[1] for p in gathered), sum(p.cold[0] for p in gathered)
        speed = tuple(float(v) for v in (spent / max(timed, 1) * 1e3))
        confusion = np.sum([p.confusion for p in gathered], axis=0, dtype=np.int64)  # integers: any order
        result = EvalResult(metrics=metrics, loss=mean_loss, speed_ms=speed, images=len(records), confusion=confusion)
        log_table(result, names, opts.verbose, opts.prefix)
    result = dist.broadcast_object(result)
    if gathered is not None and opts.keep_detections:
        result.detections = detections
    return result


def log_table(result: EvalResult, names: list[str], verbose: bool, prefix: str) -> None:
    """The all-classes row (and per class with ``verbose``), as YOLOv5 prints it."""
    m = result.metrics
    fmt = "%22s" + "%11i" * 2 + "%11.3g" * 4
    LOGGER.info(prefix + fmt % ("all", result.images, int(m.nt.sum()), m.mp, m.mr, m.map50, m.map))
    if int(m.nt.sum()) == 0:
        LOGGER.warning(f"{prefix}no labels found in the split; metrics are zero")
    if verbose and len(names) > 1:
        for c in m.ap_class:
            LOGGER.info(prefix + fmt % (names[c], m.ni[c], m.nt[c], m.p[c], m.r[c], m.ap50[c], m.ap[c]))
