"""AutoAnchor: BPR measurement, k-means + evolution, and replacing a model's anchors safely."""
from __future__ import annotations

import copy
import logging
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from yolotrain.models.heads.anchor import resample_anchors
from yolotrain.models.yolo import Model
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.engine import autoanchor
from yolotrain.utils.engine.autoanchor import (
    AnchorFit,
    anchor_metrics,
    anchors_per_level,
    check_anchors,
    kmean_anchors,
    label_wh,
    model_anchors_px,
    set_anchors,
)
from yolotrain.utils.core.errors import UserError

MODELS = Path(__file__).resolve().parents[1] / "models"
COCO_ANCHORS = [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
COCO_PX = np.array(COCO_ANCHORS, dtype=np.float64).reshape(3, 3, 2)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base_model() -> Model:
    torch.manual_seed(0)
    return Model(MODELS / "yolov5n.yaml", nc=3)


@pytest.fixture()
def model(base_model: Model) -> Model:
    """A fresh copy per test, since check_anchors edits the model in place."""
    return copy.deepcopy(base_model)


def fake_dataset(kind: str, n_img: int = 200, seed: int = 0) -> types.SimpleNamespace:
    """LoadImagesAndLabels stand-in: normalised labels and (h, w) image_hw of 640x480 / 480x640 images.

    coco: sizes log-uniform 16-400 px, aspect ratios around 1 (COCO anchors cover these).
    elongated: 12:1 and 1:12 boxes, long side 200-600 px (far outside COCO anchors' reach).
    """
    rng = np.random.default_rng(seed)
    labels, image_hw = [], []
    for i in range(n_img):
        w, h = (640, 480) if i % 2 else (480, 640)
        m = 6
        if kind == "coco":
            side = np.exp(rng.uniform(np.log(16), np.log(400), m))
            ar = np.exp(rng.normal(0, 0.45, m))
            bw, bh = side * np.sqrt(ar), side / np.sqrt(ar)
        else:
            long = rng.uniform(200, 600, m)
            flip = rng.random(m) < 0.5
            bw, bh = np.where(flip, long, long / 12), np.where(flip, long / 12, long)
        bw, bh = np.minimum(bw, 0.99 * w), np.minimum(bh, 0.99 * h)
        cls = rng.integers(0, 3, m)
        labels.append(np.c_[cls, np.full(m, 0.5), np.full(m, 0.5), bw / w, bh / h].astype(np.float32))
        image_hw.append((h, w))
    return types.SimpleNamespace(labels=labels, image_hw=np.array(image_hw, dtype=np.int32), img_size=640)


# ----------------------------------------------------------------------------------------------
# label sizes and metrics


def test_label_wh_scales_long_side_and_drops_tiny_boxes(caplog):
    ds = types.SimpleNamespace(
        labels=[
            np.array([[0, 0.5, 0.5, 0.5, 0.5], [1, 0.5, 0.5, 0.001, 0.001], [0, 0.5, 0.5, 0.004, 0.001]], np.float32),
            np.array([[2, 0.5, 0.5, 0.25, 1.0]], np.float32),
        ],
        image_hw=np.array([[500, 1000], [640, 320]]),
    )
    with caplog.at_level(logging.WARNING, logger="yolotrain"):
        wh = label_wh(ds, 640)
    # image 0: 1000x500 -> 640x320; image 1: 320x640 -> 320x640
    # the 0.64x0.32 px box is dropped (both sides < 2); 2.56x0.32 px is kept (one side >= 2)
    np.testing.assert_allclose(wh, [[320, 160], [2.56, 0.32], [80, 640]], rtol=1e-6)
    assert "2 of 4 labels" in caplog.text  # both tiny boxes are reported as under 3 px


def test_anchor_metrics_counts_labels_within_thr_on_both_sides():
    anchors = np.array([[10, 10], [100, 100]])
    wh = np.array([[10, 10],  # both anchors? 100/10 = 10 > 4: only the first
                   [30, 30],  # 3x the first, 1/3.3 of the second: both
                   [100, 5],  # w fits the second, h 20x off: none
                   [45, 12]])  # w 4.5x the first: none; h 8.3x off the second: none
    fit = anchor_metrics(anchors, wh, thr=4.0)
    assert isinstance(fit, AnchorFit)
    assert fit.bpr == pytest.approx(2 / 4)
    assert fit.aat == pytest.approx((1 + 2 + 0 + 0) / 4)


# ----------------------------------------------------------------------------------------------
# check_anchors


def test_good_anchors_are_left_alone(model: Model, caplog):
    before = model.detect.anchors.clone()
    yaml_before = copy.deepcopy(model.yaml)
    with caplog.at_level(logging.INFO, logger="yolotrain"):
        res = check_anchors(fake_dataset("coco"), model, thr=4.0, imgsz=640)
    assert res.bpr_before >= 0.98 and res.bpr_after == res.bpr_before
    assert not res.replaced
    assert torch.equal(model.detect.anchors, before)
    assert model.yaml == yaml_before
    np.testing.assert_array_equal(np.array(res.anchors_px), np.array(COCO_ANCHORS, dtype=float))
    assert "Best Possible Recall (BPR). Current anchors are a good fit to dataset" in caplog.text


def test_bad_anchors_are_replaced_in_grid_units_and_yaml(model: Model, caplog):
    with caplog.at_level(logging.INFO, logger="yolotrain"):
        res = check_anchors(fake_dataset("elongated"), model, thr=4.0, imgsz=640)
    assert res.bpr_before < 0.9  # COCO anchors cannot reach 12:1 boxes at thr=4
    assert res.replaced and res.bpr_after > res.bpr_before and res.bpr_after >= 0.98
    assert "computing new anchors" in caplog.text
    det = model.detect
    px = np.array(res.anchors_px, dtype=np.float64).reshape(det.nl, det.na, 2)
    # buffer holds grid units: pixels / stride, per level
    expected = torch.tensor(px, dtype=torch.float32) / det.stride.view(-1, 1, 1)
    torch.testing.assert_close(det.anchors, expected, rtol=0, atol=0)
    np.testing.assert_allclose(model_anchors_px(model), px, rtol=1e-6)
    # levels go small -> large like the strides, and the anchors are sorted by area within them
    area = px.prod(-1).reshape(-1)
    assert np.all(np.diff(area) >= 0)
    # elongated anchors now, both orientations
    ratio = px[..., 0] / px[..., 1]
    assert ratio.max() > 6 and ratio.min() < 1 / 6
    # yaml: plain Python floats, 2 decimals, the same pairs
    assert model.yaml["anchors"] == res.anchors_px
    assert all(type(v) is float and round(v, 2) == v for level in model.yaml["anchors"] for v in level)
    # the measurement agrees when recomputed independently
    assert anchor_metrics(px.reshape(-1, 2), label_wh(fake_dataset("elongated"), 640)).bpr >= 0.98


def test_worse_new_anchors_are_not_applied(model: Model, monkeypatch, caplog):
    """Re-fitting is only worth it if it helps: a worse result keeps the original anchors."""
    monkeypatch.setattr(autoanchor, "kmean_anchors", lambda *a, **k: np.full((9, 2), 5000.0))
    before = model.detect.anchors.clone()
    with caplog.at_level(logging.INFO, logger="yolotrain"):
        res = check_anchors(fake_dataset("elongated"), model)
    assert not res.replaced and res.bpr_after == res.bpr_before < 0.98
    assert torch.equal(model.detect.anchors, before)
    assert model.yaml["anchors"] == COCO_ANCHORS
    assert "original anchors" in caplog.text


def test_check_anchors_is_deterministic(base_model: Model):
    ds = fake_dataset("elongated")
    a, b = copy.deepcopy(base_model), copy.deepcopy(base_model)
    ra, rb = check_anchors(ds, a, seed=3), check_anchors(ds, b, seed=3)
    assert ra == rb
    assert torch.equal(a.detect.anchors, b.detect.anchors)
    wh = label_wh(ds, 640)
    k1, k2 = kmean_anchors(wh, n=9, gen=200, seed=5), kmean_anchors(wh, n=9, gen=200, seed=5)
    np.testing.assert_array_equal(k1, k2)
    assert not np.array_equal(k1, kmean_anchors(wh, n=9, gen=200, seed=6))


def test_global_rng_is_untouched(model: Model):
    np.random.seed(123)
    torch.manual_seed(123)
    expect_np, expect_torch = np.random.random(), torch.rand(1)
    np.random.seed(123)
    torch.manual_seed(123)
    check_anchors(fake_dataset("elongated", n_img=40), model)
    assert np.random.random() == expect_np and torch.equal(torch.rand(1), expect_torch)


def test_forward_and_loss_use_new_anchors(model: Model):
    ds = fake_dataset("elongated", n_img=8, seed=1)
    img = 256
    # targets (image, cls, xc, yc, w, h) normalised to a square img x img input
    rows = []
    for i, (lb, (h, w)) in enumerate(zip(ds.labels, ds.image_hw)):
        s = img / max(w, h)
        for c, _, _, bw, bh in lb:
            rows.append([i % 2, c, 0.5, 0.5, bw * w * s / img, bh * h * s / img])
    targets = torch.tensor(rows, dtype=torch.float32)
    loss_fn = model.detect.build_criterion(Hyp(), imgsz=640)  # built before the change: must still see new anchors
    preds = model.train()(torch.zeros(2, 3, img, img))
    n_before = sum(len(b) for b, *_ in loss_fn.build_targets(preds, targets)[2])

    res = check_anchors(ds, model, imgsz=img)
    assert res.replaced
    preds = model(torch.zeros(2, 3, img, img))
    tcls, tbox, indices, anch = loss_fn.build_targets(preds, targets)
    n_after = sum(len(b) for b, *_ in indices)
    assert n_after > n_before  # elongated targets now find anchors
    for i, (b, a, gj, gi) in enumerate(indices):  # matched anchors are the new buffer's rows
        torch.testing.assert_close(anch[i], model.detect.anchors[i][a], rtol=0, atol=0)
    loss, items = loss_fn(preds, targets)
    assert torch.isfinite(loss).all() and torch.isfinite(items).all()
    model.eval()
    with torch.no_grad():
        out, _ = model(torch.zeros(1, 3, img, img))
    assert torch.isfinite(out).all()


def test_rebuild_from_yaml_gives_identical_anchors(model: Model):
    check_anchors(fake_dataset("elongated"), model)
    rebuilt = Model(copy.deepcopy(model.yaml))  # anchors from the yaml alone, no state_dict
    assert torch.equal(rebuilt.detect.anchors, model.detect.anchors)
    rebuilt.load_state_dict(model.state_dict())
    assert torch.equal(rebuilt.detect.anchors, model.detect.anchors)


def test_set_anchors_applies_a_broadcast_result(base_model: Model):
    """What the other ranks do: apply rank 0's anchors_px and end up with the same model."""
    rank0, other = copy.deepcopy(base_model), copy.deepcopy(base_model)
    res = check_anchors(fake_dataset("elongated"), rank0)
    set_anchors(other, res.anchors_px)
    assert torch.equal(other.detect.anchors, rank0.detect.anchors)
    assert other.yaml == rank0.yaml


def test_set_anchors_accepts_pairs_and_fixes_reversed_order(model: Model):
    reversed_px = COCO_PX.reshape(-1, 2)[::-1]  # (9, 2) large -> small
    set_anchors(model, reversed_px)
    # the levels are flipped (as Model.__init__ does) so the largest anchors sit on the largest stride
    assert model.detect.anchors[0].prod(-1).mean() < model.detect.anchors[-1].prod(-1).mean()
    assert model.yaml["anchors"][0] == [33.0, 23.0, 16.0, 30.0, 10.0, 13.0]
    assert model.yaml["anchors"][2] == [373.0, 326.0, 156.0, 198.0, 116.0, 90.0]
    assert torch.equal(Model(copy.deepcopy(model.yaml)).detect.anchors, model.detect.anchors)
    with pytest.raises(ValueError, match="anchor pairs"):
        set_anchors(model, [[10, 13, 16, 30]])


def test_set_anchors_updates_explicit_detect_row_anchors(base_model: Model):
    d = copy.deepcopy(base_model.yaml)
    d["head"][-1][3] = ["nc", COCO_ANCHORS]  # anchors written on the Detect row itself
    m = Model(d)
    new = (COCO_PX * 1.5).reshape(3, 6)
    set_anchors(m, new)
    assert m.yaml["head"][-1][3][1] == m.yaml["anchors"]
    assert torch.equal(Model(copy.deepcopy(m.yaml)).detect.anchors, m.detect.anchors)


def test_no_labels_keeps_anchors_with_a_warning(model: Model, caplog):
    before = model.detect.anchors.clone()
    ds = types.SimpleNamespace(labels=[np.zeros((0, 5), np.float32)] * 3, image_hw=np.array([[480, 640]] * 3))
    with caplog.at_level(logging.WARNING, logger="yolotrain"):
        res = check_anchors(ds, model)
    assert not res.replaced and math.isnan(res.bpr_before)
    assert torch.equal(model.detect.anchors, before)
    assert "no labels" in caplog.text


# ----------------------------------------------------------------------------------------------
# kmean_anchors


def test_kmean_anchors_sorted_and_better_than_coco():
    wh = label_wh(fake_dataset("elongated", n_img=60), 640)
    k = kmean_anchors(wh, n=9, gen=300, seed=0)
    assert k.shape == (9, 2) and np.all(k >= 2.0)
    assert np.all(np.diff(k.prod(1)) >= 0)
    assert anchor_metrics(k, wh).bpr > anchor_metrics(COCO_PX.reshape(-1, 2), wh).bpr


def test_kmean_anchors_with_too_few_points_falls_back(caplog):
    wh = np.array([[20.0, 30.0], [20.0, 30.0], [100.0, 60.0]])
    with caplog.at_level(logging.WARNING, logger="yolotrain"):
        k = kmean_anchors(wh, n=9, gen=50, seed=0)
    assert k.shape == (9, 2) and np.isfinite(k).all()
    assert "random init" in caplog.text
    with pytest.raises(ValueError):
        kmean_anchors(np.zeros((0, 2)), n=9)


# ----------------------------------------------------------------------------------------------
# YOLOv5's hyp 'anchors' (anchors per level, fitted by autoanchor)


def test_hyp_anchors_count_builds_and_fits_that_many_per_level(caplog):
    """hyp.VOC.yaml-style 'anchors: 3.63': 4 anchors per level, placeholders until fitted."""
    na = anchors_per_level(3.63, "hyp.yaml", noautoanchor=False)
    assert na == 4
    torch.manual_seed(0)
    model = Model(MODELS / "yolov5n.yaml", nc=3, na=na)
    det = model.detect
    assert det.na == 4 and det.anchors.shape == (3, 4, 2)
    assert all(conv.out_channels == 4 * (3 + 5) for conv in det.m)
    assert torch.equal(det.stride, torch.tensor([8.0, 16.0, 32.0]))
    placeholders = model_anchors_px(model)
    # each level's placeholders span that level's yaml anchors, small to large
    np.testing.assert_allclose(placeholders[:, 0], COCO_PX[:, 0], rtol=1e-6)
    np.testing.assert_allclose(placeholders[:, -1], COCO_PX[:, -1], rtol=1e-6)

    ds = fake_dataset("coco")
    with caplog.at_level(logging.INFO, logger="yolotrain"):
        res = check_anchors(ds, model, thr=4.0, imgsz=640, force=True)
    assert "asks for 4 anchors per level" in caplog.text  # fitted although the BPR was already good
    assert res.replaced and res.bpr_after >= res.bpr_before
    px = np.array(res.anchors_px, dtype=np.float64)
    assert px.shape == (3, 8)
    assert not np.allclose(px.reshape(3, 4, 2), placeholders)
    np.testing.assert_allclose(model_anchors_px(model), px.reshape(3, 4, 2), rtol=1e-6)
    assert model.yaml["anchors"] == res.anchors_px
    assert torch.equal(Model(copy.deepcopy(model.yaml)).detect.anchors, det.anchors)  # checkpoint rebuild
    loss, items = model.detect.build_criterion(Hyp(), imgsz=640)(model.train()(torch.zeros(1, 3, 128, 128)),
                                                torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.2]]))
    assert torch.isfinite(loss).all()


