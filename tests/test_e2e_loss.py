"""YOLO26's end-to-end loss (models/heads/e2e_loss.py) against a plain reference written here.

The reference loops over images, GTs and anchors in Python floats (assignment) and per-anchor
tensors (loss, for autograd); it shares no code with the vectorised loss. CIoU and the GT and
case helpers come from the references of tests/test_tal.py and tests/test_dfl_loss.py.
"""
from __future__ import annotations

import ast
import math
from types import SimpleNamespace

import pytest
import torch

from yolotrain.models.heads.dfl_loss import DFLLoss, DFLLossGains
from yolotrain.models.heads.e2e_loss import E2ELoss, prog_weights, stal_side
from yolotrain.models.heads.tal import TaskAlignedAssigner, make_anchors, pack_targets, pad_targets
from tests.helpers import ROOT
from tests.test_dfl_loss import raw_preds, ref_ciou_torch
from tests.test_tal import CASES, ref_ciou, ref_gts, ref_points, random_predictions
from yolotrain.utils.core.hyp import Hyp

pytestmark = pytest.mark.usefixtures("one_thread")

NC, STRIDES, HW = 3, (8.0, 16.0, 32.0), (64, 96)  # input (height, width): 8x12, 4x6 and 2x3 cells
GAINS = DFLLossGains(box=7.5, cls=0.5, dfl=1.5)
STAL = 16.0  # the second stride
BRANCHES = {"one2many": (10, 10), "one2one": (7, 1)}  # (topk, topk2)


def stand_in_head(reg_max: int = 1, dtype: torch.dtype = torch.float64) -> SimpleNamespace:
    return SimpleNamespace(nc=NC, nl=len(STRIDES), reg_max=reg_max, stride=torch.tensor(STRIDES, dtype=dtype))


