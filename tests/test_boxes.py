"""yolotrain.utils.core.boxes NMS: what it keeps, and that a batch on several threads equals each image alone."""
from __future__ import annotations

import torch

from yolotrain.utils.core.boxes import non_max_suppression


def _raw(rows: list[list[float]]) -> torch.Tensor:
    """Anchor-head rows [xc, yc, w, h, obj, cls0, cls1] of one image, decoded as the head does it:
    (1, n, 6) of box and obj x class scores (models/heads/anchor.py)."""
    return _decoded(torch.tensor(rows, dtype=torch.float32)[None])


def _decoded(t: torch.Tensor) -> torch.Tensor:
    """[..., xywh, obj, classes] -> [..., xywh, obj * classes], the heads' common output form."""
    return torch.cat((t[..., :4], t[..., 5:] * t[..., 4:5]), -1)


def test_overlapping_boxes_of_one_class_keep_the_most_confident_and_other_classes_survive():
    pred = _raw([
        [50, 50, 20, 20, 0.9, 1.0, 0.0],  # kept: best of class 0
        [51, 50, 20, 20, 0.8, 1.0, 0.0],  # IoU ~0.9 with the first, same class: suppressed
        [51, 50, 20, 20, 0.7, 0.0, 1.0],  # same place, class 1: kept
        [150, 150, 10, 10, 0.6, 1.0, 0.0],  # far away: kept
        [10, 10, 5, 5, 0.0005, 1.0, 0.0],  # objectness under conf_thres: never a candidate
    ])
    (det,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6)
    assert det[:, 4].tolist() == torch.tensor([0.9, 0.7, 0.6]).tolist()
    assert det[:, 5].tolist() == [0.0, 1.0, 0.0]
    assert torch.allclose(det[0, :4], torch.tensor([40.0, 40.0, 60.0, 60.0]))
    (agnostic,) = non_max_suppression(pred, conf_thres=0.001, iou_thres=0.6, agnostic=True)
    assert agnostic[:, 4].tolist() == torch.tensor([0.9, 0.6]).tolist()


def test_multi_label_keeps_every_class_above_the_threshold_and_max_det_caps():
    pred = _raw([[50, 50, 20, 20, 1.0, 0.5, 0.4], [150, 50, 20, 20, 1.0, 0.3, 0.0]])
    (multi,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.6, multi_label=True)
    assert sorted(multi[:, 4].tolist()) == torch.tensor([0.3, 0.4, 0.5]).sort().values.tolist()
    (single,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.6, multi_label=False)
    assert single[:, 5].tolist() == [0.0, 0.0]
    (capped,) = non_max_suppression(pred, conf_thres=0.25, iou_thres=0.6, multi_label=True, max_det=2)
    assert capped[:, 4].tolist() == torch.tensor([0.5, 0.4]).tolist()


def test_a_batch_on_threads_equals_each_image_alone_on_one_thread():
    g = torch.Generator().manual_seed(0)
    bs, n, nc = 6, 3000, 5
    xy = torch.rand(bs, n, 2, generator=g) * 300
    wh = torch.rand(bs, n, 2, generator=g) * 60 + 2
    conf = torch.rand(bs, n, 1 + nc, generator=g) ** 3
    pred = torch.cat((xy, wh, conf), 2)
    pred[2, :, 4] = 0  # an image without candidates
    pred[3, :400, 4:] = 0.5  # ties in score
    pred = _decoded(pred)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(threads, 2))
        batch = non_max_suppression(pred, 0.001, 0.6, multi_label=True)
        torch.set_num_threads(1)
        alone = [non_max_suppression(pred[i:i + 1], 0.001, 0.6, multi_label=True)[0] for i in range(bs)]
    finally:
        torch.set_num_threads(threads)
    assert [d.shape[0] for d in batch][2] == 0 and all(d.shape[0] == 300 for i, d in enumerate(batch) if i != 2)
    for b, a in zip(batch, alone):
        assert torch.equal(b, a)


def test_nms_leaves_no_threads_behind():
    """Live idle threads that once ran torch ops make libgomp stop spinning: later ops slow down."""
    import threading

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        pred = _decoded(torch.cat((torch.rand(4, 500, 4) * 100, torch.rand(4, 500, 3)), 2))
        non_max_suppression(pred, 0.001, 0.6, multi_label=True)
    finally:
        torch.set_num_threads(threads)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("nms")]


# ------------------------------------------------------------- the same detections whatever the device

