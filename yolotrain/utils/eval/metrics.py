"""Detection metrics that agree with pycocotools, plus a YOLOv5-style confusion matrix.

The reported mAP50 and mAP50-95 must be the numbers a paper would print, so matching and
accumulation follow COCOeval (bbox, area 'all', one max_det) step by step: the same IoU
arithmetic in float64, the same stable sorts, the same greedy matching and tie-breaks, the
same 101-point interpolation and the same final mean. Only the control flow differs: it is
vectorised, so scoring 5,000 images takes a fraction of a second instead of tens.

Work is split in two so validation can be sharded: each rank turns every image into a small
numpy-only ``ImageStats`` (``match_image``), rank 0 gathers them in image order and calls
``evaluate``. Given the same images in the same order, the result is bit-identical whatever
ranks or batches produced the records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

N_IOU = 10  # COCO IoU thresholds 0.50:0.05:0.95
N_REC = 101  # COCO recall sample points 0:0.01:1
N_CONF = 1000  # confidence grid for the YOLOv5 P/R/F1 curves


def iou_thresholds() -> np.ndarray:
    """COCO IoU thresholds 0.50, 0.55, ..., 0.95 (the exact floats COCOeval uses)."""
    return np.linspace(0.5, 0.95, N_IOU)


def recall_thresholds() -> np.ndarray:
    """COCO recall sample points 0.00, 0.01, ..., 1.00."""
    return np.linspace(0.0, 1.0, N_REC)


def _match_thresholds() -> np.ndarray:
    """Thresholds as COCOeval's matcher applies them: min(t, 1 - 1e-10)."""
    return np.minimum(iou_thresholds(), 1 - 1e-10)


_MATCH_THR = _match_thresholds()  # computed once: matching runs per image in the hot loop
_MATCH_THR.flags.writeable = False


def _as_array(x: Any, dtype: type, ncols: int | None = None) -> np.ndarray:
    """numpy copy of an array-like or torch tensor (val.py passes tensors), in a fixed dtype."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x, dtype=dtype)
    return a.reshape(-1, ncols) if ncols else a.reshape(-1)


@dataclass
class ImageStats:
    """What one image contributes to the metrics; numpy arrays only, so ranks can gather it.

    correct:  (k, 10) bool, detection matched a GT of its class at each COCO IoU threshold
    conf:     (k,) float64, detection score
    pred_cls: (k,) int64, detection class
    gt_cls:   (m,) int64, class of every ground-truth box in the image
    Detections are the kept ones (max_det per class), sorted by score, high first (stable).
    """

    correct: np.ndarray
    conf: np.ndarray
    pred_cls: np.ndarray
    gt_cls: np.ndarray


def pack_stats(stats: list[ImageStats]) -> dict[str, np.ndarray]:
    """Concatenate per-image records into flat arrays (for one all_gather per key)."""
    return {
        "correct": np.concatenate([s.correct for s in stats]) if stats else np.zeros((0, N_IOU), bool),
        "conf": np.concatenate([s.conf for s in stats]) if stats else np.zeros(0),
        "pred_cls": np.concatenate([s.pred_cls for s in stats]) if stats else np.zeros(0, np.int64),
        "gt_cls": np.concatenate([s.gt_cls for s in stats]) if stats else np.zeros(0, np.int64),
        "n_det": np.array([len(s.conf) for s in stats], dtype=np.int64),
        "n_gt": np.array([len(s.gt_cls) for s in stats], dtype=np.int64),
    }


def box_iou_coco(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU (n, m) of xyxy boxes in float64 with COCO's arithmetic (maskApi bbIou).

    Not torchvision's float32 box_iou: a match is a ">= threshold" test, and IoUs that land on
    a threshold (common with integer pixel boxes) must fall on the same side as in COCO.
    """
    ax1, ay1, ax2, ay2 = (a[:, i, None] for i in range(4))
    bx1, by1, bx2, by2 = b.T
    w = np.minimum(ax2, bx2) - np.maximum(ax1, bx1)
    h = np.minimum(ay2, by2) - np.maximum(ay1, by1)
    inter = np.maximum(w, 0.0) * np.maximum(h, 0.0)  # 0 where COCO skips (w <= 0 or h <= 0)
    union = ((ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1)) - inter
    return inter / np.where(inter > 0, union, 1.0)


