"""Anchor-free families (YOLOv8, YOLO11, YOLOv5u): sizes match Ultralytics 8.4.190 exactly, the
DFL head's outputs and decoding, fusing, the scale rule of the parser, yaml round-trips."""
from __future__ import annotations

import copy
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from yolotrain.models.blocks import C2PSA, DFL, Attention, Bottleneck, C3k, C3k2, Conv, DWConv
from yolotrain.models.heads.dfl import DFLDetect
from yolotrain.models.yolo import Model
from yolotrain.utils.core.hyp import Hyp
from tests.helpers import n_params, raises_user_error, randomize_bn, write_cfg

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
COCO_ANCHORS = [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
# Unfused parameters at nc=80, measured with Ultralytics 8.4.190 (DetectionModel(yaml, nc=80)).
PARAMS = {
    "yolov8n": 3_157_200, "yolov8s": 11_166_560, "yolov8m": 25_902_640, "yolov8l": 43_691_520,
    "yolov8x": 68_229_648, "yolo11n": 2_624_080, "yolo11s": 9_458_752, "yolo11m": 20_114_688,
    "yolo11l": 25_372_160, "yolo11x": 56_966_176, "yolov5nu": 2_654_816, "yolov5su": 9_153_152,
}
FUSED_PARAMS = {"yolov8n": 3_151_904, "yolo11n": 2_616_248}
# thop GFLOPs at 640 (2 x MACs), unfused, Ultralytics 8.4.190
GFLOPS = {
    "yolov8n": 8.86, "yolov8s": 28.81, "yolov8m": 79.31, "yolov8l": 165.73, "yolov8x": 258.54,
    "yolo11n": 6.67, "yolo11s": 21.84, "yolo11m": 68.64, "yolo11l": 87.85, "yolo11x": 196.32,
    "yolov5nu": 7.84, "yolov5su": 24.21,
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def yolov8n() -> Model:
    torch.manual_seed(0)
    return Model("yolov8n.yaml", nc=5)


@pytest.fixture(scope="module")
def yolo11n() -> Model:
    torch.manual_seed(0)
    return Model("yolo11n.yaml", nc=5)


def family_cfg(name: str = "yolov8.yaml") -> dict:
    return yaml.safe_load((MODELS / name).read_text())


# ---------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("name", list(PARAMS))
def test_parameter_counts_match_ultralytics(name: str) -> None:
    m = Model(f"{name}.yaml")
    assert n_params(m) == PARAMS[name]
    assert m.detect.has_anchors is False
    # the DFL integral's 16 weights are parameters without gradient, as in the reference models
    assert sum(p.numel() for p in m.parameters() if not p.requires_grad) == 16
    if name in FUSED_PARAMS:
        m.fuse()
        assert n_params(m) == FUSED_PARAMS[name]


@pytest.mark.parametrize("name", list(GFLOPS))
def test_gflops_at_640_match_ultralytics(name: str) -> None:
    info = Model(f"{name}.yaml").info(640)
    assert info.parameters == PARAMS[name] and info.gradients == PARAMS[name] - 16
    assert info.gflops == pytest.approx(GFLOPS[name], rel=0.01)


def test_attention_products_are_counted_in_gflops() -> None:
    """thop sees modules only; C2PSA's two attention matmuls (quadratic in pixels) are added."""
    m = Model("yolo11n.yaml")
    attn = [a for a in m.modules() if isinstance(a, Attention)]
    assert len(attn) == 1 and (attn[0].num_heads, attn[0].key_dim, attn[0].head_dim) == (2, 32, 64)
    assert attn[0].matmul_macs(20, 20) == 2 * 400 * 400 * (32 + 64)  # the P5 map of a 640 image
    assert m.info(640).gflops == pytest.approx(6.67, rel=0.002)  # without the products: -0.8%
    v8 = Model("yolov8n.yaml")
    assert v8.info(320).gflops == pytest.approx(v8.info(640).gflops / 4, rel=1e-6)  # no attention: linear


def test_c3k_stages_follow_the_scale() -> None:
    """YOLO11's m/l/x sizes use C3k in every C3k2; n/s only where the row says c3k True."""
    s, m = Model("yolo11s.yaml"), Model("yolo11m.yaml")
    assert type(s.model[2].m[0]) is Bottleneck and type(s.model[6].m[0]) is C3k
    assert all(type(stage) is C3k for layer in m.model if isinstance(layer, C3k2) for stage in layer.m)
    assert isinstance(m.model[10], C2PSA)


# --------------------------------------------------------------------------------------- forward


def test_head_attributes(yolov8n: Model, yolo11n: Model) -> None:
    for model in (yolov8n, yolo11n):
        det = model.detect
        assert isinstance(det, DFLDetect) and det is model.model[-1]
        assert det.has_anchors is False
        assert (det.nc, det.nl, det.reg_max, det.no) == (5, 3, 16, 5 + 64)
        assert model.stride.tolist() == [8.0, 16.0, 32.0]
        assert det.stride.tolist() == [8.0, 16.0, 32.0]
    # YOLOv8's class branch is two 3x3 Convs; YOLO11's is depthwise 3x3 + 1x1, twice
    assert type(yolov8n.detect.cv3[0][0]) is Conv and not yolov8n.detect.dw_cls
    assert yolo11n.detect.dw_cls and type(yolo11n.detect.cv3[0][0][0]) is DWConv


def test_train_mode_output_shapes(yolov8n: Model, yolo11n: Model) -> None:
    for model in (yolov8n, yolo11n):
        model.train()
        out = model(torch.zeros(2, 3, 128, 96))
        assert [tuple(o.shape) for o in out] == [(2, 69, 16, 12), (2, 69, 8, 6), (2, 69, 4, 3)]


def test_eval_mode_decodes_to_pixels(yolov8n: Model) -> None:
    torch.manual_seed(2)
    yolov8n.eval()
    with torch.no_grad():
        pred, raw = yolov8n(torch.rand(2, 3, 128, 96))
    n = 16 * 12 + 8 * 6 + 4 * 3
    assert pred.shape == (2, n, 4 + 5)  # centre x, y, w, h in pixels + 5 class scores
    assert [tuple(r.shape) for r in raw] == [(2, 69, 16, 12), (2, 69, 8, 6), (2, 69, 4, 3)]
    assert ((pred[..., 4:] >= 0) & (pred[..., 4:] <= 1)).all()
    assert (pred[..., 2:4] > 0).all()  # distances are non-negative, so boxes have positive size
    # one cell by hand: image 1, level 1 (stride 16), row y=3, column x=5
    p = raw[1][1, :, 3, 5]
    dist = (p[:64].view(4, 16).softmax(1) * torch.arange(16.0)).sum(1)  # left, top, right, bottom
    cx, cy = 5.5, 3.5  # the cell centre in grid units
    x1, y1, x2, y2 = cx - dist[0], cy - dist[1], cx + dist[2], cy + dist[3]
    expect = torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1)) * 16
    row = pred[1, 16 * 12 + 3 * 6 + 5]
    assert torch.allclose(row[:4], expect, atol=1e-4)
    assert torch.allclose(row[4:], p[64:].sigmoid(), atol=1e-6)
    yolov8n.train()


