"""Box formats, IoU, NMS and the one post-processing step every caller uses. IoU and NMS come from
torchvision.ops (one well-kept implementation), driven so that NMS gives the same detections on every
device (``_nms_ranked``)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torchvision


def xywh2xyxy(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """[xc, yc, w, h] -> [x1, y1, x2, y2]."""
    y = x.clone() if isinstance(x, torch.Tensor) else np.copy(x)
    y[..., 0] = x[..., 0] - x[..., 2] / 2
    y[..., 1] = x[..., 1] - x[..., 3] / 2
    y[..., 2] = x[..., 0] + x[..., 2] / 2
    y[..., 3] = x[..., 1] + x[..., 3] / 2
    return y


def xywhn2xyxy(x: np.ndarray, w: float, h: float, padw: float = 0.0, padh: float = 0.0) -> np.ndarray:
    """Normalized [xc, yc, w, h] -> pixel [x1, y1, x2, y2] in an image of size w x h plus padding."""
    y = np.copy(x)
    y[..., 0] = w * (x[..., 0] - x[..., 2] / 2) + padw
    y[..., 1] = h * (x[..., 1] - x[..., 3] / 2) + padh
    y[..., 2] = w * (x[..., 0] + x[..., 2] / 2) + padw
    y[..., 3] = h * (x[..., 1] + x[..., 3] / 2) + padh
    return y


def xyxy2xywhn(x: np.ndarray, w: float, h: float, clip: bool = False) -> np.ndarray:
    """Pixel [x1, y1, x2, y2] -> normalized [xc, yc, w, h]; optionally clip to the image first."""
    x = np.copy(x)
    if clip:
        x[..., [0, 2]] = x[..., [0, 2]].clip(0, w)
        x[..., [1, 3]] = x[..., [1, 3]].clip(0, h)
    y = np.empty_like(x)
    y[..., 0] = (x[..., 0] + x[..., 2]) / 2 / w
    y[..., 1] = (x[..., 1] + x[..., 3]) / 2 / h
    y[..., 2] = (x[..., 2] - x[..., 0]) / w
    y[..., 3] = (x[..., 3] - x[..., 1]) / h
    return y


def non_max_suppression(
    prediction: torch.Tensor,
    conf_thres: float = 0.25,
    iou_thres: float = 0.45,
    classes: list[int] | None = None,
    agnostic: bool = False,
    multi_label: bool = False,
    max_det: int = 300,
    max_nms: int = 30000,
) -> list[torch.Tensor]:
    """Per-image NMS on decoded head output (B, N, 4 + nc) -> list of (n, 6) [x1, y1, x2, y2, conf, cls].

    Rows are box centre, size (input pixels) and one score per class, the form every head decodes
    to (models/heads/base.py; the anchor head's scores are objectness x class). multi_label keeps every class above conf_thres for a box
    (what mAP evaluation wants). No wall-clock limit: results never depend on machine speed.
    Each image's detections come best first, equal scores in the order of their rows (a box's
    classes in class order under multi_label), and are a function of the values alone: the same
    on CPU and CUDA, whatever the number of candidates (see ``_nms_ranked``).
    On CPU the images of a batch run on torch's intra-op thread count in parallel: torchvision's
    NMS kernel is single-threaded and releases the GIL, and each image's result is computed
    exactly as it would be alone.
    """
    if not 0 <= conf_thres <= 1 or not 0 <= iou_thres <= 1:
        raise ValueError(f"conf_thres {conf_thres} and iou_thres {iou_thres} must lie in [0, 1]")
    bs, nc = prediction.shape[0], prediction.shape[2] - 4
    rows, counts = _candidates(prediction, conf_thres, multi_label and nc > 1)
    parts = rows.split(counts)

    def one(i: int) -> torch.Tensor:
        return _nms_image(parts[i], iou_thres, classes, agnostic, max_det, max_nms)

    threads = torch.get_num_threads()
    if prediction.device.type == "cpu" and bs > 1 and threads > 1:
        # Threads that live on after this call would slow every later torch op: once a thread
        # other than the main one has run an OpenMP region, libgomp counts more threads than
        # cores and its idle workers stop spinning, so each parallel region waits on a wake-up
        # (later training epochs slow down). A pool per call is cheap by comparison.
        with ThreadPoolExecutor(min(threads, bs), thread_name_prefix="nms") as pool:
            return list(pool.map(one, range(bs)))
    return [one(i) for i in range(bs)]


def _candidates(prediction: torch.Tensor, conf_thres: float, multi_label: bool) -> tuple[torch.Tensor, list[int]]:
    """The batch's candidate detections as rows [x1, y1, x2, y2, conf, cls], image after image, each image's
    in its rows' order (under multi_label a box's classes in class order), and the rows per image.

    One pass for the whole batch, with a few host synchronisations for the batch rather than two per image
    (on CUDA each one waits for the device); every row is computed as it would be for its image alone."""
    bs = prediction.shape[0]
    keep = prediction[..., 4:].amax(-1) > conf_thres  # (B, N): a class score above the threshold
    x = prediction[keep]
    image = torch.arange(bs, device=x.device).repeat_interleave(keep.sum(1))  # each row's image
    scores, box = x[:, 4:], xywh2xyxy(x[:, :4])
    if multi_label:
        i_box, j = (scores > conf_thres).nonzero(as_tuple=False).T
        rows, image = torch.cat((box[i_box], scores[i_box, j, None], j[:, None].float()), 1), image[i_box]
    else:
        conf, j = scores.max(1, keepdim=True)
        rows = torch.cat((box, conf, j.float()), 1)  # every kept box has its best class above the threshold
    edges = torch.searchsorted(image, torch.arange(bs + 1, device=image.device))  # image is sorted
    return rows, edges.diff().tolist()


def _nms_image(x: torch.Tensor, iou_thres: float, classes: list[int] | None, agnostic: bool,
               max_det: int, max_nms: int) -> torch.Tensor:
    """One image's candidate rows (``_candidates``) -> its (n, 6) detections."""
    if classes is not None:
        x = x[(x[:, 5:6] == torch.tensor(classes, device=x.device)).any(1)]
    if not x.shape[0]:
        return torch.zeros((0, 6), device=x.device)
    # Best first, equal scores in row order (a stable sort): the max_nms cut before the O(n^2) step and the
    # order of the results follow from the values alone, on every device.
    x = x[torch.sort(x[:, 4], descending=True, stable=True).indices[:max_nms]]
    group = torch.zeros_like(x[:, 5]) if agnostic else x[:, 5]
    return x[_nms_ranked(x[:, :4], group, iou_thres)[:max_det]]