def _rank_in_group(groups: np.ndarray) -> np.ndarray:
    """Position of each element among the elements of its group, in order of appearance."""
    idx = np.argsort(groups, kind="stable")
    g = groups[idx]
    pos = np.arange(len(g))
    first = np.maximum.accumulate(np.where(np.r_[True, g[1:] != g[:-1]], pos, 0))
    rank = np.empty_like(pos)
    rank[idx] = pos - first
    return rank


def _keep_order(scores: np.ndarray, cls: np.ndarray, max_det: int) -> np.ndarray:
    """Indices of the detections COCOeval keeps, highest score first.

    COCOeval sorts each image's detections of a class by score (mergesort, so ties keep input
    order) and keeps the first maxDet. One stable sort over the whole image gives every class
    the same relative order, so a per-class rank cut reproduces it.
    """
    order = np.argsort(-scores, kind="stable")
    return order if len(order) <= max_det else order[_rank_in_group(cls[order]) < max_det]


def _greedy_match(iou: np.ndarray, det_cls: np.ndarray, thr: np.ndarray) -> np.ndarray:
    """COCOeval's greedy matching for all thresholds at once -> (k, T) bool.

    iou (k, m) has detections in score order and -1 for pairs of different classes. COCO lets
    each detection in turn take the still-unmatched GT with the highest IoU >= t; on equal IoU
    the last GT wins (its loop replaces the best on ``>=``). Detections whose candidate GTs are
    wanted by no other detection cannot be affected by order and are settled in one step.
    The rest compete; detections of different classes never share a GT, so the k-th of every
    class is processed in the same vectorised step, and the loop runs over ranks, not boxes.
    """
    k, m = iou.shape
    correct = np.zeros((k, len(thr)), dtype=bool)
    if k == 0 or m == 0:
        return correct
    cand = iou >= thr.min()
    contested = (cand & (cand.sum(0) > 1)).any(1)
    free = ~contested
    correct[free] = iou[free].max(1, initial=-1.0)[:, None] >= thr
    if not contested.any():
        return correct
    rows = np.flatnonzero(contested)
    cols = np.flatnonzero(cand[rows].any(0))
    sub = iou[rows][:, cols]
    rank = _rank_in_group(det_cls[rows])
    taken = np.zeros((len(thr), len(cols)), dtype=bool)
    for step in range(int(rank.max()) + 1):
        sel = np.flatnonzero(rank == step)
        x = np.where(taken[None], -np.inf, sub[sel][:, None, :])  # (s, T, c), taken GTs out
        hit = x.max(2) >= thr  # some free GT reaches t; then so does the best one
        last = len(cols) - 1 - np.argmax(x[..., ::-1], axis=2)  # best IoU, last GT on ties
        correct[rows[sel]] = hit
        si, ti = np.nonzero(hit)
        taken[ti, last[si, ti]] = True
    return correct


def _match(
    boxes: np.ndarray, scores: np.ndarray, cls: np.ndarray, gboxes: np.ndarray, gcls: np.ndarray, max_det: int
) -> tuple[np.ndarray, np.ndarray]:
    """COCO matching for one image -> (keep (k,) indices into the predictions, correct (k, 10)).

    keep lists the detections COCO scores (at most max_det per class), best score first;
    correct[i, j] says whether detection keep[i] is a true positive at IoU threshold j. Inputs
    are float64 xyxy boxes and scores in one coordinate frame, int64 classes.
    """
    keep = _keep_order(scores, cls, max_det)
    kcls = cls[keep]
    same = kcls[:, None] == gcls[None, :]
    if not same.any():  # nothing can match: skip the IoU work (frequent with 80 classes)
        return keep, np.zeros((len(keep), N_IOU), dtype=bool)
    iou = box_iou_coco(boxes[keep], gboxes)
    iou[~same] = -1.0
    return keep, _greedy_match(iou, kcls, _MATCH_THR)