def test_anchor_points_cached_per_shape(yolov8n: Model) -> None:
    yolov8n.eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        a = yolov8n(x)[0]
        yolov8n(torch.rand(1, 3, 96, 64))  # a different shape in between
        b = yolov8n(x)[0]
    assert torch.equal(a, b)
    det = yolov8n.detect
    points, strides = det.anchor_points([(8, 8), (4, 4), (2, 2)], torch.device("cpu"), torch.float32)
    assert points is det.anchor_points([(8, 8), (4, 4), (2, 2)], torch.device("cpu"), torch.float32)[0]
    assert points.shape == (2, 84) and strides.shape == (1, 84)
    assert points[:, 0].tolist() == [0.5, 0.5] and points[:, 1].tolist() == [1.5, 0.5]  # (x, y), row-major
    assert points[:, 8].tolist() == [0.5, 1.5] and strides[0, 0].item() == 8.0
    assert points[:, 64].tolist() == [0.5, 0.5] and strides[0, 64].item() == 16.0
    assert a[0, :, 0].max() < 64 + 32 and a[0, :, 0].min() > -32  # centres near the image
    yolov8n.train()


def test_bias_priors() -> None:
    det = Model("yolov8n.yaml", nc=5).detect
    for box, cls, s in zip(det.cv2, det.cv3, (8, 16, 32)):
        assert torch.all(box[-1].bias == 1.0)
        assert torch.allclose(cls[-1].bias, torch.full((5,), math.log(5 / 5 / (640 / s) ** 2)))


