"""DFLLoss (the anchor-free head's criterion) against a plain per-anchor reference, its edge cases, and that it trains.

The reference decodes, assigns (tests/test_tal.py's loop reference) and sums the three terms one
anchor at a time with scalar torch ops, so autograd gives its gradient w.r.t. the raw outputs too.
"""
from __future__ import annotations

import ast
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from yolotrain.models.heads.dfl_loss import AnchorGrid, DFLLoss, DFLLossGains, distribution_focal_loss, distribution_mean
from yolotrain.models.heads.tal import TaskAlignedAssigner, make_anchors, pack_targets
from tests.helpers import ROOT
from tests.test_tal import CASES, ref_assign, ref_ciou, ref_gts
from yolotrain.utils.core.hyp import OPTIONAL_HYP, Hyp, load_hyp

pytestmark = pytest.mark.usefixtures("one_thread")

NC, REG_MAX, STRIDES = 3, 16, (8.0, 16.0, 32.0)
HW = (64, 96)  # input (height, width), as tests/test_tal.py
GAINS = DFLLossGains(box=7.5, cls=0.5, dfl=1.5)


def stand_in_head(nc: int = NC, reg_max: int = REG_MAX, dtype: torch.dtype = torch.float64) -> SimpleNamespace:
    """The attributes the loss reads from a head (yolotrain.models.heads.dfl_loss.DistributionHead)."""
    return SimpleNamespace(nc=nc, nl=len(STRIDES), reg_max=reg_max, stride=torch.tensor(STRIDES, dtype=dtype))