def match_image(
    pred_boxes: Any, pred_scores: Any, pred_cls: Any, gt_boxes: Any, gt_cls: Any, max_det: int = 100
) -> ImageStats:
    """One image's ImageStats: COCO-matched detections (see _match) and GT classes."""
    boxes, scores = _as_array(pred_boxes, np.float64, 4), _as_array(pred_scores, np.float64)
    cls = _as_array(pred_cls, np.float64).astype(np.int64)
    gboxes, gcls = _as_array(gt_boxes, np.float64, 4), _as_array(gt_cls, np.float64).astype(np.int64)
    keep, correct = _match(boxes, scores, cls, gboxes, gcls, max_det)
    return ImageStats(correct=correct, conf=scores[keep], pred_cls=cls[keep], gt_cls=gcls)


@dataclass
class Curves:
    """The curves behind the summary numbers, kept for plotting (never stored in checkpoints).

    Row k of every per-class array belongs to class ``classes[k]`` (= DetectionMetrics.ap_class).
    px:        (1000,) confidence grid 0..1
    p, r, f1:  (k, 1000) YOLOv5 precision, recall and F1 at IoU 0.5 at each confidence
    recall:    (101,) COCO recall points 0..1
    precision: (k, 101) COCO interpolated precision at IoU 0.5; its mean is mAP50
    """

    px: np.ndarray
    p: np.ndarray
    r: np.ndarray
    f1: np.ndarray
    recall: np.ndarray
    precision: np.ndarray
    classes: np.ndarray

    def mean_f1(self) -> np.ndarray:
        """Smoothed mean-over-classes F1 per confidence: the curve whose peak is metrics.conf."""
        return _smooth(self.f1.mean(0), 0.1) if len(self.f1) else np.zeros_like(self.px)


@dataclass
class DetectionMetrics:
    """Validation results. mAP follows COCO; P and R are YOLOv5's (at the best mean-F1 confidence).

    Per-class arrays have length nc; classes without GT hold 0 and are left out of every mean
    (ap_class lists the classes that count). nt: GT instances per class, ni: images that
    contain the class.
    """

    mp: float = 0.0
    mr: float = 0.0
    map50: float = 0.0
    map: float = 0.0
    conf: float = 0.0
    p: np.ndarray = field(default_factory=lambda: np.zeros(0))
    r: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ap50: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ap: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ap_class: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    nt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ni: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    n_images: int = 0
    n_instances: int = 0
    names: list[str] = field(default_factory=list)
    curves: Curves | None = field(default=None, repr=False, compare=False)  # for plots only; not in as_dict

    def fitness(self) -> float:
        """YOLOv5's model-selection score: 0.1 * mAP50 + 0.9 * mAP50-95."""
        return 0.1 * self.map50 + 0.9 * self.map

    def as_dict(self) -> dict[str, Any]:
        """Plain floats, ints and lists only (checkpoints load with weights_only; json dumps it)."""
        d: dict[str, Any] = {k: float(getattr(self, k)) for k in ("mp", "mr", "map50", "map", "conf")}
        d["fitness"] = float(self.fitness())
        d.update({k: [float(v) for v in getattr(self, k)] for k in ("p", "r", "ap50", "ap")})
        d.update({k: [int(v) for v in getattr(self, k)] for k in ("ap_class", "nt", "ni")})
        d.update(n_images=int(self.n_images), n_instances=int(self.n_instances), names=list(self.names))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DetectionMetrics:
        """Rebuild from as_dict() output (e.g. metrics stored in a checkpoint)."""
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("p", "r", "ap50", "ap"):
            kw[k] = np.asarray(kw.get(k, []), np.float64)
        for k in ("ap_class", "nt", "ni"):
            kw[k] = np.asarray(kw.get(k, []), np.int64)
        return cls(**kw)