def test_hyp_anchors_without_autoanchor_is_refused():
    assert anchors_per_level(0.0, "h.yaml", noautoanchor=True) is None  # 0: the model yaml's anchors
    with pytest.raises(UserError, match=r"h\.yaml: 'anchors: 3\.412' asks for 3 anchors per level.*--noautoanchor"):
        anchors_per_level(3.412, "h.yaml", noautoanchor=True)


def test_forced_fit_with_no_labels_keeps_the_placeholders(caplog):
    model = Model(MODELS / "yolov5n.yaml", nc=3, na=2)
    before = model.detect.anchors.clone()
    ds = types.SimpleNamespace(labels=[np.zeros((0, 5), np.float32)] * 2, image_hw=np.array([[480, 640]] * 2))
    with caplog.at_level(logging.WARNING, logger="yolotrain"):
        res = check_anchors(ds, model, force=True)
    assert not res.replaced and torch.equal(model.detect.anchors, before)
    assert "placeholder anchors" in caplog.text


def test_resample_anchors_is_geometric_per_level():
    assert resample_anchors(COCO_ANCHORS, 3) == [[float(v) for v in level] for level in COCO_ANCHORS]
    one = resample_anchors([[10, 40]], 3)[0]
    assert one == [5.0, 20.0, 10.0, 40.0, 20.0, 80.0]  # a single anchor spans half to twice itself
    mid = resample_anchors([[10, 10, 40, 40]], 3)[0]
    assert mid == [10.0, 10.0, 20.0, 20.0, 40.0, 40.0]  # the geometric middle, not the arithmetic one
    assert resample_anchors([[10, 10, 40, 40]], 1) == [[20.0, 20.0]]