def _boxes(rows: list[list[float]]) -> torch.Tensor:
    """Rows [x1, y1, x2, y2, score per class] of one image -> decoded head output (1, n, 4 + nc)."""
    t = torch.tensor(rows, dtype=torch.float32)
    xyxy = t[:, :4]
    return torch.cat(((xyxy[:, :2] + xyxy[:, 2:]) / 2, xyxy[:, 2:] - xyxy[:, :2], t[:, 4:]), 1)[None]


def _reference(pred: torch.Tensor, conf: float, iou: str, multi_label: bool, agnostic: bool = False,
               max_det: int = 300, max_nms: int = 30000) -> torch.Tensor:
    """Greedy NMS written out for one image's (n, 4 + nc) rows of integer boxes: the candidates (a row's
    classes in class order) sorted by score, equal scores by row, cut to max_nms; each is kept unless a kept
    one of its class overlaps it with IoU > iou (exact fractions; ``iou`` a decimal string)."""
    from fractions import Fraction

    limit, candidates = Fraction(iou), []
    for xc, yc, w, h, *scores in pred.tolist():
        box = (xc - w / 2, yc - h / 2, xc + w / 2, yc + h / 2)
        if multi_label:
            candidates += [(box, s, c) for c, s in enumerate(scores) if s > conf]
        elif max(scores) > conf:
            candidates.append((box, max(scores), scores.index(max(scores))))
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][1], i))[:max_nms]

    def overlap(a, b) -> Fraction:
        inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
        return Fraction(int(inter), int(union)) if union else Fraction(0)

    kept, by_class = [], {}
    for i in order:
        box, score, c = candidates[i]
        same = by_class.setdefault(0 if agnostic else c, [])
        if all(overlap(box, k) <= limit for k in same):
            same.append(box)
            kept.append([*box, score, float(c)])
    return torch.tensor(kept[:max_det], dtype=torch.float32).view(-1, 6)


def _integer_pred(g: torch.Generator, n: int, nc: int, levels: int, low: int = 0) -> torch.Tensor:
    """(1, n, 4 + nc): integer centres in [low, 200), even sizes (exact corners), scores in 1/levels steps
    (many equal scores)."""
    xy = torch.randint(low, 200, (n, 2), generator=g).float()
    wh = torch.randint(2, 31, (n, 2), generator=g).float() * 2
    scores = torch.randint(0, levels + 1, (n, nc), generator=g).float() / levels
    return torch.cat((xy, wh, scores), 1)[None]


def test_equal_scores_keep_the_first_row_and_come_out_in_row_order():
    a, b = [0, 0, 20, 20, 0.5, 0.0], [1, 0, 21, 20, 0.5, 0.0]  # IoU 0.9, one class, one score
    assert non_max_suppression(_boxes([a, b]), 0.25, 0.6)[0][:, :4].tolist() == [a[:4]]
    assert non_max_suppression(_boxes([b, a]), 0.25, 0.6)[0][:, :4].tolist() == [b[:4]]
    # 1500 apart boxes (more than torchvision's CPU switch to a loop over classes), 3 scores, 2 classes
    g = torch.Generator().manual_seed(1)
    n = 1500
    rows = torch.zeros(n, 6)
    rows[:, 0] = torch.arange(n) * 10.0
    rows[:, 2], rows[:, 3] = rows[:, 0] + 8, 8.0
    score = torch.tensor([0.5, 0.75, 1.0])[torch.randint(0, 3, (n,), generator=g)]
    cls = torch.randint(0, 2, (n,), generator=g)
    rows[torch.arange(n), 4 + cls] = score
    (det,) = non_max_suppression(_boxes(rows.tolist()), 0.25, 0.6, max_det=n)
    expected = torch.sort(score, descending=True, stable=True).indices
    assert torch.equal(det[:, 0], rows[expected, 0]) and torch.equal(det[:, 5], cls[expected].float())
    # the max_nms cut among equal scores keeps the first rows
    (cut,) = non_max_suppression(_boxes(rows.tolist()), 0.25, 0.6, max_det=n, max_nms=700)
    assert torch.equal(cut[:, 0], rows[expected[:700], 0])