@pytest.mark.parametrize("name", ["yolov8n", "yolo11n", "yolov5nu"])
def test_fuse_matches_unfused_in_eval(name: str) -> None:
    torch.manual_seed(1)
    m = Model(f"{name}.yaml")
    randomize_bn(m)
    m.eval()
    x = torch.rand(1, 3, 96, 128)
    with torch.no_grad():
        ref = m(x)[0]
        fused = m.fuse()
        out = fused(x)[0]
    assert fused is m
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in m.modules())
    assert all(c.bn is None for c in m.modules() if isinstance(c, Conv))
    assert torch.equal(m.detect.dfl.conv.weight.view(-1), torch.arange(16.0))  # the fixed integral is untouched
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_criterion_is_the_dfl_loss(yolov8n: Model) -> None:
    crit = yolov8n.detect.build_criterion(Hyp(), 640)
    assert crit.loss_names == ("box", "cls", "dfl")
    yolov8n.train()
    out = yolov8n(torch.rand(2, 3, 64, 64))
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.4], [1, 4, 0.3, 0.6, 0.2, 0.2]])
    loss, items = crit(out, targets)
    assert loss.shape == (1,) and items.shape == (3,) and torch.isfinite(loss).all()


# -------------------------------------------------------------------------------------- blocks


def test_dfl_integral_is_fixed_and_takes_the_mean_bin() -> None:
    dfl = DFL(16)
    assert torch.equal(dfl.conv.weight.view(-1), torch.arange(16.0)) and not dfl.conv.weight.requires_grad
    logits = torch.zeros(1, 64, 2)
    logits[0, [3, 16 + 7, 32 + 0, 48 + 15], 0] = 50.0  # one confident bin per side at anchor 0
    out = dfl(logits)
    assert out.shape == (1, 4, 2)
    assert torch.allclose(out[0, :, 0], torch.tensor([3.0, 7.0, 0.0, 15.0]), atol=1e-4)
    assert torch.allclose(out[0, :, 1], torch.full((4,), 7.5))  # uniform: the middle


def test_c3k2_attention_stage_and_c2psa_width_check() -> None:
    m = C3k2(64, 64, n=1, attn=True)
    assert m(torch.rand(1, 64, 8, 8)).shape == (1, 64, 8, 8)
    with pytest.raises(ValueError, match="must be equal"):
        C2PSA(64, 128)


# ------------------------------------------------------------------------------- yaml round-trip