def e2e_preds(gen: torch.Generator, bs: int, lo: float = 0.3, hi: float = 4.0) -> dict[str, list[torch.Tensor]]:
    """Random raw outputs of both branches: distances uniform in [lo, hi) grid units, class logits N(0, 2.5)."""
    out = {}
    for name in BRANCHES:
        levels = []
        for s in STRIDES:
            shape = (bs, 4 + NC, int(HW[0] // s), int(HW[1] // s))
            p = torch.randn(shape, generator=gen, dtype=torch.float64) * 2.5
            p[:, :4] = torch.rand(shape[0], 4, *shape[2:], generator=gen, dtype=torch.float64) * (hi - lo) + lo
            levels.append(p.requires_grad_())
        out[name] = levels
    return out


# ------------------------------------------------------------------------------ the reference


def ref_assign(scores, boxes, points, gts, topk: int, topk2: int, min_side: float) -> list[list[dict | None]]:
    """Per image, per anchor: None or {gt, label, box, score}. Candidates: centre inside the GT with sides
    floored to min_side; top-k by score^0.5 * CIoU^6 (metric > 0); an anchor claimed twice goes to the
    best-overlap GT; each GT keeps its topk2 best remaining anchors; scores normalised per GT."""
    out = []
    for b, image_gts in enumerate(gts):
        metric, claims = {}, {}
        for g, (cls, box) in enumerate(image_gts):
            cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
            hw, hh = max(box[2] - box[0], min_side) / 2, max(box[3] - box[1], min_side) / 2
            ranked = []
            for a, (px, py) in enumerate(points):
                if min(px - (cx - hw), py - (cy - hh), cx + hw - px, cy + hh - py) <= 1e-9:
                    continue
                overlap = max(ref_ciou(box, boxes[b][a])[0], 0.0)
                metric[g, a] = (scores[b][a][cls] ** 0.5 * overlap**6, overlap)
                if metric[g, a][0] > 0:
                    ranked.append((metric[g, a][0], a))
            claims[g] = [a for _, a in sorted(ranked, key=lambda t: -t[0])[:topk]]
        owner: dict[int, int] = {}
        for g in range(len(image_gts)):
            for a in claims[g]:
                if a not in owner or metric[g, a][1] > metric[owner[a], a][1]:
                    owner[a] = g
        row: list[dict | None] = [None] * len(points)
        for g, (cls, box) in enumerate(image_gts):
            mine = sorted((a for a, o in owner.items() if o == g), key=lambda a: -metric[g, a][0])[:topk2]
            if mine:
                best_m, best_o = max(metric[g, a][0] for a in mine), max(metric[g, a][1] for a in mine)
                for a in mine:
                    row[a] = {"gt": g, "label": cls, "box": box, "score": metric[g, a][0] * best_o / (best_m + 1e-9)}
        out.append(row)
    return out


def ref_branch(preds: list[torch.Tensor], targets: torch.Tensor, topk: int, topk2: int, min_side: float = STAL,
               seen: list | None = None) -> list[torch.Tensor]:
    """One branch's [box, cls, l1] (gain-scaled) from the definitions, one anchor at a time (reg_max 1)."""
    bs = preds[0].shape[0]
    anchors = [(lvl, y, x, s) for lvl, (p, s) in enumerate(zip(preds, STRIDES))
               for y in range(p.shape[2]) for x in range(p.shape[3])]
    raw = [[preds[lvl][b, :, y, x] for lvl, y, x, _ in anchors] for b in range(bs)]
    boxes = [[torch.stack((x + 0.5 - v[0], y + 0.5 - v[1], x + 0.5 + v[2], y + 0.5 + v[3]))
              for v, (_, y, x, _) in zip(row, anchors)] for row in raw]
    scores = [[torch.sigmoid(v[4:]).tolist() for v in row] for row in raw]
    pixel = [[(bx.detach() * s).tolist() for bx, (*_, s) in zip(row, anchors)] for row in boxes]
    assigned = ref_assign(scores, pixel, [[(x + 0.5) * s, (y + 0.5) * s] for _, y, x, s in anchors],
                          ref_gts(targets.tolist(), bs, HW), topk, topk2, min_side)
    if seen is not None:
        seen.append(assigned)
    score_sum = max(sum(a["score"] for row in assigned for a in row if a is not None), 1.0)
    lbox = lcls = l1 = preds[0].new_zeros(())
    for b in range(bs):
        for i, (_, y, x, s) in enumerate(anchors):
            a, z = assigned[b][i], raw[b][i][4:]
            t = torch.zeros(NC, dtype=z.dtype)
            if a is not None:
                t[a["label"]] = a["score"]
            lcls = lcls + (torch.clamp(z, min=0) - z * t + torch.log1p(torch.exp(-z.abs()))).sum()
            if a is None:
                continue
            tb = [c / s for c in a["box"]]
            lbox = lbox + (1 - ref_ciou_torch(boxes[b][i], tb)) * a["score"]
            want = (x + 0.5 - tb[0], y + 0.5 - tb[1], tb[2] - x - 0.5, tb[3] - y - 0.5)
            sides = [abs(raw[b][i][k] - want[k]) * s / (HW[1] if k % 2 == 0 else HW[0]) for k in range(4)]
            l1 = l1 + sum(sides) / 4 * a["score"]
    return [lbox / score_sum * GAINS.box, lcls / score_sum * GAINS.cls, l1 / score_sum * GAINS.dfl]


def ref_loss(preds: dict, targets: torch.Tensor, o2m: float, o2o: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    many = ref_branch(preds["one2many"], targets, *BRANCHES["one2many"])
    one = ref_branch(preds["one2one"], targets, *BRANCHES["one2one"])
    return (o2m * sum(many) + o2o * sum(one)) * preds["one2one"][0].shape[0], one


def leaves(preds: dict) -> list[torch.Tensor]:
    return preds["one2many"] + preds["one2one"]


def clone(preds: dict) -> dict:
    return {k: [p.detach().clone().requires_grad_() for p in v] for k, v in preds.items()}


# ------------------------------------------------------------------------------ assignment


@pytest.mark.parametrize("branch", sorted(BRANCHES))
@pytest.mark.parametrize("case", ["random", "tiny", "crowd", "edges", "empty_image_beside_many"])
def test_assignment_matches_reference(case, branch):
    gen = torch.Generator().manual_seed(1)
    targets = CASES[case](gen, NC)
    shapes = [(HW[0] // int(s), HW[1] // int(s)) for s in STRIDES]
    grid, strides = make_anchors(shapes, torch.tensor(STRIDES, dtype=torch.float64))
    points = grid * strides
    scores, boxes = random_predictions(gen, 3, points, NC, (0.3, 4.0) if case == "tiny" else (2.0, 60.0))
    gt = pad_targets(targets, 3, torch.tensor(HW, dtype=torch.float64))
    topk, topk2 = BRANCHES[branch]
    got = TaskAlignedAssigner(topk=topk, topk2=topk2, min_side=STAL)(scores, boxes, points, *gt)
    want = ref_assign(scores.tolist(), boxes.tolist(), ref_points(shapes, STRIDES), ref_gts(targets.tolist(), 3, HW),
                      topk, topk2, STAL)
    assert torch.equal(got.fg, torch.tensor([[r is not None for r in row] for row in want]))
    for b, row in enumerate(want):
        for a, r in enumerate(row):
            expected = torch.zeros(NC, dtype=torch.float64)
            if r is None:
                assert got.gt_index[b, a] == 0
            else:
                assert got.gt_index[b, a] == r["gt"] and got.labels[b, a] == r["label"]
                assert got.boxes[b, a].tolist() == pytest.approx(r["box"], rel=1e-12, abs=1e-12)
                expected[r["label"]] = r["score"]
            assert torch.allclose(got.scores[b, a], expected, rtol=1e-9, atol=1e-15)
    if branch == "one2many":  # topk2 equal to (or above) topk changes nothing: the assigner of the DFL family
        for topk2 in (None, 12):
            same = TaskAlignedAssigner(topk=10, topk2=topk2, min_side=STAL)
            assert all(torch.equal(x, y) for x, y in zip(got, same(scores, boxes, points, *gt)))
    if branch == "one2one":  # one positive per GT at most, and a GT with one2many positives keeps one
        per_gt = torch.zeros_like(gt[2], dtype=torch.long).scatter_add_(1, got.gt_index, got.fg.long())
        many = TaskAlignedAssigner(topk=7, min_side=STAL)(scores, boxes, points, *gt)
        had = torch.zeros_like(per_gt).scatter_add_(1, many.gt_index, many.fg.long()) > 0
        assert per_gt.max() <= 1 and torch.equal(per_gt == 1, had)


def test_narrowing_keeps_the_best_metric_positive_of_the_wide_pool():
    """topk2 picks from the top-7 pool: the one-to-one positive is that pool's best-metric anchor for the GT."""
    points = torch.tensor([[4.0, 4.0], [12.0, 4.0], [20.0, 4.0], [4.0, 12.0]], dtype=torch.float64)
    scores = torch.tensor([[[0.2], [0.9], [0.5], [0.7]]], dtype=torch.float64)
    boxes = torch.tensor([[[0, 0, 24, 16]] * 4], dtype=torch.float64)  # same box everywhere: the score decides
    gt = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([[[0, 0, 24, 16]]], dtype=torch.float64),
          torch.ones(1, 1, dtype=torch.bool))
    wide = TaskAlignedAssigner(topk=7)(scores, boxes, points, *gt)
    one = TaskAlignedAssigner(topk=7, topk2=1)(scores, boxes, points, *gt)
    assert wide.fg.tolist() == [[True] * 4] and one.fg.tolist() == [[False, True, False, False]]
    assert one.scores[0, 1, 0].item() == pytest.approx(1.0, rel=1e-6)  # its own metric is the GT's best


def test_stal_floors_tiny_sides_to_the_second_stride_for_candidates_only():
    assert stal_side(torch.tensor(STRIDES)) == 16.0 and stal_side(torch.tensor([32.0])) == 32.0
    with pytest.raises(ValueError, match="strides are not set"):
        E2ELoss(SimpleNamespace(nc=1, nl=3, reg_max=1, stride=torch.zeros(3)), GAINS)
    # A 3x2 px GT between stride-8 centres (4 and 12): no candidate unless widened to 16 px ((2, 0) to (18, 16)).
    points, _ = make_anchors([(8, 12)], torch.tensor([8.0], dtype=torch.float64))
    points = points * 8
    gt = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([[[8.5, 7.0, 11.5, 9.0]]], dtype=torch.float64),
          torch.ones(1, 1, dtype=torch.bool))
    scores = torch.full((1, len(points), 1), 0.5, dtype=torch.float64)
    boxes = gt[1].expand(1, len(points), 4)  # every prediction is the GT: only the candidate rule decides
    plain = TaskAlignedAssigner(topk=10)(scores, boxes, points, *gt)
    stal = TaskAlignedAssigner(topk=10, min_side=STAL)(scores, boxes, points, *gt)
    assert not plain.fg.any()
    assert stal.fg[0].nonzero().flatten().tolist() == [0, 1, 12, 13]  # the centres (4|12, 4|12)
    assert (stal.boxes[0, stal.fg[0]] == gt[1][0, 0]).all()  # targets are the real, tiny box
    criterion = E2ELoss(stand_in_head(), GAINS)
    assert criterion.one2many.min_side == criterion.one2one.min_side == STAL
    assert E2ELoss(stand_in_head(), GAINS, stal=False).one2one.min_side == 0


# ------------------------------------------------------------------------------ loss values and gradients


def compare(preds: dict, targets: torch.Tensor, epoch: int = 3, epochs: int = 10) -> torch.Tensor:
    """E2ELoss against the reference on copies of ``preds``: items, total and every input's gradient."""
    criterion = E2ELoss(stand_in_head(), GAINS)
    criterion.set_progress(epoch, epochs)
    mine, theirs = clone(preds), clone(preds)
    loss, items = criterion(mine, targets)
    want, want_items = ref_loss(theirs, targets, *prog_weights(epoch, epochs))
    assert loss.shape == (1,) and items.shape == (3,) and not items.requires_grad
    assert items.tolist() == pytest.approx([w.item() for w in want_items], rel=1e-9, abs=1e-300)
    assert loss.item() == pytest.approx(want.item(), rel=1e-9)
    got_g = torch.autograd.grad(loss.sum(), leaves(mine))
    want_g = torch.autograd.grad(want, leaves(theirs), allow_unused=True)
    for g, w in zip(got_g, want_g):
        w = torch.zeros_like(g) if w is None else w
        assert (g - w).abs().max() <= 1e-9 * max(w.abs().max().item(), 1e-12)
    return items


@pytest.mark.parametrize("case", ["random", "tiny", "crowd", "one_target", "no_targets"])
def test_loss_and_gradients_match_reference(case):
    gen = torch.Generator().manual_seed(2)
    targets = CASES[case](gen, NC)
    preds = e2e_preds(gen, 3, *((0.05, 0.5) if case == "tiny" else (-0.2, 4.0)))  # some inverted boxes too
    items = compare(preds, targets)
    if case in ("random", "tiny", "crowd"):
        assert (items > 0).all()  # every term is exercised


def test_tiny_boxes_between_all_centres_train_only_through_stal():
    """GTs of a few pixels at points between the centres of every level: without STAL no anchor is a candidate;
    with it each GT gets 4 one-to-many positives and 1 one-to-one positive, and the loss matches the reference.
    Every anchor predicts its image's GT box (raw distances, negative off the box) plus noise: overlaps > 0."""
    targets = torch.tensor([[0, 1, 32 / 96, 32 / 64, 3 / 96, 2 / 64], [1, 2, 64 / 96, 32 / 64, 1 / 96, 1 / 64]],
                           dtype=torch.float64)
    gen = torch.Generator().manual_seed(9)
    preds = e2e_preds(gen, 2)
    for levels in preds.values():
        for p, s in zip(levels, STRIDES):
            h, w = p.shape[2:]
            gx = (torch.arange(w, dtype=torch.float64) + 0.5).expand(h, w)
            gy = (torch.arange(h, dtype=torch.float64)[:, None] + 0.5).expand(h, w)
            for b, (_, _, xc, yc, bw, bh) in enumerate(targets.tolist()):
                x1, y1, x2, y2 = [v / s for v in ((xc - bw / 2) * 96, (yc - bh / 2) * 64, (xc + bw / 2) * 96,
                                                  (yc + bh / 2) * 64)]
                noise = torch.rand(4, h, w, generator=gen, dtype=torch.float64) * 0.02
                p.data[b, :4] = torch.stack((gx - x1, gy - y1, x2 - gx, y2 - gy)) + noise
    for min_side, want in ((STAL, (4, 1)), (0.0, (0, 0))):
        counts = []
        for branch, (topk, topk2) in BRANCHES.items():
            seen: list = []
            ref_branch(preds[branch], targets, topk, topk2, min_side=min_side, seen=seen)
            counts.append([sum(r is not None for r in row) for row in seen[0]])
        assert counts == [[want[0]] * 2, [want[1]] * 2]
    items = compare(preds, targets)
    assert items[0] > 0 and items[2] > 0


def test_reported_items_are_the_one_to_one_branch_and_the_total_follows_progloss():
    gen = torch.Generator().manual_seed(3)
    targets = CASES["random"](gen, NC)
    preds = e2e_preds(gen, 3)
    criterion = E2ELoss(stand_in_head(), GAINS)
    _, only_one = criterion(preds["one2one"], targets)  # a plain list: the one-to-one branch alone
    for epoch, epochs in ((0, 10), (9, 10)):
        criterion.set_progress(epoch, epochs)
        loss, items = criterion(preds, targets)
        assert torch.equal(items, only_one)
        o2m, o2o = prog_weights(epoch, epochs)
        many = criterion.branch(preds["one2many"], criterion.geometry(preds["one2one"], pack_targets(targets, 3, "cpu"), torch.float64),
                                criterion.one2many, torch.float64)
        assert loss.item() == pytest.approx(3 * (o2m * many.sum().item() + o2o * items.sum().item()), rel=1e-12)


def test_progloss_weights_at_first_middle_and_last_epoch():
    assert prog_weights(0, 100) == (0.8, pytest.approx(0.2, abs=1e-15))
    assert prog_weights(50, 101) == pytest.approx((0.45, 0.55), abs=1e-15)  # halfway: 0.1 + 0.7 / 2
    assert prog_weights(99, 100) == pytest.approx((0.1, 0.9), abs=1e-15)
    assert prog_weights(150, 100) == prog_weights(99, 100)  # past the end it stays at the final weight
    assert prog_weights(0, 1) == (0.8, pytest.approx(0.2, abs=1e-15))  # one epoch: the initial weights
    o2m = [prog_weights(e, 30)[0] for e in range(30)]
    steps = [a - b for a, b in zip(o2m, o2m[1:])]
    assert steps == pytest.approx([0.7 / 29] * 29, abs=1e-15)  # linear, one step per epoch
    criterion = E2ELoss(stand_in_head(), GAINS)
    assert (criterion.o2m, criterion.o2o) == prog_weights(0, 30)  # before set_progress: epoch 0's
    criterion.set_progress(20, 30)
    criterion.set_progress(7, 30)  # a resume: only (epoch, epochs) matters, not what came before
    assert (criterion.o2m, criterion.o2o) == prog_weights(7, 30)
    on_device = criterion.weights(torch.device("cpu"))  # what the loss multiplies by, where its outputs are
    criterion.set_progress(12, 30)
    assert criterion.weights(torch.device("cpu")) is on_device  # changed in place: a captured graph reads it
    assert on_device.tolist() == list(prog_weights(12, 30))


# ------------------------------------------------------------------------------ DFL heads and contract


def test_with_dfl_bins_each_branch_is_the_dfl_loss():
    """reg_max 16: a branch's items equal DFLLoss's with the same assigner (the anchor-free loss unchanged)."""
    gen = torch.Generator().manual_seed(4)
    targets = CASES["random"](gen, NC)
    preds = raw_preds(gen, 3)
    criterion = E2ELoss(stand_in_head(reg_max=16), GAINS)
    geo = criterion.geometry(preds, pack_targets(targets, 3, "cpu"), torch.float64)
    for assigner in (criterion.one2many, criterion.one2one):
        got = criterion.branch(preds, geo, assigner, torch.float64)
        _, want = DFLLoss(stand_in_head(reg_max=16), DFLLossGains(7.5, 0.5, 1.5), assigner)(preds, targets)
        assert got.tolist() == pytest.approx(want.tolist(), rel=1e-12)


def test_gains_from_hyp_float32_and_autocast():
    assert DFLLossGains.from_hyp(Hyp(box=7.5, cls=0.5, dfl=1.5)) == GAINS
    gen = torch.Generator().manual_seed(6)
    targets = CASES["random"](gen, NC).float()
    preds = {k: [p.detach().float() for p in v] for k, v in e2e_preds(gen, 3).items()}
    criterion = E2ELoss(stand_in_head(dtype=torch.float32), GAINS)
    assert criterion.loss_names == ("box", "cls", "dfl")
    loss, items = criterion(preds, targets)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16, items16 = criterion(preds, targets)
    assert loss16.dtype == torch.float32 and torch.equal(items16, items)


def test_loss_reads_nothing_back_from_the_device():
    """Meta-device outputs and head: a host sync per call (.item(), a boolean-mask gather) would raise."""
    gen = torch.Generator().manual_seed(7)
    head = stand_in_head(dtype=torch.float32)
    criterion = E2ELoss(head, GAINS)  # STAL's side is read here, once
    head.stride = head.stride.to("meta")
    preds = {k: [p.detach().float().to("meta").requires_grad_() for p in v] for k, v in e2e_preds(gen, 2).items()}
    targets = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [1, 2, 0.5, 0.5, 0.01, 0.02]])
    loss, items = criterion._loss(preds, pack_targets(targets, 2, "meta"))  # _loss: autocast has no meta device
    loss.backward()
    assert loss.device.type == items.device.type == preds["one2one"][0].grad.device.type == "meta"


def test_loss_is_batched_code_only():
    """The loss's only Python loops run over pyramid levels or the strides, never images or objects."""
    tree = ast.parse((ROOT / "models" / "heads" / "e2e_loss.py").read_text())
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While, ast.AsyncFor, ast.comprehension))]
    levels = {"preds", "one2many", "one2one", "strides.detach().cpu().tolist()"}
    assert loops and all(isinstance(n, ast.comprehension) and ast.unparse(n.iter) in levels for n in loops)


