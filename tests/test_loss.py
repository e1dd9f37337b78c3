"""AnchorLoss (the anchor head's criterion): target assignment (anchors + neighbour cells), loss values, and that it trains."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from yolotrain.models.heads.anchor_loss import AnchorLoss, AnchorLossGains, matches_to_device, smooth_bce
from yolotrain.models.yolo import Model, de_parallel

MODELS = Path(__file__).resolve().parents[1] / "models"
IMG = 128  # level 0 is a 16x16 grid, stride 8


def make_hyp(**kw: float) -> AnchorLossGains:
    h = dict(box=0.05, obj=1.0, cls=0.5, cls_pw=1.0, obj_pw=1.0, anchor_t=4.0, fl_gamma=0.0, label_smoothing=0.0)
    h.update(kw)
    return AnchorLossGains(**h)


def ComputeLoss(model: nn.Module, gains: AnchorLossGains) -> AnchorLoss:
    """The criterion the model's head builds, with these gains as given (no scaling)."""
    return AnchorLoss(de_parallel(model).detect, gains)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Model:
    torch.manual_seed(0)
    return Model(MODELS / "yolov5n.yaml", nc=3)


def zero_preds(model: Model, bs: int = 2, size: int = IMG, requires_grad: bool = False) -> list[torch.Tensor]:
    det = model.detect
    return [
        torch.zeros(bs, det.na, size // int(s), size // int(s), det.no, requires_grad=requires_grad)
        for s in det.stride.tolist()
    ]


def target_at(gx: float, gy: float, gw: float, gh: float, cls: int = 1, img: int = 0, grid: int = 16) -> torch.Tensor:
    """One normalized target given in level-0 grid units."""
    return torch.tensor([[img, cls, gx / grid, gy / grid, gw / grid, gh / grid]])


def matching_anchors(model: Model, gw: float, gh: float, level: int = 0, anchor_t: float = 4.0) -> list[int]:
    """Anchors whose w/h ratios to (gw, gh) are all within anchor_t, computed independently."""
    out = []
    for a, (aw, ah) in enumerate(model.detect.anchors[level].tolist()):
        if max(gw / aw, aw / gw, gh / ah, ah / gh) < anchor_t:
            out.append(a)
    return out


# ------------------------------------------------------------------------------- build_targets


def test_neighbour_cells_left_and_top(model: Model) -> None:
    cl = ComputeLoss(model, make_hyp())
    gx, gy, gw, gh = 5.3, 7.2, 1.5, 2.5  # offsets 0.3, 0.2 < 0.5: left and top neighbours too
    tcls, tbox, indices, anch = cl.build_targets(zero_preds(model), target_at(gx, gy, gw, gh))
    b, a, gj, gi = indices[0]
    anchors = matching_anchors(model, gw, gh)
    assert len(anchors) >= 2
    assert b.numel() == 3 * len(anchors)
    for k in anchors:
        cells = {(int(j), int(i)) for j, i, aa in zip(gj, gi, a) if aa == k}
        assert cells == {(7, 5), (7, 4), (6, 5)}  # (row, col): own, left, top
    assert (b == 0).all() and (tcls[0] == 1).all()
    # box xy is relative to the cell it is assigned to, so neighbours see offsets beyond [0, 1)
    xy = {(round(x, 4), round(y, 4)) for x, y in tbox[0][:, :2].tolist()}
    assert xy == {(0.3, 0.2), (1.3, 0.2), (0.3, 1.2)}
    assert torch.allclose(tbox[0][:, 2:], torch.tensor([gw, gh]).expand(b.numel(), 2))
    assert torch.equal(anch[0], model.detect.anchors[0][a])


def test_neighbour_cells_right_and_bottom(model: Model) -> None:
    cl = ComputeLoss(model, make_hyp())
    _, _, indices, _ = cl.build_targets(zero_preds(model), target_at(5.7, 7.8, 1.5, 2.5))
    b, a, gj, gi = indices[0]
    cells = {(int(j), int(i)) for j, i in zip(gj, gi)}
    assert cells == {(7, 5), (7, 6), (8, 5)}
    assert b.numel() == 3 * len(matching_anchors(model, 1.5, 2.5))


def test_no_neighbour_outside_the_grid(model: Model) -> None:
    cl = ComputeLoss(model, make_hyp())
    _, _, indices, _ = cl.build_targets(zero_preds(model), target_at(0.3, 15.8, 1.5, 2.5))
    b, _, gj, gi = indices[0]
    assert {(int(j), int(i)) for j, i in zip(gj, gi)} == {(15, 0)}
    assert b.numel() == len(matching_anchors(model, 1.5, 2.5))  # own cell only, no duplicates


def test_anchor_ratio_threshold(model: Model) -> None:
    aw, ah = model.detect.anchors[0, 1].tolist()
    cl = ComputeLoss(model, make_hyp(anchor_t=1.01))
    _, tbox, indices, _ = cl.build_targets(zero_preds(model), target_at(8.5, 8.5, aw, ah))
    assert indices[0][1].tolist() == [1]  # only the identical anchor, only its own cell
    assert all(ix[0].numel() == 0 for ix in indices[1:])  # far too small for P4/P5 anchors
    assert torch.allclose(tbox[0], torch.tensor([[0.5, 0.5, aw, ah]]))


def test_targets_for_many_images_are_vectorised(model: Model) -> None:
    torch.manual_seed(3)
    n = 200
    t = torch.cat((torch.randint(0, 2, (n, 1)), torch.randint(0, 3, (n, 1)), torch.rand(n, 2), torch.rand(n, 2) * 0.5 + 0.02), 1)
    cl = ComputeLoss(model, make_hyp())
    tcls, tbox, indices, _ = cl.build_targets(zero_preds(model), t.float())
    for lvl, (b, a, gj, gi) in enumerate(indices):
        ny = nx = IMG // (8 * 2**lvl)
        assert b.numel() == tcls[lvl].numel() == tbox[lvl].shape[0]
        assert (gj >= 0).all() and (gj < ny).all() and (gi >= 0).all() and (gi < nx).all()
        assert ((tbox[lvl][:, :2] > -0.5) & (tbox[lvl][:, :2] < 1.5)).all()  # reachable by 2*sig - 0.5
        assert set(b.tolist()) <= {0, 1} and set(a.tolist()) <= {0, 1, 2}


# --------------------------------------------------------------------------------- loss values


def test_perfect_box_gives_zero_box_loss(model: Model) -> None:
    """Zero logits predict xy = 0.5 and wh = anchor: a target exactly there has CIoU 1."""
    aw, ah = model.detect.anchors[0, 1].tolist()
    cl = ComputeLoss(model, make_hyp(anchor_t=1.01))
    loss, items = cl(zero_preds(model), target_at(8.5, 8.5, aw, ah))
    assert items[0].item() == pytest.approx(0.0, abs=1e-6)
    # obj: sigmoid(0)=0.5 everywhere; target 1 at one cell of level 0, 0 elsewhere
    n0 = 2 * 3 * 16 * 16
    bce0 = math.log(2)  # BCE(0 logit, t) is log 2 for t = 0 and t = 1
    expected_obj = bce0 * (4.0 + 1.0 + 0.4)
    assert items[1].item() == pytest.approx(expected_obj, rel=1e-5)
    assert n0 > 0 and items[2].item() == pytest.approx(0.5 * math.log(2), rel=1e-5)
    assert loss.shape == (1,)
    assert loss.item() == pytest.approx(2 * items.sum().item(), rel=1e-6)  # times batch size


def test_loss_finite_positive_and_gradient_flows(model: Model) -> None:
    torch.manual_seed(1)
    model.train()
    model.zero_grad()
    img = torch.rand(2, 3, IMG, IMG)
    t = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [1, 2, 0.6, 0.5, 0.5, 0.4]])
    loss, items = ComputeLoss(model, make_hyp())(model(img), t)
    assert loss.shape == (1,) and items.shape == (3,)
    assert torch.isfinite(loss).all() and loss.item() > 0
    assert (items > 0).all() and not items.requires_grad
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.model[0].conv.weight.grad.abs().sum() > 0  # reaches the stem
    assert all(c.weight.grad.abs().sum() > 0 for c in model.detect.m)
    model.zero_grad()


