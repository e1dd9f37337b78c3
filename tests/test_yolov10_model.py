"""YOLOv10 (models/yolov10{n,s,m,b,l,x}.yaml, models/blocks_v10.py, V10Detect): sizes equal to Ultralytics
8.4.190's, RepVGGDW folded by fusion with the same outputs, the end-to-end head with DFL, YOLOv10's loss
settings, and import of a checkpoint pickled the way Ultralytics does.

The reference figures were measured with Ultralytics 8.4.190 (``DetectionModel("yolov10?.yaml")``,
unfused parameters, ``get_flops(model, 640)``).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from yolotrain.models.blocks import DFL, Conv
from yolotrain.models.blocks_v10 import CIB, PSA, C2fCIB, RepVGGDW, SCDown
from yolotrain.models.heads.e2e import E2EDetect, V10Detect, V10Loss
from yolotrain.models.heads.e2e_loss import E2ELoss
from yolotrain.models.heads.tal import pack_targets
from yolotrain.models.parse import load_model_yaml
from yolotrain.models.registry import head_class
from yolotrain.models.yolo import Model
from tests.helpers import assert_fused_copy_matches, randomize_bn
from yolotrain.utils.core.hyp import Hyp

ULTRALYTICS = {  # scale: (parameters at nc=80, GFLOPs at 640)
    "n": (2_775_520, 8.80), "s": (8_128_272, 25.23), "m": (16_576_768, 64.61),
    "b": (20_574_384, 99.47), "l": (25_888_688, 127.99), "x": (31_808_960, 171.99),
}
NC = 5


@pytest.fixture(scope="module")
def s_model() -> Model:
    """The s size: both its C2fCIB rows use the large-kernel RepVGGDW."""
    torch.manual_seed(0)
    return randomize_bn(Model("yolov10s.yaml", nc=NC)).eval()


@pytest.mark.parametrize("scale", list(ULTRALYTICS))
def test_parameters_and_gflops_equal_ultralytics(scale):
    params, gflops = ULTRALYTICS[scale]
    info = Model(f"yolov10{scale}.yaml").info(640)
    assert info.parameters == params
    assert info.gflops == pytest.approx(gflops, rel=0.01)


def test_sizes_load_by_name_and_pick_the_v10_head():
    for scale in ULTRALYTICS:
        d, _ = load_model_yaml(f"yolov10{scale}.yaml")
        assert d["scale"] == scale and head_class(d) is V10Detect


def test_architecture_matches_yolov10(s_model):
    head = s_model.detect
    assert isinstance(head, E2EDetect) and not head.has_anchors
    assert (head.nc, head.nl, head.reg_max, head.max_det, head.end2end, head.dw_cls) == (NC, 3, 16, 300, True, True)
    assert isinstance(head.dfl, DFL) and head.one2one_cv2[0][-1].out_channels == 64
    dw = head.one2one_cv3[0][0][0]  # v10Detect's depthwise 3x3: a Conv with groups = channels, not a DWConv
    assert type(dw) is Conv and dw.conv.groups == dw.conv.in_channels == head.one2one_cv3[0][0][1].conv.in_channels
    assert isinstance(s_model.model[5], SCDown) and s_model.model[5].cv2.conv.groups == s_model.model[5].cv2.conv.in_channels
    assert isinstance(s_model.model[10], PSA)
    for i in (8, 22):
        block = s_model.model[i]
        assert isinstance(block, C2fCIB) and isinstance(block.m[0], CIB) and isinstance(block.m[0].cv1[2], RepVGGDW)
    n = Model("yolov10n.yaml")
    assert isinstance(n.model[22].m[0].cv1[2], RepVGGDW) and type(n.model[8]).__name__ == "C2f"
    m = Model("yolov10m.yaml")  # m, b, l, x: C2fCIB without the large kernel
    assert not isinstance(m.model[22].m[0].cv1[2], RepVGGDW)


def test_fused_equals_unfused_and_repvggdw_becomes_one_conv(s_model):
    fused = assert_fused_copy_matches(s_model)
    reps = [m for m in fused.modules() if isinstance(m, RepVGGDW)]
    assert reps and all(r.conv1 is None and r.conv.bn is None for r in reps)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())


def test_repvggdw_fold_is_exact_on_its_own():
    torch.manual_seed(3)
    rep = randomize_bn(RepVGGDW(8)).eval()
    x = torch.randn(2, 8, 11, 13)
    with torch.no_grad():
        before = rep(x)
        rep.fuse_bn()
        after = rep(x)
    assert rep.conv.conv.kernel_size == (7, 7) and torch.allclose(before, after, atol=1e-5)


def test_eval_gives_end_to_end_detections(s_model):
    with torch.no_grad():
        dets, raw = s_model(torch.rand(1, 3, 64, 64))
    n = 8 * 8 + 4 * 4 + 2 * 2
    assert dets.shape == (1, n, 6) and set(raw) == {"one2many", "one2one"}
    assert torch.all(dets[..., 4].diff(dim=1) <= 0)


def test_loss_uses_yolov10s_settings(s_model):
    """One-to-many top 10, one-to-one top 1 (no second narrowing), weights 1 and 1 at every epoch, no STAL:
    the total is the plain sum of the two branches' losses."""
    loss = s_model.detect.build_criterion(Hyp(), 64)
    assert isinstance(loss, V10Loss) and isinstance(loss, E2ELoss)
    assert (loss.one2many.topk, loss.one2one.topk, loss.one2one.topk2) == (10, 1, 1)
    assert loss.one2many.min_side == loss.one2one.min_side == 0.0
    loss.set_progress(3, 10)
    assert (loss.o2m, loss.o2o) == (1.0, 1.0)
    model = copy.deepcopy(s_model).train()
    torch.manual_seed(1)
    preds = model(torch.rand(2, 3, 64, 64))
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.4, 0.3], [1, 3, 0.3, 0.6, 0.2, 0.5]])
    total, items = loss(preds, targets)
    geo = loss.geometry(preds["one2one"], pack_targets(targets, 2, "cpu"), torch.float32)
    o2m = loss.branch(preds["one2many"], geo, loss.one2many, torch.float32).sum()
    o2o = loss.branch(preds["one2one"], geo, loss.one2one, torch.float32)
    assert torch.allclose(total, ((o2m + o2o.sum()) * 2).reshape(1))
    assert torch.allclose(items, o2o.detach())


