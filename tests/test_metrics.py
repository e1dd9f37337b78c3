"""utils/eval/metrics.py: COCO-exact mAP (checked against pycocotools), determinism, confusion matrix."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from yolotrain.utils.eval import metrics
from yolotrain.utils.eval.metrics import (
    ConfusionMatrix,
    DetectionMetrics,
    ImageStats,
    evaluate,
    iou_thresholds,
    match_image,
    pack_stats,
)

def match_detections(pred_boxes, pred_scores, pred_cls, gt_boxes, gt_cls, max_det: int = 100):
    """(keep, correct) of metrics._match for plain lists: what match_image keeps, with indices."""
    f64 = lambda x, n=None: np.asarray(x, np.float64).reshape(-1, n) if n else np.asarray(x, np.float64).reshape(-1)
    return metrics._match(f64(pred_boxes, 4), f64(pred_scores), f64(pred_cls).astype(np.int64), f64(gt_boxes, 4),
                          f64(gt_cls).astype(np.int64), max_det)


def unpack_stats(packed: dict[str, np.ndarray]) -> list[ImageStats]:
    """Inverse of metrics.pack_stats: split flat arrays back into per-image records (a shard as gathered)."""
    d_at = np.cumsum(packed["n_det"])[:-1]
    g_at = np.cumsum(packed["n_gt"])[:-1]
    parts = zip(
        np.split(np.asarray(packed["correct"], bool).reshape(-1, metrics.N_IOU), d_at),
        np.split(np.asarray(packed["conf"], np.float64), d_at),
        np.split(np.asarray(packed["pred_cls"], np.int64), d_at),
        np.split(np.asarray(packed["gt_cls"], np.int64), g_at),
    )
    return [ImageStats(*p) for p in parts] if len(packed["n_det"]) else []


NC = 7  # class 3 has GT but is never detected; class 6 is detected but has no GT
NEVER_DETECTED, NO_GT = 3, 6


def _random_image(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One image of integer-pixel GT and predictions built to hit COCO's corner cases.

    Integer boxes make IoUs land exactly on thresholds and make equal IoUs truly equal;
    scores on a 1/20 grid make many ties; duplicated GT boxes exercise the tie-break; several
    jittered copies of a GT compete for it; some copies change class; random false positives.
    """
    m = 0 if rng.random() < 0.15 else int(rng.integers(1, 9))
    gcls = rng.integers(0, NC - 1, m)
    xy, wh = rng.integers(0, 340, (m, 2)), rng.integers(2, 300, (m, 2))
    gboxes = np.concatenate([xy, xy + wh], 1).astype(np.float64)
    if m and rng.random() < 0.3:  # exact duplicate GT
        gboxes, gcls = np.concatenate([gboxes, gboxes[:1]]), np.concatenate([gcls, gcls[:1]])
    src = np.repeat(np.arange(len(gcls)), rng.integers(0, 4, len(gcls)))
    size = np.tile(gboxes[src, 2:] - gboxes[src, :2], 2)
    dboxes = gboxes[src] + np.round(rng.normal(0, 0.08, (len(src), 4)) * size)
    dcls = np.where(rng.random(len(src)) < 0.1, rng.integers(0, NC, len(src)), gcls[src])
    nfp = int(rng.integers(0, 6))
    fxy, fwh = rng.integers(0, 500, (nfp, 2)), rng.integers(2, 200, (nfp, 2))
    dboxes = np.concatenate([dboxes, np.concatenate([fxy, fxy + fwh], 1)])
    dcls = np.concatenate([dcls, rng.integers(0, NC, nfp)])
    dboxes[:, 2:] = np.maximum(dboxes[:, 2:], dboxes[:, :2] + 1)  # keep boxes non-degenerate
    keep = dcls != NEVER_DETECTED
    perm = rng.permutation(int(keep.sum()))
    return {
        "gt_boxes": gboxes, "gt_cls": gcls, "pred_boxes": dboxes[keep][perm],
        "pred_cls": dcls[keep][perm], "pred_scores": rng.integers(1, 21, int(keep.sum()))[perm] / 20,
    }