def test_collapsed_predicted_boxes_give_finite_gradients(model: Model) -> None:
    """A saturated wh logit makes a box side round to 0 in float32; the gradient must stay finite."""
    preds = zero_preds(model, requires_grad=True)
    with torch.no_grad():
        for p in preds:
            p[..., 2:4] = -40.0  # sigmoid -> ~4e-18: width and height collapse
    t = torch.tensor([[0, 0, 0.31, 0.42, 0.2, 0.3], [1, 2, 0.6, 0.5, 0.5, 0.4]])
    loss, _ = ComputeLoss(model, make_hyp())(preds, t)
    loss.backward()
    assert torch.isfinite(loss).all()
    assert all(torch.isfinite(p.grad).all() for p in preds)


def test_zero_targets_only_objectness(model: Model) -> None:
    preds = zero_preds(model, requires_grad=True)
    loss, items = ComputeLoss(model, make_hyp())(preds, torch.zeros((0, 6)))
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    assert loss.item() == pytest.approx(2 * math.log(2) * 5.4, rel=1e-5)
    loss.backward()
    assert (preds[0].grad[..., 4] > 0).all()  # pushes objectness down everywhere
    assert (preds[0].grad[..., :4] == 0).all()


def test_single_class_has_no_class_loss() -> None:
    m = Model(MODELS / "yolov5n.yaml", nc=1)
    _, items = ComputeLoss(m, make_hyp())(zero_preds(m), target_at(5.3, 7.2, 1.5, 2.5, cls=0))
    assert items[2] == 0 and items[0] > 0


