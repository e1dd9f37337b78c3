"""The task-aligned assigner's CIoU in GT slices (dense scenes): bit-identical to one pass."""
from __future__ import annotations

import pytest
import torch

from yolotrain.models.heads import tal
from yolotrain.models.heads.chunks import cat_in_chunks
from yolotrain.models.heads.tal import TaskAlignedAssigner, bbox_ciou, dist2bbox, make_anchors, pad_targets

STRIDES = (8.0, 16.0, 32.0)
HW = (64, 104)  # 8x13 + 4x7 + 2x4 = 140 anchors: not a multiple of any SIMD width


def scene(dtype: torch.dtype, bs: int = 3, gts: int = 37, nc: int = 5, seed: int = 0, device: str = "cpu"):
    """Random predictions and ``gts`` overlapping GTs in each image, as the loss hands them to the assigner."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(-(-HW[0] // int(s)), -(-HW[1] // int(s))) for s in STRIDES]
    grid, strides = make_anchors(shapes, torch.tensor(STRIDES, dtype=dtype))
    points = grid * strides
    scores = torch.rand(bs, len(points), nc, generator=gen, dtype=dtype) * 0.98 + 0.01
    boxes = dist2bbox(torch.rand(bs, len(points), 4, generator=gen, dtype=dtype) * 40 + 1, points)
    image = torch.arange(bs).repeat_interleave(gts)[:, None].to(dtype)
    rows = torch.cat((image, torch.randint(nc, (bs * gts, 1), generator=gen).to(dtype),
                      torch.rand(bs * gts, 2, generator=gen, dtype=dtype),
                      torch.rand(bs * gts, 2, generator=gen, dtype=dtype) * 0.5 + 0.02), 1)
    rows = rows[: bs * gts - 5]  # the last image has fewer GTs: padding rows in the slices too
    gt = pad_targets(rows, bs, torch.tensor(HW, dtype=dtype))
    return [t.to(device) for t in (scores, boxes, points, *gt)]


def one_pass_overlap(assigner: TaskAlignedAssigner, boxes, points, gt_boxes, gt_mask) -> torch.Tensor:
    """The assigner's overlap as it was computed before slicing: one CIoU over (B, M, A)."""
    candidate = assigner.candidates(points, gt_boxes) & gt_mask[..., None]
    return torch.where(candidate, bbox_ciou(gt_boxes[:, :, None], boxes[:, None]).clamp(min=0), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sliced_overlap_is_bit_identical_to_one_pass(dtype, monkeypatch):
    scores, boxes, points, labels, gt_boxes, mask = scene(dtype)
    bs, m, na = gt_boxes.shape[0], gt_boxes.shape[1], points.shape[0]
    calls = []
    monkeypatch.setattr(tal, "bbox_ciou", lambda *a, **k: calls.append(a[0].shape[1]) or bbox_ciou(*a, **k))
    sliced = TaskAlignedAssigner(chunk=5 * bs * na)
    candidate = sliced.candidates(points, gt_boxes) & mask[..., None]
    got = sliced.overlaps(gt_boxes, boxes, candidate)
    assert calls == [5] * (m // 5) + [m % 5] and m % 5  # several slices, the last one short
    assert torch.equal(got, one_pass_overlap(sliced, boxes, points, gt_boxes, mask))
    assert (got > 0).sum() > 100  # a real scene: many candidates overlap


@pytest.mark.parametrize("chunk", [1, 7 * 3 * 140])
def test_sliced_assignment_equals_the_one_pass_assignment(chunk):
    inputs = scene(torch.float32, seed=1)
    whole = TaskAlignedAssigner(chunk=1 << 40)(*inputs)
    sliced = TaskAlignedAssigner(chunk=chunk)(*inputs)
    assert whole.fg.any()
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)


def test_the_default_slice_covers_an_ordinary_scene_in_one_call(monkeypatch):
    """Slicing costs nothing in the usual case: a 640-px batch of 16 with 100 GTs each is one CIoU call."""
    calls = []
    monkeypatch.setattr(tal, "cat_in_chunks", lambda fn, n, step, dim=1: calls.append((n, step)))  # plan only
    assigner = TaskAlignedAssigner()
    gt = torch.tensor([[0.0, 0.0, 10.0, 10.0]]).expand(16, 100, 4)
    pd = torch.tensor([[1.0, 1.0, 9.0, 9.0]]).expand(16, 8400, 4)
    assigner.overlaps(gt, pd, torch.ones(16, 100, 1, dtype=torch.bool).expand(16, 100, 8400))
    (n, step), = calls
    assert n == 100 and step >= n


def test_cat_in_chunks_writes_every_slice_in_place():
    x = torch.arange(2 * 11 * 3.0).view(2, 11, 3)
    seen = []
    out = cat_in_chunks(lambda s: seen.append((s.start, s.stop)) or x[:, s] * 2, 11, 4)
    assert seen == [(0, 4), (4, 8), (8, 12)] and torch.equal(out, x * 2)
    assert torch.equal(cat_in_chunks(lambda s: x[:, s] + 1, 11, 0), x + 1)  # step 0 means one GT at a time
    assert torch.equal(cat_in_chunks(lambda s: x[:, s], 11, 100), x)


@pytest.mark.cuda
def test_sliced_assignment_on_cuda_equals_one_pass():
    inputs = scene(torch.float32, seed=2, device="cuda")
    whole = TaskAlignedAssigner(chunk=1 << 40)(*inputs)
    sliced = TaskAlignedAssigner(chunk=3 * 3 * 140)(*inputs)
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)