def test_loss_drops_when_fitting_one_batch():
    """Two 1x1-conv branches per level on fixed features (reg_max 1, box bias 2 cells as Ultralytics starts):
    plain SGD with momentum drives the one-to-one items down under a mid-run ProgLoss weighting."""
    torch.manual_seed(0)
    feats = [torch.randn(2, 16, int(HW[0] // s), int(HW[1] // s)) for s in STRIDES]
    convs = {k: torch.nn.ModuleList(torch.nn.Conv2d(16, 4 + NC, 1) for _ in STRIDES) for k in BRANCHES}
    for levels in convs.values():
        for conv, s in zip(levels, STRIDES):
            torch.nn.init.constant_(conv.bias[:4], 2.0)
            torch.nn.init.constant_(conv.bias[4:], math.log(5 / NC / (640 / s) ** 2))
    targets = torch.tensor([[0, 0, 0.3, 0.4, 0.2, 0.3], [0, 1, 0.7, 0.6, 0.05, 0.04], [1, 2, 0.5, 0.5, 0.6, 0.7]])
    criterion = E2ELoss(stand_in_head(dtype=torch.float32), GAINS)
    criterion.set_progress(5, 10)
    params = [p for levels in convs.values() for p in levels.parameters()]
    velocity = [torch.zeros_like(p) for p in params]
    items = []
    for _ in range(60):
        preds = {k: [conv(f) for conv, f in zip(levels, feats)] for k, levels in convs.items()}
        loss, it = criterion(preds, targets)
        grads = torch.autograd.grad(loss.sum(), params)
        with torch.no_grad():
            for p, v, g in zip(params, velocity, grads):
                p.sub_(0.01 * v.mul_(0.9).add_(g))
        items.append(it)
    assert torch.isfinite(torch.stack(items)).all() and (items[-1] < 0.6 * items[0]).all()


@pytest.mark.cuda
def test_cuda_loss_and_gradients_equal_cpu():
    gen = torch.Generator().manual_seed(8)
    targets = CASES["random"](gen, NC).float()
    preds = {k: [p.detach().float() for p in v] for k, v in e2e_preds(gen, 3).items()}
    results = []
    for device in ("cpu", "cuda"):
        head = stand_in_head(dtype=torch.float32)
        head.stride = head.stride.to(device)
        moved = {k: [p.detach().to(device).requires_grad_() for p in v] for k, v in preds.items()}
        loss, items = E2ELoss(head, GAINS)(moved, targets)  # host targets, as the loader gives them
        results.append((loss.cpu(), items.cpu(), [g.cpu() for g in torch.autograd.grad(loss.sum(), leaves(moved))]))
    (loss, items, grads), (loss_c, items_c, grads_c) = results
    assert torch.allclose(loss_c, loss, rtol=1e-4) and torch.allclose(items_c, items, rtol=1e-4)
    assert all((a - b).abs().max() <= 1e-4 * b.abs().max() for a, b in zip(grads_c, grads))
