"""Model building from yaml: sizes match the published YOLOv5 v6 table, shapes, yaml errors."""
from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from yolotrain.models.blocks import C3, Conv
from yolotrain.models.heads.anchor import Detect
from yolotrain.models.yolo import Model, ModelInfo, de_parallel
from tests.helpers import n_params, raises_user_error, randomize_bn, write_cfg

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
COCO_ANCHORS = [[10, 13, 16, 30, 33, 23], [30, 61, 62, 45, 59, 119], [116, 90, 156, 198, 373, 326]]
# Published YOLOv5 v6 table (fused models, nc=80) and what the same nets have before fusing.
FUSED_PARAMS = {"n": 1_867_405, "s": 7_225_885, "m": 21_172_173, "l": 46_533_693, "x": 86_705_005}
TRAIN_PARAMS = {"n": 1_872_157, "s": 7_235_389, "m": 21_190_557, "l": 46_563_709, "x": 86_749_405}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def yolov5n() -> Model:
    torch.manual_seed(0)
    return Model(MODELS / "yolov5n.yaml")


def small_cfg() -> dict:
    """yolov5n as a dict, to edit into broken variants."""
    return yaml.safe_load((MODELS / "yolov5n.yaml").read_text())


# ---------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("size", ["n", "s", "m", "l", "x"])
def test_parameter_counts_match_published_table(size: str) -> None:
    m = Model(MODELS / f"yolov5{size}.yaml")
    assert n_params(m) == TRAIN_PARAMS[size]
    m.fuse()
    assert n_params(m) == FUSED_PARAMS[size]


@pytest.mark.parametrize("size, gflops", [("n", 4.5), ("s", 16.5), ("m", 49.0), ("l", 109.1), ("x", 205.7)])
def test_gflops_at_640_match_published_table(size: str, gflops: float) -> None:
    info = Model(MODELS / f"yolov5{size}.yaml").info(640)
    assert isinstance(info, ModelInfo)
    assert info.parameters == info.gradients == TRAIN_PARAMS[size]
    assert info.layers > 100
    assert info.gflops == pytest.approx(gflops, rel=0.02)
    # FLOPs scale with pixel count
    assert Model(MODELS / f"yolov5{size}.yaml").info(320).gflops == pytest.approx(info.gflops / 4, rel=1e-6)


# --------------------------------------------------------------------------------------- forward


def test_strides_and_anchors_in_grid_units(yolov5n: Model) -> None:
    assert yolov5n.stride.tolist() == [8.0, 16.0, 32.0]
    assert yolov5n.detect is yolov5n.model[-1]
    assert isinstance(yolov5n.detect, Detect)
    pixels = yolov5n.detect.anchors * yolov5n.stride.view(-1, 1, 1)
    assert torch.allclose(pixels, torch.tensor(COCO_ANCHORS, dtype=torch.float32).view(3, 3, 2))


def test_train_mode_output_shapes(yolov5n: Model) -> None:
    yolov5n.train()
    out = yolov5n(torch.zeros(2, 3, 128, 96))
    assert [tuple(o.shape) for o in out] == [(2, 3, 16, 12, 85), (2, 3, 8, 6, 85), (2, 3, 4, 3, 85)]


def test_eval_mode_decodes_to_pixels(yolov5n: Model) -> None:
    yolov5n.eval()
    with torch.no_grad():
        pred, raw = yolov5n(torch.rand(2, 3, 128, 128))
    assert pred.shape == (2, 3 * (16 * 16 + 8 * 8 + 4 * 4), 84)  # xywh + 80 class scores (obj x cls)
    assert [tuple(r.shape) for r in raw] == [(2, 3, 16, 16, 85), (2, 3, 8, 8, 85), (2, 3, 4, 4, 85)]
    assert ((pred[..., 4:] >= 0) & (pred[..., 4:] <= 1)).all()
    # one cell by hand: level 1, anchor 2, grid y=3, x=5 (v6 formula)
    det, p = yolov5n.detect, raw[1][1, 2, 3, 5].sigmoid()
    xy = (p[:2] * 2 - 0.5 + torch.tensor([5.0, 3.0])) * 16
    wh = (p[2:4] * 2) ** 2 * det.anchors[1, 2] * 16
    row = pred[1, 3 * 16 * 16 + 2 * 64 + 3 * 8 + 5]
    assert torch.allclose(row[:4], torch.cat((xy, wh)), atol=1e-4)
    assert torch.allclose(row[4:], p[5:] * p[4], atol=1e-6)
    yolov5n.train()