def _coco_precision(tp: np.ndarray, n_gt: int) -> np.ndarray:
    """COCOeval.accumulate for one class: tp (T, nd) in score order -> precision (T, 101).

    Same operations in the same order as COCO (including its +spacing(1) in the denominator),
    so the floats are identical: envelope from the right, then the precision at the first
    point reaching each recall threshold, 0 beyond the highest recall.
    """
    nd = tp.shape[1]
    q = np.zeros((tp.shape[0], N_REC))
    if nd == 0:
        return q
    tps = np.cumsum(tp, axis=1).astype(float)
    fps = np.cumsum(~tp, axis=1).astype(float)
    rc = tps / n_gt
    pr = tps / (fps + tps + np.spacing(1))
    pr = np.maximum.accumulate(pr[:, ::-1], axis=1)[:, ::-1]
    rec = recall_thresholds()
    for t in range(tp.shape[0]):
        inds = np.searchsorted(rc[t], rec, side="left")
        q[t] = np.where(inds < nd, pr[t, np.minimum(inds, nd - 1)], 0.0)
    return q


def _pr_curves(tp: np.ndarray, conf: np.ndarray, n_gt: int) -> tuple[np.ndarray, np.ndarray]:
    """YOLOv5 precision and recall of one class on a 1000-point confidence grid (IoU 0.5)."""
    px = np.linspace(0, 1, N_CONF)
    if len(tp) == 0:
        return np.zeros(N_CONF), np.zeros(N_CONF)
    tpc, fpc = np.cumsum(tp), np.cumsum(~tp)
    r = np.interp(-px, -conf, tpc / (n_gt + 1e-16), left=0)
    p = np.interp(-px, -conf, tpc / (tpc + fpc), left=1)
    return p, r


