"""YOLO26 (models/yolo26.yaml, the end-to-end head of models/heads/e2e.py): sizes equal to Ultralytics
8.4.190's, both branches' outputs in train and eval, the NMS-free top-k, fusion, and import.

The reference figures were measured with Ultralytics 8.4.190 (``DetectionModel("yolo26?.yaml")``,
unfused parameters, ``get_flops(model, 640)`` = thop 2 x MACs): see docs/training.md's model table.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from yolotrain.models.blocks import SPPF
from yolotrain.models.heads.e2e import E2EDetect, topk_dets
from yolotrain.models.parse import load_model_yaml
from yolotrain.models.registry import head_class
from yolotrain.models.yolo import Model
from yolotrain.utils.core.errors import UserError
from tests.helpers import assert_fused_copy_matches

ULTRALYTICS = {  # scale: (parameters at nc=80, GFLOPs at 640)
    "n": (2_572_280, 6.24), "s": (10_009_784, 23.08), "m": (21_896_248, 75.64),
    "l": (26_299_704, 94.16), "x": (58_993_368, 210.07),
}
NC = 5


@pytest.fixture(scope="module")
def n_model() -> Model:
    torch.manual_seed(0)
    m = Model("yolo26n.yaml", nc=NC)
    for mod in m.modules():  # BN statistics that are not the init values, so fusion is really tested
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


@pytest.mark.parametrize("scale", list(ULTRALYTICS))
def test_parameters_and_gflops_equal_ultralytics(scale):
    params, gflops = ULTRALYTICS[scale]
    info = Model(f"yolo26{scale}.yaml").info(640)
    assert info.parameters == params
    assert info.gflops == pytest.approx(gflops, rel=0.01)


def test_yaml_keys_pick_the_end_to_end_head():
    d, _ = load_model_yaml("yolo26n.yaml")
    assert d["end2end"] is True and d["reg_max"] == 1 and d["scale"] == "n"
    assert head_class(d) is E2EDetect
    assert head_class({**d, "end2end": False}).__name__ == "Detect"  # our anchor head: a YOLOv5 yaml is unchanged
    with pytest.raises(UserError, match="'end2end' must be true or false"):
        Model({**d, "end2end": "yes"})
    with pytest.raises(UserError, match="'reg_max' must be a positive integer"):
        Model({**d, "reg_max": 0})


def test_architecture_matches_yolo26(n_model):
    head = n_model.detect
    assert isinstance(head, E2EDetect) and not head.has_anchors
    assert (head.nc, head.nl, head.reg_max, head.max_det, head.end2end) == (NC, 3, 1, 300, True)
    assert head.stride.tolist() == [8.0, 16.0, 32.0]
    assert isinstance(head.dfl, nn.Identity) and head.dw_cls
    assert head.one2one_cv2[0][-1].out_channels == 4 and head.one2one_cv3[2][-1].out_channels == NC
    sppf = n_model.model[9]
    assert isinstance(sppf, SPPF) and sppf.n == 3 and sppf.add and isinstance(sppf.cv1.act, nn.Identity)
    y11 = Model("yolo11n.yaml").model[9]  # the old rows keep the activated conv and no residual add
    assert y11.n == 3 and not y11.add and isinstance(y11.cv1.act, nn.SiLU)
    assert len(n_model.model[22].m[0]) == 2  # last C3k2: bottleneck + attention


def test_biases_start_alike_on_both_branches(n_model):
    fresh = Model("yolo26n.yaml", nc=NC).detect
    for boxes, classes in ((fresh.cv2, fresh.cv3), (fresh.one2one_cv2, fresh.one2one_cv3)):
        for box, cls, s in zip(boxes, classes, (8, 16, 32)):
            assert torch.all(box[-1].bias == 2.0)
            assert torch.allclose(cls[-1].bias, torch.full((NC,), math.log(5 / NC / (640 / s) ** 2)))


def test_training_output_and_detached_one_to_one():
    torch.manual_seed(0)
    m = Model("yolo26n.yaml", nc=NC).train()
    out = m(torch.rand(2, 3, 64, 96))
    assert set(out) == {"one2many", "one2one"}
    for branch in out.values():
        assert [tuple(r.shape) for r in branch] == [(2, 4 + NC, 8, 12), (2, 4 + NC, 4, 6), (2, 4 + NC, 2, 3)]
    sum(r.sum() for r in out["one2one"]).backward()
    assert m.model[0].conv.weight.grad is None  # the one-to-one loss never reaches the backbone
    assert m.detect.one2one_cv2[0][0].conv.weight.grad is not None
    m.zero_grad(set_to_none=True)
    sum(r.sum() for r in m(torch.rand(2, 3, 64, 96))["one2many"]).backward()
    assert m.model[0].conv.weight.grad is not None


def test_eval_end2end_and_one_to_many(n_model):
    x = torch.rand(2, 3, 64, 96)
    head = n_model.detect
    with torch.no_grad():
        dets, raw = n_model(x)
        head.end2end = False
        try:
            decoded, raw2 = n_model(x)
        finally:
            head.end2end = True
    n = 8 * 12 + 4 * 6 + 2 * 3
    assert dets.shape == (2, min(300, n), 6) and decoded.shape == (2, n, 4 + NC)
    assert set(raw) == {"one2many", "one2one"} and torch.equal(raw["one2one"][0], raw2["one2one"][0])
    assert torch.all(dets[..., 4].diff(dim=1) <= 0)  # best first
    assert torch.all((dets[..., 5] >= 0) & (dets[..., 5] < NC)) and torch.equal(dets[..., 5], dets[..., 5].round())
    assert torch.all((decoded[..., 4:] >= 0) & (decoded[..., 4:] <= 1))  # the DFL head's form: xywh + sigmoid
    flat = torch.cat([r.flatten(2) for r in raw["one2one"]], 2)
    best = torch.sigmoid(flat[:, 4:]).amax(1).amax(1)
    assert torch.allclose(dets[:, 0, 4], best)


def test_max_det_is_respected(n_model):
    x = torch.rand(1, 3, 64, 64)
    head = n_model.detect
    head.max_det = 7
    try:
        with torch.no_grad():
            dets, _ = n_model(x)
    finally:
        head.max_det = 300
    assert dets.shape == (1, 7, 6)


def test_topk_matches_a_brute_force_selection():
    """Top k anchors by best class, then top k (anchor, class) pairs among them: several classes per anchor."""
    torch.manual_seed(1)
    boxes, scores = torch.rand(2, 50, 4), torch.rand(2, 50, 3)
    out = topk_dets(boxes, scores, 10)
    for b in range(2):
        anchors = scores[b].amax(1).topk(10).indices
        pairs = sorted(((float(scores[b, a, c]), int(a), c) for a in anchors for c in range(3)), reverse=True)[:10]
        assert [int(r[5]) for r in out[b]] == [c for _, _, c in pairs]
        assert torch.equal(out[b, :, :4], boxes[b, [a for _, a, _ in pairs]])
        assert torch.allclose(out[b, :, 4], torch.tensor([s for s, _, _ in pairs]))


def test_agnostic_topk_keeps_one_class_per_box():
    torch.manual_seed(2)
    boxes, scores = torch.rand(1, 40, 4), torch.rand(1, 40, 3)
    out = topk_dets(boxes, scores, 8, agnostic=True)
    best, labels = scores[0].max(1)
    idx = best.topk(8).indices
    assert torch.equal(out[0, :, :4], boxes[0, idx]) and torch.equal(out[0, :, 4], best[idx])
    assert torch.equal(out[0, :, 5], labels[idx].float())


def test_fused_equals_unfused(n_model):
    assert_fused_copy_matches(n_model)


def test_rebuilds_from_its_stored_yaml(n_model):
    again = Model(n_model.yaml)
    assert again.state_dict().keys() == n_model.state_dict().keys()
    assert any(k.startswith("model.23.one2one_cv3.") for k in again.state_dict())


def test_ultralytics_yolo26_checkpoint_imports_exactly(tmp_path, monkeypatch, one_thread):
    """A YOLO26 file pickled the way Ultralytics 8.4 does (stand-in classes, fp16; see tests/test_convert.py)
    converts with every tensor, both branches included, and gives the same outputs."""
    from tests import test_convert as tc
    from yolotrain.utils.weights.checkpoint import load_checkpoint, load_model

    monkeypatch.setitem(tc.UL_CLASSES, "E2EDetect", "modules.head.Detect")
    torch.manual_seed(0)
    original = Model("yolo26n.yaml", nc=len(tc.NAMES))
    path = tmp_path / "yolo26n.pt"
    spec = tc.make_spec(original, tc.ULTRALYTICS, "yolo26n.yaml")
    tc.craft([(spec, path, "")], tc.write_standins(tmp_path / "standins"), tmp_path)
    ckpt = load_checkpoint(path)
    assert ckpt["model_yaml"]["end2end"] is True and ckpt["model_yaml"]["reg_max"] == 1
    assert ckpt["model_yaml"]["head"][-1][2:] == ["E2EDetect", ["nc", 1, True]]
    expected = tc.half_rounded(original)
    assert list(ckpt["model"]) == list(expected) and any("one2one_cv2" in k for k in expected)
    model, _ = load_model(path, torch.device("cpu"))
    (ours, ours_raw), (theirs, theirs_raw) = tc.both_outputs(model, original, expected)
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for k in ours_raw for a, b in zip(ours_raw[k], theirs_raw[k]))