# Above this many boxes _nms_ranked runs one NMS call per group, below it one call for all (the same rows
# either way): torchvision's own switch points, from its benchmarks (ops.boxes.batched_nms).
ONE_NMS_CALL_MAX = {"cpu": 1000, "cuda": 25000}


def _nms_ranked(boxes: torch.Tensor, group: torch.Tensor, iou_thres: float) -> torch.Tensor:
    """Greedy NMS within each group of ``boxes`` (n, 4) xyxy, taken in row order (row 0 first) -> the kept
    rows, ascending. The same arithmetic on every device, so CPU and CUDA keep the same rows:

    - boxes are shifted by group * span (torchvision's coordinate trick: one NMS call for all groups),
      span exceeding the coordinates' extent so boxes of different groups never overlap; span is
      torchvision's max + 1 when no coordinate is negative (the case it is written for), else
      max - min + 1 (max + 1 would let a group's boxes with negative corners overlap the previous group's);
    - the scores handed to torchvision are n, n-1, ..., 1, strictly decreasing, so its internal sort
      (not promised stable on either device) has no ties to reorder and rows are visited in the order given;
    - the IoU threshold is rounded to float32 first: the CUDA kernel compares with a float, the CPU one
      with a double, so an IoU of exactly float32(0.6) would be suppressed on the CPU only.

    torchvision.ops.batched_nms instead switches algorithm by device and size (a loop over classes on CPU
    above 1000 boxes, the trick below that and on CUDA up to 25000), with ties in its sorts resolved
    differently on each: the detections differed between CPU and CUDA. Shifted boxes of different groups
    never overlap, so NMS group by group on the shifted boxes keeps exactly the rows one call keeps: that is
    done above ONE_NMS_CALL_MAX boxes, as one call costs O(n^2) over all groups (on CPU, 30000 boxes of 80
    classes take ~17x longer in one call than group by group). The CUDA kernel may compute its IoU with fused
    multiply-adds (nvcc's default), so an IoU within a rounding step of the threshold could still be
    decided differently there.
    """
    n = boxes.shape[0]
    if n > 2 ** 24:  # the ranks are exact in float32 up to 2^24
        raise ValueError(f"{n} boxes for one NMS call; at most 2^24 (lower max_nms)")
    if boxes.dtype != torch.float64:
        boxes = boxes.float()  # torchvision's CPU kernel has no fp16; ranks need float32's integers
    if not n:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    lo, hi = boxes.min(), boxes.max()  # tensors: no host synchronisation on CUDA
    span = torch.where(lo >= 0, hi + 1, hi - lo + 1)
    shifted = boxes + (group.to(boxes) * span)[:, None]
    rank = torch.arange(n, 0, -1, dtype=boxes.dtype, device=boxes.device)
    iou = float(np.float32(iou_thres))
    if n <= ONE_NMS_CALL_MAX.get(boxes.device.type, 25000):
        return torchvision.ops.nms(shifted, rank, iou)
    kept = torch.zeros(n, dtype=torch.bool, device=boxes.device)
    by_group = torch.sort(group, stable=True).indices  # rows of a group stay in row order
    sizes = torch.unique_consecutive(group[by_group], return_counts=True)[1].tolist()
    for rows in by_group.split(sizes):
        kept[rows[torchvision.ops.nms(shifted[rows], rank[rows], iou)]] = True
    return kept.nonzero().squeeze(1)