def _smooth(y: np.ndarray, f: float = 0.05) -> np.ndarray:
    """Box filter of fraction f (YOLOv5's smooth), so a lucky spike does not pick the confidence."""
    nf = round(len(y) * f * 2) // 2 + 1
    yp = np.concatenate((np.full(nf // 2, y[0]), y, np.full(nf // 2, y[-1])))
    return np.convolve(yp, np.ones(nf) / nf, mode="valid")


def _class_names(names: Any, nc: int) -> list[str]:
    """Names as a list of nc strings from a list, a {int: name} dict or None."""
    if isinstance(names, dict):
        return [str(names.get(i, i)) for i in range(nc)]
    names = list(names or [])
    return [str(names[i]) if i < len(names) else str(i) for i in range(nc)]


def evaluate(stats: list[ImageStats], nc: int, names: Any = None) -> DetectionMetrics:
    """COCO mAP50 / mAP50-95 (and YOLOv5 P, R) over images given in a fixed order.

    Per class with GT, detections of all images are concatenated in image order and sorted by
    score with a stable sort, exactly as COCOeval.accumulate does, so score ties resolve the
    same way. Detections of classes without GT, or outside [0, nc), are ignored.
    """
    packed = pack_stats(stats)
    correct, conf, pcls, gcls = (packed[k] for k in ("correct", "conf", "pred_cls", "gt_cls"))
    if len(gcls) and (gcls.min() < 0 or gcls.max() >= nc):
        raise ValueError(f"ground-truth class ids must lie in [0, {nc}), got {gcls.min()}..{gcls.max()}")
    nt = np.bincount(gcls, minlength=nc)
    img_of_gt = np.repeat(np.arange(len(packed["n_gt"])), packed["n_gt"])
    ni = np.bincount(np.unique(img_of_gt * nc + gcls) % nc, minlength=nc)
    ap_class = np.flatnonzero(nt)
    out = DetectionMetrics(
        p=np.zeros(nc), r=np.zeros(nc), ap50=np.zeros(nc), ap=np.zeros(nc), ap_class=ap_class,
        nt=nt, ni=ni, n_images=len(stats), n_instances=int(nt.sum()), names=_class_names(names, nc),
    )
    px = np.linspace(0, 1, N_CONF)
    out.curves = Curves(px=px, p=np.zeros((0, N_CONF)), r=np.zeros((0, N_CONF)), f1=np.zeros((0, N_CONF)),
                        recall=recall_thresholds(), precision=np.zeros((0, N_REC)), classes=ap_class)
    if not len(ap_class):
        return out

    order = np.lexsort((-conf, pcls))  # by class, then score high first; stable like mergesort
    bounds = np.searchsorted(pcls[order], np.arange(nc + 1), side="left")
    prec = np.zeros((N_IOU, N_REC, len(ap_class)))
    p_curve, r_curve = np.zeros((len(ap_class), N_CONF)), np.zeros((len(ap_class), N_CONF))
    for j, c in enumerate(ap_class):
        i = order[bounds[c] : bounds[c + 1]]
        prec[:, :, j] = _coco_precision(correct[i].T, int(nt[c]))
        p_curve[j], r_curve[j] = _pr_curves(correct[i, 0], conf[i], int(nt[c]))

    out.map = float(np.mean(prec.ravel()))  # same element order as COCO's s[s > -1]
    out.map50 = float(np.mean(prec[0].ravel()))
    out.ap50[ap_class] = prec[0].mean(0)
    out.ap[ap_class] = prec.mean((0, 1))
    f1 = 2 * p_curve * r_curve / (p_curve + r_curve + 1e-16)
    best = int(_smooth(f1.mean(0), 0.1).argmax())
    out.p[ap_class], out.r[ap_class] = p_curve[:, best], r_curve[:, best]
    out.mp, out.mr = float(p_curve[:, best].mean()), float(r_curve[:, best].mean())
    out.conf = float(np.linspace(0, 1, N_CONF)[best])
    out.curves = Curves(px=px, p=p_curve, r=r_curve, f1=f1, recall=recall_thresholds(),
                        precision=prec[0].T.copy(), classes=ap_class)
    return out


class ConfusionMatrix:
    """YOLOv5-style confusion matrix; ``matrix[pred, true]``, index nc is background.

    Detections above ``conf`` are paired class-agnostically with GT at IoU > ``iou_thres``
    (each GT and each detection used once, best IoU first). A GT left unpaired counts as
    missed (background row); an unpaired detection as a false alarm (background column).
    """

    def __init__(self, nc: int, conf: float = 0.25, iou_thres: float = 0.45) -> None:
        self.nc, self.conf, self.iou_thres = nc, conf, iou_thres
        self.matrix = np.zeros((nc + 1, nc + 1), dtype=np.int64)

    def process_image(self, detections: Any, gt_boxes: Any, gt_cls: Any) -> None:
        """Add one image: detections (n, 6) [x1, y1, x2, y2, conf, cls], GT boxes xyxy and classes."""
        det = _as_array(detections, np.float64, 6)
        det = det[det[:, 4] > self.conf]
        dcls = det[:, 5].astype(np.int64)
        gcls = _as_array(gt_cls, np.float64).astype(np.int64)
        iou = box_iou_coco(_as_array(gt_boxes, np.float64, 4), det[:, :4])
        gi, di = np.nonzero(iou > self.iou_thres)
        o = np.argsort(-iou[gi, di], kind="stable")
        gi, di = gi[o], di[o]
        first = np.sort(np.unique(di, return_index=True)[1])  # best GT for each detection
        gi, di = gi[first], di[first]
        first = np.unique(gi, return_index=True)[1]  # then the best detection for each GT
        gi, di = gi[first], di[first]
        np.add.at(self.matrix, (dcls[di], gcls[gi]), 1)
        np.add.at(self.matrix, (self.nc, np.delete(gcls, gi)), 1)
        np.add.at(self.matrix, (np.delete(dcls, di), self.nc), 1)

    def tp_fp(self) -> tuple[np.ndarray, np.ndarray]:
        """True and false positives per class (background excluded)."""
        tp = np.diagonal(self.matrix)[:-1]
        return tp, self.matrix.sum(1)[:-1] - tp