@pytest.mark.parametrize("name, scale", [("yolov8s", "s"), ("yolo11n", "n"), ("yolov5nu", "n")])
def test_yaml_round_trip_rebuilds_same_model(name: str, scale: str) -> None:
    torch.manual_seed(0)
    m = Model(f"{name}.yaml", nc=3)
    d = m.yaml
    assert d["scale"] == scale
    assert "anchors" not in d
    json.dumps(d)  # plain primitives only
    buf = io.BytesIO()
    torch.save({"yaml": d, "model": m.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    rebuilt = Model(ckpt["yaml"])  # a dict: no file name to read the size from
    sd0, sd1 = m.state_dict(), rebuilt.state_dict()
    assert list(sd0) == list(sd1)
    assert all(sd0[k].shape == sd1[k].shape for k in sd0)
    rebuilt.load_state_dict(ckpt["model"])
    m.eval(), rebuilt.eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(m(x)[0], rebuilt(x)[0])
    assert d == Model(f"{name}.yaml", nc=3).yaml  # deterministic
    assert rebuilt.yaml == d


def test_anchor_overrides_do_not_apply() -> None:
    """The data yaml's anchors and the hyp file's anchor count are for anchor heads only."""
    m = Model("yolov8n.yaml", nc=2, anchors=COCO_ANCHORS, na=4)
    assert "anchors" not in m.yaml and m.yaml["nc"] == 2
    assert n_params(m) == n_params(Model("yolov8n.yaml", nc=2))


# --------------------------------------------------------------------------- sizes and file names


def test_size_from_file_name_and_path_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert Model(Path("models/yolov8n.yaml")).yaml["scale"] == "n"  # the --cfg form
    assert Model(MODELS / "yolov8m.yaml").yaml["scale"] == "m"
    assert Model("yolov5su.yaml").yaml["scale"] == "s"
    assert Model("yolo11x.yaml").source == str((MODELS / "yolo11.yaml").resolve())
    # a family file of one's own: the sized name finds it beside the requested path
    shutil.copy(MODELS / "yolov8.yaml", tmp_path / "yolov8.yaml")
    assert n_params(Model(tmp_path / "yolov8s.yaml")) == PARAMS["yolov8s"]


def test_scale_key_chooses_the_size(tmp_path: Path) -> None:
    d = family_cfg()
    d["scale"] = "s"
    assert n_params(Model(write_cfg(tmp_path, d, "mine.yaml"))) == PARAMS["yolov8s"]
    assert n_params(Model(d)) == PARAMS["yolov8s"]
    assert Model(write_cfg(tmp_path, d, "yolov8s-copy.yaml")).yaml["scale"] == "s"  # name and key agree
    raises_user_error(write_cfg(tmp_path, d, "yolov8n-copy.yaml"), "'scale: s' contradicts", "'n'")


def test_scale_errors(tmp_path: Path) -> None:
    raises_user_error(MODELS / "yolov8.yaml", "yolov8.yaml", "no size chosen", "n, s, m, l, x")
    raises_user_error(family_cfg(), "model yaml", "no size chosen")
    d = family_cfg()
    d["scale"] = "q"
    raises_user_error(d, "scale 'q' is not one of", "n, s, m, l, x")
    d = family_cfg()
    d["scale"], d["depth_multiple"] = "n", 0.33
    raises_user_error(d, "'scales' and 'depth_multiple' both size the model")
    d = family_cfg()
    d["scales"]["n"] = [0.33, 0.25]
    d["scale"] = "n"
    raises_user_error(d, "scales['n'] must be [depth, width, max_channels]")
    d = yaml.safe_load((MODELS / "yolov5n.yaml").read_text())
    d["scale"] = "n"
    raises_user_error(d, "'scale' needs a 'scales' table")
    d = family_cfg()
    d["scale"], d["ch"] = "n", 0
    raises_user_error(d, "'ch' must be a positive integer")
    raises_user_error(Path("yolov8q.yaml"), "not found", "Did you mean", "yolov8n.yaml")


# ------------------------------------------------------------------------------ anchors in yamls


def test_anchor_free_yaml_needs_no_anchors_but_v5_does(tmp_path: Path) -> None:
    d = family_cfg()
    assert "anchors" not in d
    d["scale"] = "n"
    assert Model(write_cfg(tmp_path, d, "v8.yaml")).detect.has_anchors is False
    v5 = yaml.safe_load((MODELS / "yolov5n.yaml").read_text())
    del v5["anchors"]
    p = write_cfg(tmp_path, v5)
    raises_user_error(p, str(p), "missing key 'anchors'")


def test_anchor_free_yaml_with_anchors_builds_and_bad_references_fail(tmp_path: Path) -> None:
    d = family_cfg()
    d["scale"], d["anchors"] = "n", COCO_ANCHORS  # left over from a v5 yaml: unused, not an error
    assert n_params(Model(d)) == PARAMS["yolov8n"]
    d = family_cfg()
    d["scale"] = "n"
    d["head"][-1][3] = ["nc", "anchors"]
    raises_user_error(d, "head row 12", "argument 'anchors'", "does not have")
    d["head"][-1][3] = ["nc", 1]
    raises_user_error(d, "head row 12", "cannot build DFLDetect", "reg_max")
    d["head"][-1][3] = ["nc"]
    d["backbone"][9] = [-1, 1, "C2PSA", [512]]  # 256 channels in at scale n, 128 out
    raises_user_error(d, "backbone row 9", "cannot build C2PSA")


def test_v5u_has_the_v5_backbone() -> None:
    m = Model("yolov5nu.yaml")
    v5 = Model("yolov5n.yaml")
    trunk = [k for k in v5.state_dict() if not k.startswith("model.24.")]
    sd = m.state_dict()
    assert all(k in sd and sd[k].shape == v5.state_dict()[k].shape for k in trunk)
    assert copy.deepcopy(m).fuse() is not None


@pytest.mark.parametrize("cfg", ["yolov8n.yaml", "yolov5n.yaml"])
def test_boxes_are_decoded_in_fp32_under_bf16_autocast(cfg: str) -> None:
    """--amp on CPU runs the network in bf16, whose 8-bit mantissa would put box coordinates near
    300 px on 2 px steps; the heads decode from fp32 copies of the raw outputs instead, so under
    autocast the boxes are the fp32 decoding of the very same raw outputs."""
    torch.manual_seed(0)
    model = Model(ROOT / "models" / cfg, nc=3).eval()
    if not model.detect.has_anchors:  # a fresh head predicts whole-bin distances: make them fractional
        for branch in model.detect.cv2:
            branch[-1].bias.data.normal_(0, 2)
    x = torch.rand(1, 3, 320, 320)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        decoded, raw = model(x)
    assert raw[0].dtype == torch.bfloat16 and decoded.dtype == torch.float32
    with torch.no_grad():
        head = model.detect
        expected = (head._decode([r.float() for r in raw]) if not head.has_anchors
                    else torch.cat([head._decode(i, r.float()) for i, r in enumerate(raw)], 1))
    assert torch.equal(decoded, expected)
    bf16_boxes = expected[..., :4].bfloat16().float()  # what decoding in bf16 would at best give
    assert (bf16_boxes - expected[..., :4]).abs().max() >= 0.5