def test_yolo26_keeps_its_own_loss():
    loss = Model("yolo26n.yaml", nc=NC).detect.build_criterion(Hyp(), 64)
    assert type(loss) is E2ELoss and (loss.one2one.topk, loss.one2one.topk2) == (7, 1)


def test_ultralytics_yolov10_checkpoint_imports_exactly(tmp_path, monkeypatch, one_thread):
    """A YOLOv10 file pickled the way Ultralytics does (stand-in classes at its paths, fp16, its yaml with
    ``v10Detect`` and scale; see tests/test_convert.py) converts with every tensor and gives the same outputs."""
    from tests import test_convert as tc
    from yolotrain.utils.weights.checkpoint import load_checkpoint, load_model

    monkeypatch.setitem(tc.UL_CLASSES, "V10Detect", "modules.head.v10Detect")
    for name in ("SCDown", "RepVGGDW", "CIB", "C2fCIB", "PSA"):
        monkeypatch.setitem(tc.UL_CLASSES, name, f"modules.block.{name}")
    monkeypatch.setitem(tc.STANDIN_MODULES, "ultralytics/nn/modules/block.py",
                        [*tc.STANDIN_MODULES["ultralytics/nn/modules/block.py"], "SCDown", "RepVGGDW", "CIB",
                         "C2fCIB", "PSA"])
    monkeypatch.setitem(tc.STANDIN_MODULES, "ultralytics/nn/modules/head.py", ["Detect", "Segment", "v10Detect"])
    monkeypatch.setitem(tc.STANDIN_MODULES, "ultralytics/nn/tasks.py", ["DetectionModel", "YOLOv10DetectionModel"])
    torch.manual_seed(0)
    original = randomize_bn(Model("yolov10n.yaml", nc=len(tc.NAMES)))
    path, older = tmp_path / "yolov10n.pt", tmp_path / "older.pt"
    spec = tc.make_spec(original, tc.ULTRALYTICS, "yolov10n.yaml")
    spec["modules"][0]["attrs"]["yaml"]["head"][-1][2] = "v10Detect"
    # files before Ultralytics 8.4 name YOLOv10DetectionModel; a size it cannot guess ('yolov10b') is scale ''
    old_spec = copy.deepcopy(spec)
    old_spec["modules"][0]["cls"] = "ultralytics.nn.tasks.YOLOv10DetectionModel"
    old_spec["modules"][0]["attrs"]["yaml"]["scale"] = ""
    tc.craft([(spec, path, ""), (old_spec, older, "")], tc.write_standins(tmp_path / "standins"), tmp_path)
    assert load_checkpoint(older)["model_yaml"]["scale"] == "n"
    ckpt = load_checkpoint(path)
    assert ckpt["model_yaml"]["head"][-1][2:] == ["v10Detect", ["nc"]]
    expected = tc.half_rounded(original)
    assert list(ckpt["model"]) == list(expected) and any(".conv1." in k for k in expected)
    model, _ = load_model(path, torch.device("cpu"))
    (ours, ours_raw), (theirs, theirs_raw) = tc.both_outputs(model, original, expected)
    assert torch.equal(ours, theirs)
    assert all(torch.equal(a, b) for k in ours_raw for a, b in zip(ours_raw[k], theirs_raw[k]))