def test_hyp_gains_and_options(model: Model) -> None:
    torch.manual_seed(2)
    preds = [torch.randn_like(p) for p in zero_preds(model)]
    t = target_at(5.3, 7.2, 1.5, 2.5)
    _, base = ComputeLoss(model, make_hyp())(preds, t)
    _, scaled = ComputeLoss(model, make_hyp(box=0.1, obj=2.0, cls=1.5))(preds, t)
    assert torch.allclose(scaled, base * torch.tensor([2.0, 2.0, 3.0]), rtol=1e-5)
    _, smooth = ComputeLoss(model, make_hyp(label_smoothing=0.2))(preds, t)
    assert smooth[2] != base[2] and torch.allclose(smooth[:2], base[:2])
    assert smooth_bce(0.2) == pytest.approx((0.9, 0.1))
    _, focal = ComputeLoss(model, make_hyp(fl_gamma=1.5))(preds, t)
    assert (focal[1:] < base[1:]).all() and focal[0] == base[0]  # focal down-weights easy obj/cls
    _, pw = ComputeLoss(model, make_hyp(obj_pw=3.0))(preds, t)
    assert pw[1] > base[1]
    _, from_dict = ComputeLoss(model, AnchorLossGains(**vars(make_hyp())))(preds, t)
    assert torch.equal(from_dict, base)
    with pytest.raises(TypeError, match="anchor_t"):  # a gain cannot be left out
        AnchorLossGains(box=0.05, obj=1.0, cls=0.5)


def test_wrapped_model_and_live_anchors() -> None:
    m = Model(MODELS / "yolov5n.yaml", nc=3)
    cl = ComputeLoss(nn.DataParallel(m), make_hyp())
    assert cl.det is m.detect
    t = target_at(5.3, 7.2, 1.5, 2.5)
    n_before = cl.build_targets(zero_preds(m), t)[2][0][0].numel()
    m.detect.anchors[0] *= 20  # e.g. autoanchor replaced them in place: no level-0 match now
    assert cl.build_targets(zero_preds(m), t)[2][0][0].numel() == 0 < n_before


def test_build_targets_on_the_host_reach_the_loss_device_in_two_copies(model: Model) -> None:
    """The matches are built where the targets are and packed per kind for the copy: the same tensors."""
    t = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [1, 2, 0.6, 0.5, 0.5, 0.4], [1, 1, 0.1, 0.9, 0.05, 0.1]])
    built = ComputeLoss(model, make_hyp()).build_targets(zero_preds(model), t)
    moved = matches_to_device(torch.device("cpu"), *built)
    for level in range(model.detect.nl):
        assert torch.equal(moved[0][level], built[0][level]) and torch.equal(moved[1][level], built[1][level])
        assert all(torch.equal(a, b) for a, b in zip(moved[2][level], built[2][level]))
        assert torch.equal(moved[3][level], built[3][level])
    assert sum(len(c) for c in built[0]) > 0


def test_ddp_leaves_the_anchors_out_of_its_buffer_broadcast() -> None:
    """DDP re-broadcasts buffers at every forward; the anchors (equal on every rank) are left out, so their
    host copy in the loss stays valid instead of being read back from the GPU at every step."""
    assert Model(MODELS / "yolov5n.yaml", nc=3)._ddp_params_and_buffers_to_ignore == ["model.24.anchors"]
    assert Model(MODELS / "yolov8n.yaml", nc=3)._ddp_params_and_buffers_to_ignore == []


@pytest.mark.cuda
def test_the_cuda_loss_from_host_targets_equals_the_cpus_and_follows_live_anchors() -> None:
    torch.manual_seed(0)
    m = Model(MODELS / "yolov5n.yaml", nc=3).train()
    g = copy.deepcopy(m).cuda()
    img = torch.rand(2, 3, IMG, IMG)
    t = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [1, 2, 0.6, 0.5, 0.5, 0.4]])
    _, cpu_items = ComputeLoss(m, make_hyp())(m(img), t)
    cl = ComputeLoss(g, make_hyp())
    _, items = cl(g(img.cuda()), t)
    assert items.device.type == "cuda" and torch.allclose(items.cpu(), cpu_items, rtol=1e-3, atol=1e-6)
    one = target_at(5.3, 7.2, 1.5, 2.5)
    assert cl._anchors(torch.device("cpu")) is cl._anchors(torch.device("cpu"))  # copied once while unchanged
    n_before = cl.build_targets(zero_preds(g), one)[2][0][0].numel()
    g.detect.anchors[0] *= 20  # in place on the GPU: the host copy must follow
    assert cl.build_targets(zero_preds(g), one)[2][0][0].numel() == 0 < n_before


def test_loss_drops_when_fitting_one_batch() -> None:
    torch.manual_seed(0)
    m = Model(MODELS / "yolov5n.yaml", nc=3).train()
    cl = ComputeLoss(m, make_hyp(obj=(IMG / 640) ** 2))
    img = torch.rand(2, 3, IMG, IMG)
    t = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [0, 1, 0.7, 0.6, 0.4, 0.2], [1, 2, 0.5, 0.5, 0.6, 0.7]])
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    losses = []
    for _ in range(20):
        loss, _ = cl(m(img), t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0]
