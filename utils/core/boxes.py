"""Box formats, IoU, NMS and the one post-processing step every caller uses. IoU and NMS come from
torchvision.ops (one well-kept implementation)."""
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
    On CPU the images of a batch run on torch's intra-op thread count in parallel: torchvision's
    NMS kernel is single-threaded and releases the GIL, and each image's result is computed
    exactly as it would be alone.
    """
    if not 0 <= conf_thres <= 1 or not 0 <= iou_thres <= 1:
        raise ValueError(f"conf_thres {conf_thres} and iou_thres {iou_thres} must lie in [0, 1]")
    bs, nc = prediction.shape[0], prediction.shape[2] - 4
    multi_label &= nc > 1
    candidates = prediction[..., 4:].amax(-1) > conf_thres

    def one(i: int) -> torch.Tensor:
        return _nms_image(prediction[i][candidates[i]], conf_thres, iou_thres, classes, agnostic, multi_label,
                          max_det, max_nms)

    threads = torch.get_num_threads()
    if prediction.device.type == "cpu" and bs > 1 and threads > 1:
        # Threads that live on after this call would slow every later torch op: once a thread
        # other than the main one has run an OpenMP region, libgomp counts more threads than
        # cores and its idle workers stop spinning, so each parallel region waits on a wake-up
        # (later training epochs slow down). A pool per call is cheap by comparison.
        with ThreadPoolExecutor(min(threads, bs), thread_name_prefix="nms") as pool:
            return list(pool.map(one, range(bs)))
    return [one(i) for i in range(bs)]


def _nms_image(x: torch.Tensor, conf_thres: float, iou_thres: float, classes: list[int] | None, agnostic: bool,
               multi_label: bool, max_det: int, max_nms: int) -> torch.Tensor:
    """One image's candidates (rows with a class score > conf_thres) -> its (n, 6) detections."""
    if not x.shape[0]:
        return torch.zeros((0, 6), device=x.device)
    scores = x[:, 4:]
    box = xywh2xyxy(x[:, :4])
    if multi_label:
        i_box, j = (scores > conf_thres).nonzero(as_tuple=False).T
        x = torch.cat((box[i_box], scores[i_box, j, None], j[:, None].float()), 1)
    else:
        conf, j = scores.max(1, keepdim=True)
        x = torch.cat((box, conf, j.float()), 1)[conf.view(-1) > conf_thres]
    if classes is not None:
        x = x[(x[:, 5:6] == torch.tensor(classes, device=x.device)).any(1)]
    if not x.shape[0]:
        return torch.zeros((0, 6), device=x.device)
    if x.shape[0] > max_nms:  # keep the most confident before the O(n^2) step
        x = x[x[:, 4].argsort(descending=True)[:max_nms]]
    group = torch.zeros_like(x[:, 5]) if agnostic else x[:, 5]
    keep = torchvision.ops.batched_nms(x[:, :4], x[:, 4], group, iou_thres)[:max_det]
    return x[keep]



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
    return [_select_end2end(d, conf_thres, classes, max_det) for d in out]


def _select_end2end(d: torch.Tensor, conf_thres: float, classes: list[int] | None, max_det: int) -> torch.Tensor:
    """One image's end-to-end rows kept by score and class, best first (a stable sort: the head's order
    holds for equal scores, and an export whose rows are not sorted still gives the top ones)."""
    keep = d[:, 4] > conf_thres
    if classes is not None:
        keep &= (d[:, 5:6] == torch.tensor(classes, device=d.device, dtype=d.dtype)).any(1)
    d = d[keep]
    order = torch.sort(d[:, 4], descending=True, stable=True).indices[:max_det]
    return d[order]