def test_the_result_does_not_depend_on_the_order_of_rows():
    """Distinct scores: any permutation of the rows gives the same detections (with equal scores only the
    order among them would change, as the reference test checks)."""
    g = torch.Generator().manual_seed(2)
    for n, multi_label in ((600, False), (3000, False), (1000, True)):
        xy = torch.rand(n, 2, generator=g) * 300
        wh = torch.rand(n, 2, generator=g) * 80 + 4
        scores = torch.randperm(n * 4, generator=g).float().view(n, 4) / (n * 4)  # no two alike
        pred = torch.cat((xy, wh, scores), 1)[None]
        (base,) = non_max_suppression(pred, 0.25, 0.5, multi_label=multi_label, max_det=10 ** 6)
        assert len(base) > 300
        for _ in range(2):
            (shuffled,) = non_max_suppression(pred[:, torch.randperm(n, generator=g)], 0.25, 0.5,
                                              multi_label=multi_label, max_det=10 ** 6)
            assert torch.equal(shuffled, base)


def test_nms_equals_a_plain_greedy_reference():
    """Random integer boxes (some with negative corners) and scores with many ties, below and above 1000
    candidates, single and multi-label, class-aware and agnostic, with max_nms and max_det cuts."""
    g = torch.Generator().manual_seed(3)
    cases = [  # n, nc, levels, low, multi_label, agnostic, max_nms, max_det, iou
        (300, 3, 8, 0, False, False, 30000, 10 ** 6, "0.45"),
        (400, 4, 4, 30, True, False, 30000, 10 ** 6, "0.6"),  # no negative corner: torchvision's offsets
        (1500, 4, 8, 0, False, False, 30000, 10 ** 6, "0.6"),
        (1200, 3, 8, 0, True, False, 2000, 10 ** 6, "0.45"),
        (1500, 3, 16, 0, False, True, 30000, 300, "0.5"),
        (800, 5, 4, 0, True, True, 1500, 10 ** 6, "0.7"),
    ]
    for n, nc, levels, low, multi_label, agnostic, max_nms, max_det, iou in cases:
        pred = _integer_pred(g, n, nc, levels, low)
        (det,) = non_max_suppression(pred, 0.25, float(iou), multi_label=multi_label, agnostic=agnostic,
                                     max_det=max_det, max_nms=max_nms)
        ref = _reference(pred[0], 0.25, iou, multi_label, agnostic, max_det, max_nms)
        assert len(ref) > 50 and torch.equal(det, ref), (n, multi_label, agnostic)


def test_boxes_with_negative_corners_do_not_suppress_another_class():
    """torchvision's coordinate trick shifts class c by c * (max + 1): a class-1 box reaching below -1
    would land on class 0's boxes near the maximum."""
    rows = [[600, 600, 640, 640, 0.9, 0.0], [-35, -35, 5, 5, 0.0, 0.8]]
    (det,) = non_max_suppression(_boxes(rows), 0.25, 0.45)
    assert det[:, 5].tolist() == [0.0, 1.0]


def test_an_iou_equal_to_the_threshold_does_not_suppress():
    """IoU exactly 0.6 (60 / 100) is not above 0.6; float32's 0.6 is above 0.6, so the comparison is made
    in float32 throughout (as the CUDA kernel makes it)."""
    rows = [[0, 0, 10, 10, 0.9, 0.0], [0, 0, 10, 6, 0.8, 0.0]]
    assert len(non_max_suppression(_boxes(rows), 0.25, 0.6)[0]) == 2
    assert len(non_max_suppression(_boxes(rows), 0.25, 0.59)[0]) == 1


def test_one_nms_call_keeps_the_rows_that_one_call_per_class_keeps(monkeypatch):
    """Above ONE_NMS_CALL_MAX boxes NMS runs class by class on the shifted boxes (the CPU above 1000, CUDA
    above 25000), below it in one call: both keep the same rows, so every device gives the same detections."""
    from yolotrain.utils.core import boxes

    g = torch.Generator().manual_seed(4)
    xy = torch.rand(2, 4000, 2, generator=g) * 600 - 20  # negative corners too
    wh = torch.rand(2, 4000, 2, generator=g) * 100 + 2
    scores = (torch.rand(2, 4000, 6, generator=g) * 16).floor() / 16
    pred = torch.cat((xy, wh, scores), 2)
    for kw in (dict(multi_label=True), dict(multi_label=False), dict(multi_label=True, agnostic=True)):
        per_class = non_max_suppression(pred, 0.25, 0.5, max_det=10 ** 6, **kw)
        monkeypatch.setitem(boxes.ONE_NMS_CALL_MAX, "cpu", 10 ** 9)
        one_call = non_max_suppression(pred, 0.25, 0.5, max_det=10 ** 6, **kw)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(per_class, one_call)), kw