def test_eval_grid_cache_handles_changing_shapes(yolov5n: Model) -> None:
    yolov5n.eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        a = yolov5n(x)[0]
        yolov5n(torch.rand(1, 3, 96, 64))  # a different shape in between
        b = yolov5n(x)[0]
    assert torch.equal(a, b)
    assert a[0, :, 0].max() < 64 + 32 and a[0, :, 0].min() > -32  # centres near the image
    yolov5n.train()


def test_building_leaves_batchnorm_statistics_untouched(yolov5n: Model) -> None:
    bns = [m for m in Model(MODELS / "yolov5n.yaml").modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns
    for bn in bns:
        assert bn.eps == 1e-3 and bn.momentum == 0.03
        assert int(bn.num_batches_tracked) == 0
        assert torch.all(bn.running_mean == 0) and torch.all(bn.running_var == 1)


def test_conv_normalises_as_its_batchnorm_without_the_counter() -> None:
    """Conv's BatchNorm gives the values, gradients and running statistics of calling the module, bit for bit,
    in training and in eval; only the counter nothing reads (momentum is fixed) stays where it was."""
    torch.manual_seed(0)
    ours = Conv(3, 8, 3)
    reference = copy.deepcopy(ours)
    x = torch.randn(4, 3, 16, 16)
    for train in (True, True, False):
        ours.train(train), reference.train(train)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a = ours(xa)
        b = reference.act(reference.bn(reference.conv(xb)))
        assert torch.equal(a, b)
        a.square().sum().backward(), b.square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(ours.bn.weight.grad, reference.bn.weight.grad)
        assert torch.equal(ours.bn.running_mean, reference.bn.running_mean)
        assert torch.equal(ours.bn.running_var, reference.bn.running_var)
        x = x * 1.5 + 0.25
    assert int(reference.bn.num_batches_tracked) == 2 and int(ours.bn.num_batches_tracked) == 0


def test_detect_bias_priors() -> None:
    det = Model(MODELS / "yolov5n.yaml", nc=5).detect
    for conv, s in zip(det.m, (8, 16, 32)):
        b = conv.bias.detach().view(det.na, -1)
        # conv init bias is U(-k, k) with small k; the prior shift dominates
        assert b[:, 4].mean().item() == pytest.approx(math.log(8 / (640 / s) ** 2), abs=0.2)
        assert b[:, 5:].mean().item() == pytest.approx(math.log(0.6 / (5 - 0.99)), abs=0.2)


def test_fuse_matches_unfused_in_eval() -> None:
    torch.manual_seed(1)
    m = randomize_bn(Model(MODELS / "yolov5n.yaml")).eval()  # non-trivial BN statistics so fusing has something to fold
    x = torch.rand(1, 3, 96, 128)
    with torch.no_grad():
        ref = m(x)[0]
        fused = m.fuse()
        out = fused(x)[0]
    assert fused is m
    assert not any(isinstance(mod, nn.BatchNorm2d) for mod in m.modules())
    assert all(c.bn is None for c in m.modules() if isinstance(c, Conv))
    c3s = [c for c in m.modules() if isinstance(c, C3)]
    assert len(c3s) == 8 and all(c.cv12 is not None and c.cv1 is None and c.cv2 is None for c in c3s)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_c3_merged_input_convs_give_both_outputs() -> None:
    torch.manual_seed(0)
    block = C3(24, 32, n=1).eval()
    for conv in (block.cv1, block.cv2, block.cv3, *block.m[0].modules()):
        if isinstance(conv, Conv):
            conv.fuse_bn()
    x = torch.randn(2, 24, 10, 12)
    with torch.no_grad():
        halves = block.cv1(x), block.cv2(x)
        ref = block(x)
        assert block.merge_inputs()
        assert torch.allclose(torch.cat(halves, 1), block.cv12(x), atol=1e-5)
        assert torch.allclose(block(x), ref, atol=1e-5)
    assert block.cv12.conv.bias is not None and not block.cv12.conv.weight.requires_grad


def test_c3_input_convs_that_differ_stay_apart() -> None:
    unfolded = C3(8, 8)
    assert not unfolded.merge_inputs()  # BN not folded yet: the merge is for inference only
    block = C3(8, 8)
    for conv in (block.cv1, block.cv2):
        conv.fuse_bn()
    block.cv2.act = nn.ReLU()
    assert not block.merge_inputs() and block.cv12 is None and block.cv1 is not None


def test_de_parallel_unwraps() -> None:
    m = Model(MODELS / "yolov5n.yaml")
    assert de_parallel(m) is m
    assert de_parallel(nn.DataParallel(m)) is m


# ------------------------------------------------------------------------------- yaml round-trip


def test_yaml_round_trip_rebuilds_same_model(yolov5n: Model, tmp_path: Path) -> None:
    d = yolov5n.yaml
    json.dumps(d)  # plain primitives only
    buf = io.BytesIO()
    torch.save({"yaml": d, "model": yolov5n.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    rebuilt = Model(ckpt["yaml"])
    sd0, sd1 = yolov5n.state_dict(), rebuilt.state_dict()
    assert list(sd0) == list(sd1)
    assert all(sd0[k].shape == sd1[k].shape for k in sd0)
    rebuilt.load_state_dict(ckpt["model"])
    yolov5n.eval(), rebuilt.eval()
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(yolov5n(x)[0], rebuilt(x)[0])
    yolov5n.train()
    assert d == Model(MODELS / "yolov5n.yaml").yaml  # deterministic


def test_yaml_is_a_copy() -> None:
    cfg = small_cfg()
    before = copy.deepcopy(cfg)
    m = Model(cfg, nc=2)
    assert cfg == before  # caller's dict not modified
    m.yaml["nc"] = 7
    assert m.detect.nc == 2


def test_nc_override() -> None:
    m = Model(MODELS / "yolov5n.yaml", nc=3)
    assert m.detect.nc == 3 and m.detect.no == 8
    assert m.yaml["nc"] == 3
    assert all(c.out_channels == 3 * 8 for c in m.detect.m)
    assert Model(m.yaml).detect.nc == 3
    assert n_params(Model(m.yaml)) == n_params(m)


def test_anchors_override_and_order_check() -> None:
    anchors = [[5, 6, 8, 14, 15, 11], [20, 30, 40, 25, 35, 70], [90, 80, 130, 160, 300, 250]]
    m = Model(MODELS / "yolov5n.yaml", anchors=anchors)
    px = m.detect.anchors * m.stride.view(-1, 1, 1)
    assert torch.allclose(px, torch.tensor(anchors, dtype=torch.float32).view(3, 3, 2))
    assert Model(m.yaml).yaml["anchors"] == m.yaml["anchors"]
    # listed largest-first: flipped so the largest anchors sit on the coarsest level
    rev = Model(MODELS / "yolov5n.yaml", anchors=anchors[::-1])
    assert torch.allclose(rev.detect.anchors, m.detect.anchors)


def test_bundled_name_and_input_channels() -> None:
    m = Model("yolov5n.yaml", ch=1)
    assert m.yaml["ch"] == 1
    assert [tuple(o.shape) for o in m(torch.zeros(1, 1, 64, 64))][0] == (1, 3, 8, 8, 85)


# ----------------------------------------------------------------------------------- bad yamls


def test_unknown_module_suggests_closest(tmp_path: Path) -> None:
    d = small_cfg()
    d["head"][2][2] = "Concatt"
    p = write_cfg(tmp_path, d)
    raises_user_error(p, str(p), "head row 2", "'Concatt'", "Did you mean 'Concat'?")


def test_from_index_out_of_range(tmp_path: Path) -> None:
    d = small_cfg()
    d["head"][2][0] = [-1, 30]
    p = write_cfg(tmp_path, d)
    raises_user_error(p, str(p), "head row 2", "'from' index 30")
    d = small_cfg()
    d["backbone"][0][0] = 0  # the first layer can only read the image
    raises_user_error(write_cfg(tmp_path, d), "backbone row 0", "'from' index 0")


@pytest.mark.parametrize("key", ["backbone", "head", "anchors", "nc"])
def test_missing_key(tmp_path: Path, key: str) -> None:
    d = small_cfg()
    del d[key]
    p = write_cfg(tmp_path, d)
    raises_user_error(p, str(p), f"missing key '{key}'")


def test_unknown_top_level_key(tmp_path: Path) -> None:
    d = small_cfg()
    d["depth_multiplier"] = d.pop("depth_multiple")
    raises_user_error(write_cfg(tmp_path, d), "unknown key 'depth_multiplier'", "Did you mean 'depth_multiple'?")


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    raises_user_error(missing, str(missing), "not found")
    raises_user_error(Path("yolov5q.yaml"), "yolov5q.yaml", "not found", "Did you mean")
    broken = write_cfg(tmp_path, "nc: 80\nbackbone: [[-1, 1, Conv\n", "broken.yaml")
    raises_user_error(broken, str(broken), "not valid YAML")
    raises_user_error(write_cfg(tmp_path, "- 1\n- 2\n", "list.yaml"), "list.yaml", "mapping")


@pytest.mark.parametrize(
    "section, row, value, fragment",
    [
        ("backbone", 1, [-1, 1, "Conv", [128.5, 3, 2]], "output channel count"),
        ("backbone", 1, [-1, 1, "Conv", ["wide", 3, 2]], "argument 'wide' is not allowed"),
        ("backbone", 1, [-1, "three", "Conv", [128, 3, 2]], "number must be a positive integer"),
        ("backbone", 1, [-1, 1, "Conv"], "[from, number, module, args]"),
        ("backbone", 1, [-1, 1, "Conv", 128], "args must be a list"),
        ("backbone", 1, [-1, 1, "Conv", [128, 3, 2, 1, 1, 1, 1, 1]], "cannot build Conv"),
        ("head", 1, [-1, 1, "nn.Upsample", ["None", 2, "nearst"]], "Did you mean 'nearest'?"),
        ("head", 2, ["-1", 1, "Concat", [1]], "'from' must be an integer"),
    ],
)
def test_bad_rows(tmp_path: Path, section: str, row: int, value: list, fragment: str) -> None:
    d = small_cfg()
    d[section][row] = value
    p = write_cfg(tmp_path, d)
    raises_user_error(p, str(p), f"{section} row {row}", fragment)


def test_bad_anchors(tmp_path: Path) -> None:
    d = small_cfg()
    d["anchors"] = 3
    raises_user_error(write_cfg(tmp_path, d), "bad.yaml", "anchors given as a count")
    d["anchors"] = [[10, 13, 16], [30, 61, 62, 45], [116, 90, 156, 198]]
    raises_user_error(write_cfg(tmp_path, d), "bad.yaml", "anchors must be")
    d["anchors"] = COCO_ANCHORS[:2]
    raises_user_error(write_cfg(tmp_path, d), "bad.yaml", "2 anchor levels but 3 input layers")


def test_channel_mismatch_is_a_user_error(tmp_path: Path) -> None:
    d = small_cfg()
    d["backbone"][1][1] = 6  # Conv repeated (x0.33 -> 2): second copy gets the wrong input channels
    raises_user_error(write_cfg(tmp_path, d), "bad.yaml", "does not run")


def test_dict_errors_name_the_row() -> None:
    d = small_cfg()
    d["backbone"][2][2] = "C4"
    raises_user_error(d, "model yaml: backbone row 2", "unknown module 'C4'")


def test_no_eval_or_exec_in_models() -> None:
    for path in MODELS.glob("*.py"):
        text = path.read_text()
        assert "eval(" not in text.replace(".eval(", "").replace("_eval(", ""), path
        assert "exec(" not in text, path


def test_custom_single_level_model() -> None:
    """A small hand-written yaml: one Detect level; a width equal to na*(nc+5) is not scaled."""
    d = {
        "nc": 80, "depth_multiple": 1.0, "width_multiple": 0.25,
        "anchors": [[10, 13, 16, 30, 33, 23]],
        "backbone": [[-1, 1, "Conv", [64, 3, 2]], [-1, 1, "Conv", [255, 3, 2]], [-1, 2, "C3", [128]]],
        "head": [[[-1], 1, "Detect", ["nc", "anchors"]]],
    }
    m = Model(d)
    assert m.model[1].conv.out_channels == 255  # 3 * 85, kept exact
    assert m.model[0].conv.out_channels == 16 and m.model[2].cv3.conv.out_channels == 32
    assert len(m.model[2].m) == 2
    assert m.stride.tolist() == [4.0]
    assert [tuple(o.shape) for o in m(torch.zeros(1, 3, 32, 32))] == [(1, 3, 8, 8, 85)]