def random_dataset(seed: int, n_images: int = 400) -> list[dict[str, np.ndarray]]:
    """A seeded list of images (see _random_image)."""
    rng = np.random.default_rng(seed)
    return [_random_image(rng) for _ in range(n_images)]


def match_all(images: list[dict[str, np.ndarray]], max_det: int = 100) -> list[ImageStats]:
    """Per-image matching, as every val.py rank does."""
    return [match_image(**im, max_det=max_det) for im in images] if images else []


def _xywh(b: np.ndarray) -> list[float]:
    return [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]


def coco_eval(images: list[dict[str, np.ndarray]], max_det: int = 100) -> tuple[float, float, np.ndarray]:
    """pycocotools on the same data -> (mAP50, mAP50-95, per-class AP50-95 with -1 for no GT)."""
    gt: dict = {"images": [], "annotations": [], "categories": [{"id": c + 1, "name": str(c)} for c in range(NC)]}
    dets = []
    for i, im in enumerate(images, 1):  # COCOeval sorts image ids: keep them in our order
        gt["images"].append({"id": i, "width": 640, "height": 640})
        for b, c in zip(im["gt_boxes"], im["gt_cls"]):
            xywh = _xywh(b)
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": i, "category_id": int(c) + 1,
                                      "bbox": xywh, "area": xywh[2] * xywh[3], "iscrowd": 0})
        for b, c, s in zip(im["pred_boxes"], im["pred_cls"], im["pred_scores"]):
            dets.append({"image_id": i, "category_id": int(c) + 1, "bbox": _xywh(b), "score": float(s)})
    with contextlib.redirect_stdout(io.StringIO()):
        cgt = COCO()
        cgt.dataset = gt
        cgt.createIndex()
        E = COCOeval(cgt, cgt.loadRes(dets), "bbox")
        E.params.maxDets = [1, min(10, max_det), max_det]
        E.evaluate()
        E.accumulate()
    s = E.eval["precision"][:, :, :, 0, 2]  # (T, R, K) at area 'all', the largest maxDet
    per_class = np.array([s[:, :, k].mean() if (s[:, :, k] > -1).all() else -1.0 for k in range(NC)])
    return float(np.mean(s[0][s[0] > -1])), float(np.mean(s[s > -1])), per_class


@pytest.mark.parametrize("seed,max_det,scale", [(0, 100, 1.0), (1, 100, 1.0), (2, 2, 1.0), (3, 100, 1.37)])
def test_agrees_with_pycocotools(seed: int, max_det: int, scale: float) -> None:
    # scale 1.37 makes coordinates non-integer, as real predictions are
    images = [im | {"gt_boxes": im["gt_boxes"] * scale, "pred_boxes": im["pred_boxes"] * scale}
              for im in random_dataset(seed)]
    m = evaluate(match_all(images, max_det), NC)
    map50, map5095, per_class = coco_eval(images, max_det)
    assert 0.1 < m.map < 0.9  # the data is neither trivial nor hopeless
    assert abs(m.map50 - map50) < 1e-12 and abs(m.map - map5095) < 1e-12, (m.map50, map50, m.map, map5095)
    assert list(m.ap_class) == [c for c in range(NC) if per_class[c] > -1]
    np.testing.assert_allclose(m.ap[m.ap_class], per_class[m.ap_class], rtol=0, atol=1e-12)
    assert m.ap[NEVER_DETECTED] == 0.0 and NO_GT not in m.ap_class


