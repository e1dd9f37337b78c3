"""Task-aligned assignment (models/heads/tal.py) against a plain reference written here from the definitions.

The reference loops over images, GTs and anchors in Python floats and shares no code with the
vectorised assigner; test_dfl_loss.py reuses it for the loss.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from yolotrain.models.heads.tal import (TaskAlignedAssigner, bbox2dist, bbox_ciou, dist2bbox, make_anchors, pad_targets,
                              xywh2xyxy)

pytestmark = pytest.mark.usefixtures("one_thread")

STRIDES = (8, 16, 32)
TAL = Path(__file__).resolve().parents[1] / "models" / "heads" / "tal.py"


# ------------------------------------------------------------------------------ the reference


def ref_ciou(a: list[float], b: list[float], eps: float = 1e-7) -> tuple[float, float]:
    """Complete IoU of two xyxy boxes, and its aspect-term coefficient alpha (held constant in gradients).

    IoU - (centre distance^2 / enclosing diagonal^2) - alpha * v, v = 4/pi^2 (atan(w2/h2) - atan(w1/h1))^2,
    alpha = v / (1 - IoU + v); eps on heights, the union and the diagonal as Ultralytics places them.
    """
    w1, h1 = a[2] - a[0], a[3] - a[1] + eps
    w2, h2 = b[2] - b[0], b[3] - b[1] + eps
    iw = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    ih = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    inter = iw * ih
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    cw = max(a[2], b[2]) - min(a[0], b[0])
    ch = max(a[3], b[3]) - min(a[1], b[1])
    c2 = cw**2 + ch**2 + eps
    rho2 = ((b[0] + b[2] - a[0] - a[2]) ** 2 + (b[1] + b[3] - a[1] - a[3]) ** 2) / 4
    v = 4 / math.pi**2 * (math.atan(w2 / h2) - math.atan(w1 / h1)) ** 2
    alpha = v / (v - iou + 1 + eps)
    return iou - (rho2 / c2 + v * alpha), alpha


def ref_assign(scores: list[list[list[float]]], boxes: list[list[list[float]]], points: list[list[float]],
               gts: list[list[tuple[int, list[float]]]], topk: int = 10, alpha: float = 0.5, beta: float = 6.0,
               min_side: float = 0.0) -> list[list[dict | None]]:
    """Per image, per anchor: None (background) or {gt, label, box, score}.

    scores[b][a][c] probabilities, boxes[b][a] xyxy pixels, points[a] (x, y) pixels,
    gts[b] = [(class, xyxy pixels), ...] in slot order.
    """
    out = []
    for b, image_gts in enumerate(gts):
        na = len(points)
        metric = {}  # (gt, anchor) -> (metric, overlap) for candidates
        positives: dict[int, list[int]] = {}  # gt -> its top-k anchors
        for g, (cls, box) in enumerate(image_gts):
            x1, y1, x2, y2 = box
            if min_side > 0:
                cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
                hw, hh = max(x2 - x1, min_side) / 2, max(y2 - y1, min_side) / 2
                x1, y1, x2, y2 = cx - hw, cy - hh, cx + hw, cy + hh
            ranked = []
            for a in range(na):
                px, py = points[a]
                if min(px - x1, py - y1, x2 - px, y2 - py) <= 1e-9:
                    continue  # not a candidate
                overlap = max(ref_ciou(box, boxes[b][a])[0], 0.0)
                m = scores[b][a][cls] ** alpha * overlap**beta
                metric[g, a] = (m, overlap)
                if m > 0:
                    ranked.append((m, a))
            ranked.sort(key=lambda t: -t[0])
            positives[g] = [a for _, a in ranked[:topk]]
        owner: dict[int, int] = {}  # anchor -> the GT that keeps it
        for g in range(len(image_gts)):
            for a in positives[g]:
                if a not in owner or metric[g, a][1] > metric[owner[a], a][1]:
                    owner[a] = g  # several GTs claim it: the best overlap wins, the first GT on ties
        row: list[dict | None] = [None] * na
        for g, (cls, box) in enumerate(image_gts):
            mine = [a for a, o in owner.items() if o == g]
            if not mine:
                continue
            best_metric = max(metric[g, a][0] for a in mine)
            best_overlap = max(metric[g, a][1] for a in mine)
            for a in mine:
                row[a] = {"gt": g, "label": cls, "box": box,
                          "score": metric[g, a][0] * best_overlap / (best_metric + 1e-9)}
        out.append(row)
    return out


def ref_points(shapes: list[tuple[int, int]], strides=STRIDES) -> list[list[float]]:
    """Anchor centres in pixels, level by level, row by row."""
    return [[(x + 0.5) * s, (y + 0.5) * s] for (h, w), s in zip(shapes, strides) for y in range(h) for x in range(w)]


def ref_gts(targets: list[list[float]], batch: int, hw: tuple[int, int]) -> list[list[tuple[int, list[float]]]]:
    """Normalised [image, class, xc, yc, w, h] rows -> per image [(class, xyxy pixels)] in row order."""
    h, w = hw
    out: list[list[tuple[int, list[float]]]] = [[] for _ in range(batch)]
    for img, cls, xc, yc, bw, bh in targets:
        out[int(img)].append((int(cls), [(xc - bw / 2) * w, (yc - bh / 2) * h, (xc + bw / 2) * w, (yc + bh / 2) * h]))
    return out


# ------------------------------------------------------------------------------ cases


def random_targets(gen: torch.Generator, counts: list[int], nc: int,
                   size: tuple[float, float] = (0.05, 0.6)) -> torch.Tensor:
    rows = []
    for img, n in enumerate(counts):
        for _ in range(n):
            xc, yc = torch.rand(2, generator=gen, dtype=torch.float64).tolist()
            bw, bh = (torch.rand(2, generator=gen, dtype=torch.float64) * (size[1] - size[0]) + size[0]).tolist()
            rows.append([img, int(torch.randint(nc, (1,), generator=gen)), xc, yc, bw, bh])
    return torch.tensor(rows, dtype=torch.float64).view(-1, 6)


def edge_targets() -> torch.Tensor:
    """Boxes touching every image edge and corner, clipped the way labels are (inside [0, 1])."""
    return torch.tensor([[0, 0, 0.1, 0.5, 0.2, 0.6], [0, 1, 0.9, 0.5, 0.2, 0.3], [0, 2, 0.5, 0.05, 0.7, 0.1],
                         [0, 0, 0.5, 0.95, 0.3, 0.1], [1, 1, 0.5, 0.5, 1.0, 1.0], [1, 2, 0.125, 0.125, 0.25, 0.25],
                         [1, 0, 0.875, 0.875, 0.25, 0.25]], dtype=torch.float64)


def tiny_targets() -> torch.Tensor:
    """Boxes of a few pixels (in a 64 x 96 input): over an anchor centre, between centres, sub-pixel."""
    return torch.tensor([[0, 0, 4.5 / 96, 4.5 / 64, 3 / 96, 3 / 64], [0, 1, 8.0 / 96, 8.0 / 64, 2 / 96, 2 / 64],
                         [0, 2, 0.5, 0.5, 0.5 / 96, 0.5 / 64], [1, 1, 20.5 / 96, 12.3 / 64, 6 / 96, 1 / 64]],
                        dtype=torch.float64)


def crowd_targets(gen: torch.Generator, n: int, nc: int) -> torch.Tensor:
    """n boxes jittered around one object, plus an exact duplicate: many anchors are claimed twice."""
    base = torch.tensor([0.45, 0.5, 0.4, 0.5], dtype=torch.float64)
    boxes = base + (torch.rand(n, 4, generator=gen, dtype=torch.float64) - 0.5) * torch.tensor([0.2, 0.2, 0.3, 0.3])
    classes = torch.randint(nc, (n, 1), generator=gen).double()
    rows = torch.cat((torch.zeros(n, 1, dtype=torch.float64), classes, boxes), 1)
    return torch.cat((rows, rows[:1]))


def random_predictions(gen: torch.Generator, bs: int, points: torch.Tensor, nc: int,
                       px: tuple[float, float] = (2.0, 60.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores in (0, 1) and boxes around each anchor (ltrb uniform in px), float64."""
    scores = torch.rand(bs, len(points), nc, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    ltrb = torch.rand(bs, len(points), 4, generator=gen, dtype=torch.float64) * (px[1] - px[0]) + px[0]
    return scores, dist2bbox(ltrb, points)


CASES = {
    "random": lambda g, nc: random_targets(g, [3, 7, 1], nc),
    "one_target": lambda g, nc: torch.tensor([[1, 2, 0.4, 0.6, 0.3, 0.2]], dtype=torch.float64),
    "no_targets": lambda g, nc: torch.zeros(0, 6, dtype=torch.float64),
    "empty_image_beside_many": lambda g, nc: random_targets(g, [0, 25, 0], nc),
    "edges": lambda g, nc: edge_targets(),
    "tiny": lambda g, nc: tiny_targets(),
    "crowd": lambda g, nc: crowd_targets(g, 30, nc),
}
PRED_PX = {"tiny": (0.3, 4.0)}  # predicted sides small enough to overlap tiny boxes
HW = (64, 96)  # input (height, width): levels of 8x12, 4x6 and 2x3 cells


def run_both(case: str, seed: int, topk: int = 10, min_side: float = 0.0, nc: int = 3, bs: int = 3):
    gen = torch.Generator().manual_seed(seed)
    targets = CASES[case](gen, nc)
    shapes = [(HW[0] // s, HW[1] // s) for s in STRIDES]
    grid, strides = make_anchors(shapes, torch.tensor(STRIDES, dtype=torch.float64))
    points = grid * strides
    scores, boxes = random_predictions(gen, bs, points, nc, PRED_PX.get(case, (2.0, 60.0)))
    labels, gt_boxes, mask = pad_targets(targets, bs, torch.tensor(HW, dtype=torch.float64))
    got = TaskAlignedAssigner(topk=topk, min_side=min_side)(scores, boxes, points, labels, gt_boxes, mask)
    want = ref_assign(scores.tolist(), boxes.tolist(), ref_points(shapes), ref_gts(targets.tolist(), bs, HW),
                      topk=topk, min_side=min_side)
    return got, want, targets


def check_against_reference(got, want, nc: int = 3) -> int:
    """Exact foreground, GT, class and box; soft scores to 1e-9 relative. Returns the foreground count."""
    fg = torch.tensor([[r is not None for r in row] for row in want])
    assert torch.equal(got.fg, fg)
    n = 0
    for b, row in enumerate(want):
        for a, r in enumerate(row):
            expected = torch.zeros(nc, dtype=torch.float64)
            if r is not None:
                n += 1
                assert got.gt_index[b, a] == r["gt"] and got.labels[b, a] == r["label"]
                assert got.boxes[b, a].tolist() == pytest.approx(r["box"], rel=1e-12, abs=1e-12)
                expected[r["label"]] = r["score"]
            assert torch.allclose(got.scores[b, a], expected, rtol=1e-9, atol=1e-15)
    return n


# ------------------------------------------------------------------------------ geometry


def test_make_anchors_order_points_and_strides():
    points, strides = make_anchors([(2, 3), (1, 2)], torch.tensor([8.0, 16.0]))
    assert points.tolist() == [[0.5, 0.5], [1.5, 0.5], [2.5, 0.5], [0.5, 1.5], [1.5, 1.5], [2.5, 1.5],
                               [0.5, 0.5], [1.5, 0.5]]
    assert strides.view(-1).tolist() == [8.0] * 6 + [16.0] * 2 and strides.shape == (8, 1)
    assert (points * strides).tolist() == ref_points([(2, 3), (1, 2)], (8, 16))
    points64, _ = make_anchors([(2, 2)], torch.tensor([4.0], dtype=torch.float64))
    assert points64.dtype == torch.float64


def test_dist_and_box_round_trip_and_clamp():
    gen = torch.Generator().manual_seed(0)
    points = torch.rand(5, 2, generator=gen) * 10
    ltrb = torch.rand(5, 4, generator=gen) * 5
    boxes = dist2bbox(ltrb, points)
    assert torch.allclose(boxes, torch.cat((points - ltrb[:, :2], points + ltrb[:, 2:]), 1))
    assert torch.allclose(bbox2dist(points, boxes), ltrb, atol=1e-6)
    far = torch.tensor([[-100.0, 0.0, 100.0, 0.5]])  # the point (0, 1) lies below this box
    assert bbox2dist(torch.tensor([[0.0, 1.0]]), far, 14.99).tolist() == [pytest.approx([14.99, 1.0, 14.99, 0.0])]
    assert xywh2xyxy(torch.tensor([4.0, 6.0, 2.0, 4.0])).tolist() == [3.0, 4.0, 5.0, 8.0]


def test_ciou_matches_the_definition():
    gen = torch.Generator().manual_seed(1)
    a = dist2bbox(torch.rand(50, 4, generator=gen, dtype=torch.float64) * 20, torch.rand(50, 2, generator=gen) * 30)
    b = dist2bbox(torch.rand(50, 4, generator=gen, dtype=torch.float64) * 20, torch.rand(50, 2, generator=gen) * 30)
    got = bbox_ciou(a, b)
    want = [ref_ciou(x, y)[0] for x, y in zip(a.tolist(), b.tolist())]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-14)
    assert bbox_ciou(a, a).tolist() == pytest.approx([1.0] * 50, abs=1e-6)
    assert torch.allclose(bbox_ciou(a, b), bbox_ciou(b, a), rtol=1e-12)
    assert bbox_ciou(a[:, None], b[None]).shape == (50, 50)  # broadcasts


# ------------------------------------------------------------------------------ pad_targets


def test_pad_targets_unsorted_rows_and_an_empty_image():
    t = torch.tensor([[2, 1, 0.5, 0.5, 0.2, 0.4], [0, 0, 0.25, 0.5, 0.5, 0.5], [2, 2, 0.1, 0.1, 0.2, 0.2],
                      [0, 3, 0.75, 0.25, 0.1, 0.1], [2, 0, 0.9, 0.9, 0.2, 0.2]])
    labels, boxes, mask = pad_targets(t, 4, torch.tensor([100.0, 200.0]))  # (h, w)
    assert labels.shape == (4, 3) and boxes.shape == (4, 3, 4) and mask.shape == (4, 3)
    assert mask.tolist() == [[True, True, False], [False] * 3, [True] * 3, [False] * 3]
    assert labels.tolist() == [[0, 3, 0], [0, 0, 0], [1, 2, 0], [0, 0, 0]]  # each image keeps its own order
    want = ref_gts(t.tolist(), 4, (100, 200))
    for b in range(4):
        for g, (cls, box) in enumerate(want[b]):
            assert boxes[b, g].tolist() == pytest.approx(box) and labels[b, g] == cls
    assert (boxes[~mask] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["random", "crowd", "empty_image_beside_many"])
def test_pad_targets_from_host_rows_to_cuda_equal_the_cpus(case):
    """The loader's host rows padded for a CUDA loss (in page-locked memory, one copy): the CPU's tensors."""
    targets = CASES[case](torch.Generator().manual_seed(0), 3).float()
    cpu = pad_targets(targets, 3, torch.tensor(HW, dtype=torch.float32))
    gpu = pad_targets(targets, 3, torch.tensor(HW, dtype=torch.float32, device="cuda"))
    for a, b in zip(cpu, gpu):
        assert b.device.type == "cuda" and b.dtype == a.dtype and torch.equal(a, b.cpu())


def test_pad_targets_none_at_all():
    labels, boxes, mask = pad_targets(torch.zeros(0, 6), 3, torch.tensor([64.0, 64.0]))
    assert labels.shape == (3, 0) and boxes.shape == (3, 0, 4) and mask.shape == (3, 0)


# ------------------------------------------------------------------------------ assigner vs reference


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", sorted(CASES))
def test_assigner_matches_reference(case, seed):
    got, want, targets = run_both(case, seed)
    n = check_against_reference(got, want)
    if case == "no_targets":
        assert n == 0 and got.scores.abs().sum() == 0
    else:
        assert n > 0
    if case == "empty_image_beside_many":
        assert not got.fg[0].any() and not got.fg[2].any() and got.fg[1].sum() > 10


def test_crowd_really_has_conflicts_and_duplicates_go_to_the_first_slot():
    """Many anchors are claimed by several GTs in the crowd case; the duplicated GT (slot 30) loses every tie."""
    gen = torch.Generator().manual_seed(0)
    targets = crowd_targets(gen, 30, 3)
    targets[-1, 1] = targets[0, 1]  # same class too: the duplicate's metrics equal GT 0's everywhere
    shapes = [(HW[0] // s, HW[1] // s) for s in STRIDES]
    grid, strides = make_anchors(shapes, torch.tensor(STRIDES, dtype=torch.float64))
    points = grid * strides
    scores, boxes = random_predictions(gen, 1, points, 3)
    labels, gt_boxes, mask = pad_targets(targets, 1, torch.tensor(HW, dtype=torch.float64))
    assigner = TaskAlignedAssigner()
    got = assigner(scores, boxes, points, labels, gt_boxes, mask)
    # how many anchors several GTs' top-k claimed, computed from the reference's own pieces
    want = ref_assign(scores.tolist(), boxes.tolist(), ref_points(shapes), ref_gts(targets.tolist(), 1, HW))
    check_against_reference(got, want)
    assert (got.gt_index[got.fg] != 30).all() and (got.gt_index[got.fg] == 0).any()
    claims = torch.zeros(len(points))
    for g in range(len(targets)):  # count top-k claims per anchor with the assigner on one GT at a time
        one = assigner(scores, boxes, points, labels[:, g:g + 1], gt_boxes[:, g:g + 1], mask[:, g:g + 1])
        claims += one.fg[0]
    assert (claims > 1).sum() > 5


@pytest.mark.parametrize("topk", [1, 3, 500])
def test_topk_setting_and_more_than_the_anchors(topk):
    got, want, _ = run_both("random", 7, topk=topk)  # 500 > the 126 anchors: every positive-metric candidate
    check_against_reference(got, want)


def test_tiny_boxes_between_centres_need_min_side():
    got, want, _ = run_both("tiny", 0)
    check_against_reference(got, want)
    got16, want16, _ = run_both("tiny", 0, min_side=16.0)
    check_against_reference(got16, want16)
    # A 2-pixel box centred on (32, 32) px lies between anchor centres of every level: no candidate
    # without min_side; floored to 16 px ((24, 24) to (40, 40)) it holds four stride-8 centres, and
    # the anchors there predicting a box on it become positives.
    shapes = [(HW[0] // s, HW[1] // s) for s in STRIDES]
    grid, strides = make_anchors(shapes, torch.tensor(STRIDES, dtype=torch.float64))
    points = grid * strides
    boxes = torch.tensor([30.5, 30.5, 33.5, 33.5], dtype=torch.float64).expand(1, len(points), 4)
    scores = torch.full((1, len(points), 3), 0.5, dtype=torch.float64)
    gt = (torch.tensor([[1]]), torch.tensor([[[31.0, 31.0, 33.0, 33.0]]], dtype=torch.float64), torch.tensor([[True]]))
    assert not TaskAlignedAssigner()(scores, boxes, points, *gt).fg.any()
    fg = TaskAlignedAssigner(min_side=16.0)(scores, boxes, points, *gt).fg[0]
    assert fg.nonzero().view(-1).tolist() == [39, 40, 51, 52]  # level 0, rows 3-4, columns 3-4
    want = ref_assign(scores.tolist(), boxes.tolist(), points.tolist(), [[(1, [31.0, 31.0, 33.0, 33.0])]],
                      min_side=16.0)
    assert [a for a, r in enumerate(want[0]) if r is not None] == [39, 40, 51, 52]


def test_assigner_is_batched_code_only():
    """No Python loop per image or per object: the module's only loop is make_anchors' over pyramid levels.

    (A timing test of growth with object count would be flaky; this keeps the property by inspection.)
    """
    tree = ast.parse(TAL.read_text())
    loops = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, (ast.For, ast.While, ast.comprehension, ast.AsyncFor)):
                    loops.append(fn.name)
    assert set(loops) == {"make_anchors"}