def raw_preds(gen: torch.Generator, bs: int, small_boxes: bool = False, dtype=torch.float64,
              hw: tuple[int, int] = HW, bin_slope: float | None = None) -> list[torch.Tensor]:
    """Random raw outputs (B, 4 * reg_max + nc, H, W) per level; bin_slope < 0 (small_boxes: -1.5) moves the
    distance mass to the first bins, > 0 to the last."""
    bin_slope = -1.5 if small_boxes else bin_slope
    preds = []
    for s in STRIDES:
        shape = (bs, 4 * REG_MAX + NC, int(hw[0] // s), int(hw[1] // s))
        p = torch.randn(shape, generator=gen, dtype=torch.float64) * 2.5
        if bin_slope is not None:
            p[:, : 4 * REG_MAX] += torch.arange(REG_MAX, dtype=torch.float64).repeat(4).view(1, -1, 1, 1) * bin_slope
        preds.append(p.to(dtype).requires_grad_())
    return preds


# ------------------------------------------------------------------------------ the reference


def ref_ciou_torch(a: torch.Tensor, b: list[float], eps: float = 1e-7) -> torch.Tensor:
    """CIoU of a predicted xyxy box (a tensor, differentiable) with a target box; alpha held constant."""
    _, alpha = ref_ciou(a.tolist(), b, eps)
    w1, h1 = a[2] - a[0], a[3] - a[1] + eps
    w2, h2 = b[2] - b[0], b[3] - b[1] + eps
    inter = torch.clamp(torch.minimum(a[2], a.new_tensor(b[2])) - torch.maximum(a[0], a.new_tensor(b[0])), min=0) * \
        torch.clamp(torch.minimum(a[3], a.new_tensor(b[3])) - torch.maximum(a[1], a.new_tensor(b[1])), min=0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    cw = torch.maximum(a[2], a.new_tensor(b[2])) - torch.minimum(a[0], a.new_tensor(b[0]))
    ch = torch.maximum(a[3], a.new_tensor(b[3])) - torch.minimum(a[1], a.new_tensor(b[1]))
    rho2 = ((b[0] + b[2] - a[0] - a[2]) ** 2 + (b[1] + b[3] - a[1] - a[3]) ** 2) / 4
    v = 4 / math.pi**2 * (math.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    return iou - (rho2 / (cw**2 + ch**2 + eps) + v * alpha)


def ref_loss(preds: list[torch.Tensor], targets: torch.Tensor, gains: DFLLossGains = GAINS, min_side: float = 0.0,
             hw: tuple[int, int] = HW, seen: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(total * batch size, [box, cls, dfl]) from the definitions, one anchor at a time.

    ``seen`` collects (level, distances to the target box in grid units) of every positive.
    """
    bs, r = preds[0].shape[0], REG_MAX
    bins = torch.arange(r, dtype=preds[0].dtype)
    anchors = [(lvl, y, x, s) for lvl, (p, s) in enumerate(zip(preds, STRIDES))
               for y in range(p.shape[2]) for x in range(p.shape[3])]
    logits, boxes = [], []  # per image, per anchor: class logits and predicted box (grid units)
    for b in range(bs):
        lg, bx = [], []
        for lvl, y, x, _ in anchors:
            v = preds[lvl][b, :, y, x]
            d = [torch.softmax(v[k * r:(k + 1) * r], 0) @ bins for k in range(4)]
            bx.append(torch.stack((x + 0.5 - d[0], y + 0.5 - d[1], x + 0.5 + d[2], y + 0.5 + d[3])))
            lg.append(v[4 * r:])
        logits.append(lg)
        boxes.append(bx)
    scores = [[torch.sigmoid(v).tolist() for v in lg] for lg in logits]
    pixel_boxes = [[(bx.detach() * s).tolist() for bx, (_, _, _, s) in zip(row, anchors)] for row in boxes]
    points = [[(x + 0.5) * s, (y + 0.5) * s] for _, y, x, s in anchors]
    assigned = ref_assign(scores, pixel_boxes, points, ref_gts(targets.tolist(), bs, hw), min_side=min_side)

    score_sum = max(sum(a["score"] for row in assigned for a in row if a is not None), 1.0)
    lbox = lcls = ldfl = preds[0].new_zeros(())
    for b in range(bs):
        for i, (lvl, y, x, s) in enumerate(anchors):
            a = assigned[b][i]
            t = torch.zeros(NC, dtype=preds[0].dtype)
            if a is not None:
                t[a["label"]] = a["score"]
            z = logits[b][i]
            lcls = lcls + (torch.clamp(z, min=0) - z * t + torch.log1p(torch.exp(-z.abs()))).sum()  # BCE with logits
            if a is None:
                continue
            target = [c / s for c in a["box"]]
            lbox = lbox + (1 - ref_ciou_torch(boxes[b][i], target)) * a["score"]
            px, py = x + 0.5, y + 0.5
            v = preds[lvl][b, :, y, x]
            side = 0.0
            dists = (px - target[0], py - target[1], target[2] - px, target[3] - py)
            if seen is not None:
                seen.append((lvl, dists))
            for k, dist in enumerate(dists):
                dist = min(max(dist, 0.0), r - 1 - 0.01)
                left = math.floor(dist)
                logp = torch.log_softmax(v[k * r:(k + 1) * r], 0)
                side = side - ((left + 1 - dist) * logp[left] + (dist - left) * logp[left + 1])
            ldfl = ldfl + side / 4 * a["score"]
    items = [lbox / score_sum * gains.box, lcls / score_sum * gains.cls, ldfl / score_sum * gains.dfl]
    return (items[0] + items[1] + items[2]) * bs, items


def compare(preds: list[torch.Tensor], targets: torch.Tensor, min_side: float = 0.0, hw: tuple[int, int] = HW,
            seen: list | None = None) -> tuple[float, float]:
    """Vectorised vs reference on the same raw outputs: (worst relative value error, worst relative gradient error)."""
    head = stand_in_head()
    mine = [p.detach().clone().requires_grad_() for p in preds]
    theirs = [p.detach().clone().requires_grad_() for p in preds]
    loss, items = DFLLoss(head, GAINS, TaskAlignedAssigner(min_side=min_side))(mine, targets)
    want, want_items = ref_loss(theirs, targets, min_side=min_side, hw=hw, seen=seen)
    loss.sum().backward()
    want.backward()
    value = max(abs(g - w.item()) / max(abs(w.item()), 1e-300) for g, w in zip(items.tolist() + [loss.item()],
                                                                                want_items + [want]))
    grad = max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() for a, b in zip(mine, theirs))
    return value, grad


# ------------------------------------------------------------------------------ against the reference


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_and_gradient_match_reference(case, seed):
    gen = torch.Generator().manual_seed(seed)
    targets = CASES[case](gen, NC)
    preds = raw_preds(gen, 3, small_boxes=case == "tiny")
    value, grad = compare(preds, targets)
    assert value < 1e-9 and grad < 1e-9


def test_reference_cases_exercise_every_term():
    """The random cases give positives with non-zero box and DFL terms, incl. tiny and edge boxes."""
    for case in ("random", "edges", "tiny", "crowd", "empty_image_beside_many"):
        gen = torch.Generator().manual_seed(0)
        targets = CASES[case](gen, NC)
        _, items = DFLLoss(stand_in_head(), GAINS)(raw_preds(gen, 3, small_boxes=case == "tiny"), targets)
        assert (items > 0).all(), case


def test_min_side_matches_reference():
    gen = torch.Generator().manual_seed(3)
    targets = CASES["tiny"](gen, NC)
    value, grad = compare(raw_preds(gen, 3, small_boxes=True), targets, min_side=16.0)
    assert value < 1e-9 and grad < 1e-9


def test_distances_beyond_the_last_bin_and_behind_the_anchor_match_reference():
    """Large boxes on a larger input: level-0 positives whose true distance exceeds reg_max - 1 cells (clamped
    to 14.99); with min_side, positives outside a tiny box (distance below 0, clamped to 0)."""
    gen = torch.Generator().manual_seed(8)
    hw = (192, 256)
    targets = torch.tensor([[0, 1, 0.5, 0.5, 1.0, 1.0], [0, 2, 0.35, 0.6, 0.7, 0.8], [1, 0, 0.5, 0.5, 0.02, 0.03]],
                           dtype=torch.float64)
    preds = raw_preds(gen, 2, hw=hw, bin_slope=0.4)  # image 0: large boxes
    small = raw_preds(gen, 2, hw=hw, small_boxes=True)
    for p, q in zip(preds, small):
        p.data[1] = q.data[1]  # image 1: small boxes, around the tiny one
    seen: list = []
    value, grad = compare(preds, targets, min_side=16.0, hw=hw, seen=seen)
    assert value < 1e-9 and grad < 1e-9
    assert any(lvl == 0 and max(d) > REG_MAX - 1 for lvl, d in seen)
    assert any(min(d) < 0 for _, d in seen)


def test_float32_is_close_to_the_float64_reference():
    gen = torch.Generator().manual_seed(5)
    targets = CASES["random"](gen, NC)
    preds64 = raw_preds(gen, 3)
    preds32 = [p.detach().float().requires_grad_() for p in preds64]
    loss, items = DFLLoss(stand_in_head(dtype=torch.float32), GAINS)(preds32, targets.float())
    assert loss.dtype == torch.float32
    loss.backward()
    want, want_items = ref_loss(preds64, targets)
    want.backward()
    assert items.tolist() == pytest.approx([w.item() for w in want_items], rel=1e-5)
    for a, b in zip(preds32, preds64):
        assert (a.grad.double() - b.grad).abs().max() < 1e-5 * b.grad.abs().max()


# ------------------------------------------------------------------------------ edge cases


def test_no_targets_trains_only_the_classifier_down():
    gen = torch.Generator().manual_seed(0)
    preds = raw_preds(gen, 2)
    loss, items = DFLLoss(stand_in_head(), GAINS)(preds, torch.zeros(0, 6))
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    z = torch.cat([p.detach()[:, 4 * REG_MAX:].flatten() for p in preds])
    bce = (z.clamp(min=0) + torch.log1p(torch.exp(-z.abs()))).sum()  # every class target 0, divided by max(0, 1)
    assert loss.item() == pytest.approx(2 * 0.5 * bce.item(), rel=1e-12)
    loss.backward()
    for p in preds:
        assert torch.isfinite(p.grad).all()
        assert (p.grad[:, : 4 * REG_MAX] == 0).all() and (p.grad[:, 4 * REG_MAX:] > 0).all()


def test_image_without_targets_gets_only_negatives():
    gen = torch.Generator().manual_seed(1)
    preds = raw_preds(gen, 3)
    loss, _ = DFLLoss(stand_in_head(), GAINS)(preds, CASES["empty_image_beside_many"](gen, NC))
    loss.backward()
    for p in preds:
        for b in (0, 2):  # the empty images: no box gradient, classes pushed down
            assert (p.grad[b, : 4 * REG_MAX] == 0).all() and (p.grad[b, 4 * REG_MAX:] > 0).all()
    assert all(p.grad[1, : 4 * REG_MAX].abs().sum() > 0 for p in preds[:2])  # its neighbour's boxes train


def test_saturated_outputs_and_degenerate_boxes_stay_finite():
    gen = torch.Generator().manual_seed(2)
    preds = raw_preds(gen, 2, dtype=torch.float32)
    with torch.no_grad():
        for p in preds:
            p.mul_(40)  # one-hot distributions (distances of exactly 0 or 15) and saturated classes
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.0, 0.2], [0, 2, 0.3, 0.3, 1e-6, 1e-6], [1, 0, 0.5, 0.5, 1.0, 1.0],
                            [1, 0, 0.0, 0.0, 0.1, 0.1]])
    loss, items = DFLLoss(stand_in_head(dtype=torch.float32), GAINS)(preds, targets)
    loss.backward()
    assert torch.isfinite(loss).all() and torch.isfinite(items).all()
    assert all(torch.isfinite(p.grad).all() for p in preds)


def test_row_order_of_targets_does_not_matter():
    gen = torch.Generator().manual_seed(4)
    targets = CASES["random"](gen, NC)
    preds = raw_preds(gen, 3)
    criterion = DFLLoss(stand_in_head(), GAINS)
    loss, items = criterion(preds, targets)
    shuffled, _ = criterion(preds, targets[torch.randperm(len(targets), generator=gen)])
    assert shuffled.item() == pytest.approx(loss.item(), rel=1e-12)


def test_outputs_contract_and_autocast():
    gen = torch.Generator().manual_seed(6)
    targets = CASES["random"](gen, NC).float()
    preds = [p.detach().float() for p in raw_preds(gen, 3)]
    criterion = DFLLoss(stand_in_head(dtype=torch.float32), GAINS)
    assert criterion.loss_names == ("box", "cls", "dfl")
    loss, items = criterion(preds, targets)
    assert loss.shape == (1,) and items.shape == (3,) and not items.requires_grad
    assert loss.item() == pytest.approx(3 * items.sum().item(), rel=1e-6)
    half = [p.bfloat16() for p in preds]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16, items16 = criterion(half, targets)
    assert loss16.dtype == torch.float32  # computed in float32 whatever the outputs' precision
    assert torch.equal(items16, criterion([p.float() for p in half], targets)[1])


def test_gains_scale_items_and_come_from_hyp(project_log):
    gen = torch.Generator().manual_seed(7)
    targets = CASES["random"](gen, NC)
    preds = raw_preds(gen, 3)
    _, base = DFLLoss(stand_in_head(), GAINS)(preds, targets)
    _, scaled = DFLLoss(stand_in_head(), DFLLossGains(box=15.0, cls=0.25, dfl=4.5))(preds, targets)
    assert torch.allclose(scaled, base * torch.tensor([2.0, 0.5, 3.0], dtype=torch.float64), rtol=1e-12)
    assert DFLLossGains.from_hyp(Hyp(box=1.0, cls=2.0, dfl=3.0)) == DFLLossGains(box=1.0, cls=2.0, dfl=3.0)
    assert Hyp().dfl == 1.5 and "dfl" in OPTIONAL_HYP
    v8 = load_hyp(ROOT / "hyps" / "hyp.v8.yaml")
    assert project_log == []  # every key present, none ignored with a warning
    assert DFLLossGains.from_hyp(v8) == DFLLossGains(box=7.5, cls=0.5, dfl=1.5)
    assert (v8.lr0, v8.lrf, v8.momentum, v8.weight_decay, v8.close_mosaic, v8.mosaic) == (0.01, 0.01, 0.937, 0.0005,
                                                                                          10, 1.0)
    with pytest.raises(TypeError):
        DFLLossGains(box=7.5, cls=0.5)  # a gain cannot be left out


def test_distribution_helpers():
    logits = torch.zeros(2, 4 * REG_MAX)
    assert distribution_mean(logits, REG_MAX).tolist() == [[7.5] * 4] * 2  # uniform: the middle of 0..15
    one_hot = torch.full((4 * REG_MAX,), -1e4)
    one_hot[[3, REG_MAX + 0, 2 * REG_MAX + 15, 3 * REG_MAX + 9]] = 0
    assert distribution_mean(one_hot, REG_MAX).tolist() == [3.0, 0.0, 15.0, 9.0]
    lg = torch.randn(5, REG_MAX, dtype=torch.float64)
    t = torch.tensor([0.0, 2.25, 7.5, 14.0, 14.99], dtype=torch.float64)
    want = []
    for row, x in zip(lg, t.tolist()):  # cross-entropy against mass (1 - f) on bin floor(x) and f on the next
        left, f = math.floor(x), x - math.floor(x)
        want.append(-((1 - f) * torch.log_softmax(row, 0)[left] + f * torch.log_softmax(row, 0)[left + 1]).item())
    assert distribution_focal_loss(lg, t).tolist() == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------ training


class TinyHead(nn.Module):
    """A 1x1 conv per level on fixed random features: the shapes of a real DFL head, nothing else."""

    def __init__(self, ch: int = 16, nc: int = NC) -> None:
        super().__init__()
        self.nc, self.nl, self.reg_max = nc, len(STRIDES), REG_MAX
        self.register_buffer("stride", torch.tensor(STRIDES))
        self.m = nn.ModuleList(nn.Conv2d(ch, 4 * REG_MAX + nc, 1) for _ in STRIDES)
        for conv, s in zip(self.m, STRIDES):  # class prior as anchor-free heads start: few objects per cell
            nn.init.constant_(conv.bias[4 * REG_MAX:], math.log(5 / nc / (640 / s) ** 2))

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        return [conv(f) for conv, f in zip(self.m, feats)]


def test_loss_drops_when_fitting_one_batch():
    torch.manual_seed(0)
    head = TinyHead()
    feats = [torch.randn(2, 16, int(HW[0] // s), int(HW[1] // s)) for s in STRIDES]
    targets = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [0, 1, 0.7, 0.6, 0.4, 0.5], [1, 2, 0.5, 0.5, 0.6, 0.7],
                            [1, 0, 0.05, 0.9, 0.1, 0.2]])
    criterion = DFLLoss(head, GAINS)
    params = list(head.parameters())
    velocity = [torch.zeros_like(p) for p in params]
    losses, items = [], []
    for _ in range(60):  # SGD with momentum by hand: torch.optim's first use costs a second of imports
        loss, it = criterion(head(feats), targets)
        head.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p, v in zip(params, velocity):
                v.mul_(0.9).add_(p.grad)
                p.sub_(0.02 * v)
        losses.append(loss.item())
        items.append(it)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.3 * losses[0]
    assert (items[-1] < items[0]).all()  # box, cls and DFL all improved


def test_loss_is_batched_code_only():
    """The loss's only Python loops run over pyramid levels (the raw outputs), never images or objects."""
    tree = ast.parse((ROOT / "models" / "heads" / "dfl_loss.py").read_text())
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor, ast.comprehension))]
    assert loops and all(isinstance(n, ast.comprehension) and ast.unparse(n.iter) == "preds" for n in loops)


def test_loss_reads_nothing_back_from_the_device():
    """Outputs on the meta device (shapes, no data) with the loader's host targets: any host sync
    in target padding, assignment or the loss (int(), .item(), a boolean-mask gather) would raise."""
    torch.manual_seed(0)
    head = TinyHead()
    feats = [torch.randn(2, 16, int(HW[0] // s), int(HW[1] // s)) for s in STRIDES]
    preds = [p.detach().to("meta").requires_grad_() for p in head(feats)]
    head.to("meta")
    targets = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [1, 2, 0.5, 0.5, 0.6, 0.7], [1, 0, 0.05, 0.9, 0.1, 0.2]])
    loss, items = DFLLoss(head, GAINS)._loss(preds, pack_targets(targets, 2, "meta"))  # _loss: no autocast on meta
    loss.backward()
    assert loss.device.type == items.device.type == preds[0].grad.device.type == "meta"


def test_diverged_targets_give_a_nan_loss_not_an_index_error():
    """NaN distances (predictions that blew up) must surface as a NaN loss, which train.py reports
    and stops on together on every rank, not as an out-of-range gather."""
    logits = torch.zeros(3, REG_MAX)
    out = distribution_focal_loss(logits, torch.tensor([float("nan"), 2.5, float("inf")]))
    assert out[0].isnan() and out[1].isfinite() and not out[2].isfinite()


def test_the_anchor_grid_is_kept_until_shapes_dtype_or_strides_change():
    """A loss's anchors are made once per input size and kept, and made again for another size, dtype, or a
    stride that set_strides wrote in place or that .to() replaced: always what make_anchors gives."""
    grid, stride, cpu = AnchorGrid(), torch.tensor([8.0, 16.0]), torch.device("cpu")

    def check(anchors, shapes, stride, dtype):
        points, strides = make_anchors(shapes, stride.to(dtype))
        assert torch.equal(anchors[0], points) and torch.equal(anchors[1], strides)
        assert anchors[2].tolist() == [shapes[0][0] * stride[0].item(), shapes[0][1] * stride[0].item()]
        assert anchors[3].tolist() == anchors[2].flip(0).repeat(2).tolist()  # (w, h, w, h)

    small, large = [(4, 6), (2, 3)], [(8, 8), (4, 4)]
    first = grid(small, stride, torch.float32, cpu)
    check(first, small, stride, torch.float32)
    assert grid(small, stride, torch.float32, cpu) is first  # kept
    check(grid(large, stride, torch.float32, cpu), large, stride, torch.float32)
    # still kept after another shape (a validation pass): a CUDA graph of the loss reads these tensors in place
    assert grid(small, stride, torch.float32, cpu) is first
    check(grid(large, stride, torch.float64, cpu), large, stride, torch.float64)
    stride.copy_(torch.tensor([4.0, 8.0]))  # set_strides
    check(grid(large, stride, torch.float64, cpu), large, stride, torch.float64)
    other = stride.clone()  # a module's .to() puts a new tensor in its place
    again = grid(large, other, torch.float64, cpu)
    assert grid(large, other, torch.float64, cpu) is again
    check(again, large, other, torch.float64)