def test_tie_break_last_gt_with_equal_iou() -> None:
    # det0 has IoU 0.818 with both GTs; COCO gives it the *last* one, leaving GT 0 for det1
    # (IoU 1.0). Taking the first GT instead would leave det1 only GT 1 at IoU 0.667.
    gt = np.array([[0, 0, 10, 10], [2, 0, 12, 10]], np.float64)
    pred = np.array([[1, 0, 11, 10], [0, 0, 10, 10]], np.float64)
    keep, correct = match_detections(pred, [0.9, 0.8], [0, 0], gt, [0, 0])
    assert keep.tolist() == [0, 1]
    assert correct[1].all()
    assert correct[0].tolist() == list(iou_thresholds() <= 9 / 11)


def test_iou_exactly_on_threshold_matches() -> None:
    # Both halves have IoU exactly 0.5 with the GT: the first takes it at t=0.5 only, the
    # second finds it taken. COCO compares with ">=", so an exact 0.5 counts.
    gt = np.array([[0, 0, 10, 10]], np.float64)
    pred = np.array([[0, 0, 10, 5], [0, 5, 10, 10]], np.float64)
    _, correct = match_detections(pred, [0.9, 0.8], [1, 1], gt, [1])
    assert correct[0].tolist() == [True] + [False] * 9 and not correct[1].any()


def test_greedy_by_score_not_by_iou() -> None:
    # The confident but worse box takes the only GT; the better box is a false positive.
    gt = np.array([[0, 0, 10, 10]], np.float64)
    pred = np.array([[0, 0, 10, 10], [0, 0, 10, 6]], np.float64)
    keep, correct = match_detections(pred, [0.5, 0.9], [0, 0], gt, [0])
    assert keep.tolist() == [1, 0]
    assert correct[0].tolist() == list(iou_thresholds() <= 0.6 + 1e-12)
    assert correct[1].tolist() == list(iou_thresholds() > 0.6 + 1e-12)  # free again where 1 failed


def test_perfect_predictions() -> None:
    images = [im | {"pred_boxes": im["gt_boxes"], "pred_cls": im["gt_cls"],
                    "pred_scores": np.linspace(0.5, 1.0, len(im["gt_cls"]))} for im in random_dataset(3, 50)]
    m = evaluate(match_all(images), NC)
    assert m.map50 == pytest.approx(1.0, abs=1e-12) and m.map == pytest.approx(1.0, abs=1e-12)
    assert m.mp == pytest.approx(1.0) and m.mr == pytest.approx(1.0)
    assert m.n_images == 50 and m.n_instances == sum(len(im["gt_cls"]) for im in images)
    assert m.fitness() == pytest.approx(1.0)


