"""utils.core.boxes NMS: what it keeps, and that a batch on several threads equals each image alone."""
from __future__ import annotations

import torch

from utils.core.boxes import non_max_suppression


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