def postprocess(out: torch.Tensor, end2end: bool, conf_thres: float = 0.25, iou_thres: float = 0.45,
                max_det: int = 300, classes: list[int] | None = None, agnostic: bool = False,
                multi_label: bool = False) -> list[torch.Tensor]:
    """A head's eval output -> per image (n, 6) [x1, y1, x2, y2, conf, cls] in input pixels.

    One step for validation, detect.py and the export check, so none of them branches on the model
    family: the head's ``end2end`` (an export's metadata) says which form ``out`` is. Decoded output
    (B, N, 4 + nc) goes through ``non_max_suppression``. An end-to-end head's dets (B, K, 6) are
    already final: rows scoring above ``conf_thres``, of ``classes`` when given, at most ``max_det``,
    with no NMS (``iou_thres``, ``agnostic`` and ``multi_label`` are NMS settings and do not apply;
    two overlapping boxes both stay, as the head chose them).
    """
    if not end2end:
        return non_max_suppression(out, conf_thres, iou_thres, classes, agnostic, multi_label, max_det)
    if not 0 <= conf_thres <= 1:
        raise ValueError(f"conf_thres {conf_thres} must lie in [0, 1]")
    if out.ndim != 3 or out.shape[2] != 6:
        raise ValueError(f"end-to-end output must be (B, max_det, 6) detections, got {tuple(out.shape)}")
    return _select_end2end(out, conf_thres, classes, max_det)


def _select_end2end(out: torch.Tensor, conf_thres: float, classes: list[int] | None,
                    max_det: int) -> list[torch.Tensor]:
    """Each image's end-to-end rows kept by score and class, best first (a stable sort: the head's order
    holds for equal scores, and an export whose rows are not sorted still gives the top ones). The batch in
    one sort, dropped rows last, and one host synchronisation (the counts) instead of one per image."""
    keep = out[..., 4] > conf_thres
    if classes is not None:
        keep &= (out[..., 5:6] == torch.tensor(classes, device=out.device, dtype=out.dtype)).any(-1)
    score = torch.where(keep, out[..., 4], torch.full((), float("-inf"), dtype=out.dtype, device=out.device))
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    counts = keep.sum(1).clamp(max=max_det).tolist()
    return [d[o[:k]] for d, o, k in zip(out, order, counts)]