def test_confusion_matrix_diagonal_for_perfect_predictions() -> None:
    rng = np.random.default_rng(9)
    cm, counts = ConfusionMatrix(NC), np.zeros(NC, np.int64)
    for _ in range(20):  # boxes in separate cells of a grid: the class-agnostic pairing is unambiguous
        cells = rng.permutation(16)[: rng.integers(0, 8)]
        boxes = np.c_[cells % 4 * 100, cells // 4 * 100, cells % 4 * 100 + 80, cells // 4 * 100 + 60]
        cls = rng.integers(0, NC, len(cells))
        cm.process_image(np.c_[boxes, np.full(len(cells), 0.9), cls], boxes, cls)
        counts += np.bincount(cls, minlength=NC)
    np.testing.assert_array_equal(cm.matrix, np.diag(np.r_[counts, 0]))


def test_no_predictions() -> None:
    images = [im | {"pred_boxes": np.zeros((0, 4)), "pred_cls": np.zeros(0), "pred_scores": np.zeros(0)}
              for im in random_dataset(4, 30)]
    m = evaluate(match_all(images), NC)
    assert (m.map50, m.map, m.mp, m.mr) == (0.0, 0.0, 0.0, 0.0)
    assert len(m.ap_class) > 0
    assert evaluate([], NC).map == 0.0  # nothing at all: zeros, no crash


def test_detection_of_class_without_gt_changes_nothing() -> None:
    images = random_dataset(5, 100)
    base = evaluate(match_all(images), NC).as_dict()
    extra = [im | {"pred_boxes": np.r_[im["pred_boxes"], [[0, 0, 50, 50]]], "pred_cls": np.r_[im["pred_cls"], NO_GT],
                   "pred_scores": np.r_[im["pred_scores"], 0.99]} for im in images]
    assert evaluate(match_all(extra), NC).as_dict() == base


def test_identical_floats_whatever_the_sharding() -> None:
    images = random_dataset(6, 120)
    stats = match_all(images)
    ref = evaluate(stats, NC).as_dict()
    assert evaluate(match_all(images), NC).as_dict() == ref
    # contiguous shards per rank, each packed to flat arrays, gathered in rank order
    shards = [pack_stats(match_all(images[a:b])) for a, b in [(0, 37), (37, 37), (37, 90), (90, 120)]]
    gathered = [s for sh in shards for s in unpack_stats(sh)]
    assert evaluate(gathered, NC).as_dict() == ref
    # interleaved shards put back into image order
    ws = 3
    parts = [match_all(images[r::ws]) for r in range(ws)]
    restored = [parts[i % ws][i // ws] for i in range(len(images))]
    assert evaluate(restored, NC).as_dict() == ref


def test_max_det_per_class_keeps_the_best_scores() -> None:
    rng = np.random.default_rng(7)
    boxes = np.c_[rng.integers(0, 100, (15, 2)), rng.integers(100, 200, (15, 2))]
    cls, scores = np.array([0] * 10 + [1] * 5), rng.permutation(15) / 15
    st = match_image(boxes, scores, cls, boxes[:2], [0, 1], max_det=3)
    assert len(st.conf) == 6 and np.all(np.diff(st.conf) <= 0)
    for c in (0, 1):
        assert sorted(st.conf[st.pred_cls == c]) == sorted(scores[cls == c])[-3:]


def test_torch_inputs_and_plain_dict() -> None:
    im = random_dataset(8, 1)[0] | {"gt_boxes": np.array([[0, 0, 9, 9]]), "gt_cls": np.array([2])}
    im["pred_boxes"] = np.r_[im["pred_boxes"], [[0, 0, 9, 9]]]
    im["pred_cls"], im["pred_scores"] = np.r_[im["pred_cls"], 2], np.r_[im["pred_scores"], 0.3]
    a = match_image(**{k: v.astype(np.float32) for k, v in im.items()})  # what a float32 model gives
    b = match_image(**{k: torch.as_tensor(v, dtype=torch.float32) for k, v in im.items()})
    for f in ("correct", "conf", "pred_cls", "gt_cls"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    d = evaluate([a], NC, names={i: f"c{i}" for i in range(NC)}).as_dict()
    assert d["ap_class"] == [2] and d["map50"] > 0  # its only GT is found
    assert json.loads(json.dumps(d)) == d and d["names"][2] == "c2"
    assert DetectionMetrics.from_dict(d).as_dict() == d


def test_confusion_matrix_counts_misses_and_false_alarms() -> None:
    cm = ConfusionMatrix(3, conf=0.25, iou_thres=0.45)
    gt, gcls = np.array([[0, 0, 10, 10], [50, 50, 60, 60], [100, 100, 110, 110]]), np.array([0, 1, 2])
    det = np.array([[0, 0, 10, 10, 0.9, 0], [50, 50, 60, 60, 0.8, 2], [200, 200, 210, 210, 0.7, 1],
                    [100, 100, 110, 110, 0.1, 2]])  # correct, confused, false alarm, below conf
    cm.process_image(det, gt, gcls)
    expected = np.zeros((4, 4), np.int64)
    expected[0, 0] = expected[2, 1] = expected[3, 2] = expected[1, 3] = 1
    np.testing.assert_array_equal(cm.matrix, expected)
    tp, fp = cm.tp_fp()
    assert tp.tolist() == [1, 0, 0] and fp.tolist() == [0, 1, 1]
