"""Task-aligned assignment (TOOD, as the anchor-free YOLO family trains) and the geometry it needs.

An anchor here is a grid-cell centre of one pyramid level. For each ground-truth box (GT) the
candidates are the anchor centres strictly inside it; each candidate is scored by how well the
current prediction there already does the job, ``score^alpha * overlap^beta`` (score: the
predicted probability of the GT's class; overlap: CIoU of the predicted box with the GT, clamped
at 0, as Ultralytics does). The k best candidates of each GT become its positives, an anchor
claimed by several GTs keeps the one it overlaps most, and the class target of a positive is not
1 but the alignment normalised per GT (best positive of a GT gets that GT's best overlap), so the
classifier learns to rank boxes by their localisation quality.

Everything runs batched over images and GTs: images carry their GTs padded to the batch's largest
count with a mask (``pack_targets`` on the host, ``unpack_targets`` on the device), so no Python loop runs per
image or per object.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from yolotrain.models.heads.base import cell_centres
from yolotrain.models.heads.chunks import cat_in_chunks

TAL_TOPK = 10  # positives per GT (Ultralytics' v8DetectionLoss)
TAL_ALPHA = 0.5  # weight of the class score in the alignment metric
TAL_BETA = 6.0  # weight of the overlap in the alignment metric
INSIDE_EPS = 1e-9  # an anchor centre must lie more than this inside every side of a GT
CIOU_EPS = 1e-7
CIOU_CHUNK = 1 << 24  # elements per (B, GTs, A) temporary of the assigner's CIoU: dense scenes go in GT slices


# ------------------------------------------------------------------------------------ geometry


def make_anchors(shapes: Sequence[tuple[int, int]], strides: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor points (A, 2) as (x, y) in each level's grid units and their strides (A, 1).

    ``shapes`` are the levels' (height, width); anchors run level by level, row-major within a
    level, which is the order of ``torch.cat([p.flatten(2) for p in preds], 2)``. ``strides``
    (nl,) sets the device and dtype; it stays on the device (no host copy), so pixel points are
    ``points * strides``. The points are the cell centres the heads decode from (base.cell_centres).
    """
    points, stride_col = [], []
    for i, (h, w) in enumerate(shapes):
        points.append(cell_centres(strides, h, w).T)
        stride_col.append(strides[i].expand(h * w, 1))
    return torch.cat(points), torch.cat(stride_col)


def dist2bbox(distance: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """(left, top, right, bottom) distances from the points (..., 4) -> boxes (x1, y1, x2, y2)."""
    lt, rb = distance.chunk(2, -1)
    return torch.cat((points - lt, points + rb), -1)


def bbox2dist(points: torch.Tensor, boxes: torch.Tensor, max_dist: float | None = None) -> torch.Tensor:
    """Boxes (x1, y1, x2, y2) -> (left, top, right, bottom) distances from the points.

    ``max_dist`` clamps to [0, max_dist]: the largest distance a DFL distribution can represent,
    so a box reaching further (or a point outside it) still gets a finite target at the edge.
    """
    x1y1, x2y2 = boxes.chunk(2, -1)
    dist = torch.cat((points - x1y1, x2y2 - points), -1)
    return dist if max_dist is None else dist.clamp(0, max_dist)


def xywh2xyxy(xywh: torch.Tensor) -> torch.Tensor:
    """Centre/size -> corners, out of place and differentiable (yolotrain.utils.core.boxes writes in place)."""
    xy, wh = xywh.chunk(2, -1)
    return torch.cat((xy - wh / 2, xy + wh / 2), -1)


def aspect_angle(box: torch.Tensor, eps: float = CIOU_EPS) -> torch.Tensor:
    """atan(w / (h + eps)) of xyxy boxes, as ``bbox_ciou`` computes it: computed once on each side's own
    (unbroadcast) boxes, so a CIoU evaluated in slices gets bit-identical aspect terms."""
    wh = box[..., 2:] - box[..., :2]
    return torch.atan(wh[..., 0] / (wh[..., 1] + eps))


def bbox_ciou(box1: torch.Tensor, box2: torch.Tensor, eps: float = CIOU_EPS,
              angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Complete IoU of xyxy boxes (broadcast over leading dims) -> (...,), Ultralytics' eps placement.

    CIoU = IoU - centre distance^2 / enclosing diagonal^2 - alpha * v (aspect term). alpha is held
    constant for the gradient, as the CIoU paper prescribes, so v only pulls on the aspect ratio.
    The eps added to heights keeps atan(w / h) finite for a zero-height box. ``angles``: both
    boxes' ``aspect_angle``, when the caller computed them already.
    """
    # x and y go through each step as one pair (the last dim of 2), so a step is one kernel, not two; each
    # element's arithmetic, and its order, is the per-coordinate formula's
    lt1, rb1, lt2, rb2 = box1[..., :2], box1[..., 2:], box2[..., :2], box2[..., 2:]
    wh1, wh2 = rb1 - lt1, rb2 - lt2
    w1, h1, w2, h2 = wh1[..., 0], wh1[..., 1] + eps, wh2[..., 0], wh2[..., 1] + eps
    overlap = (torch.minimum(rb1, rb2) - torch.maximum(lt1, lt2)).clamp(min=0)
    inter = overlap[..., 0] * overlap[..., 1]
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    enclosing = (torch.maximum(rb1, rb2) - torch.minimum(lt1, lt2)).pow(2)
    c2 = enclosing[..., 0] + enclosing[..., 1] + eps
    centres = (lt2 + rb2 - lt1 - rb1).pow(2)
    rho2 = (centres[..., 0] + centres[..., 1]) / 4
    a1, a2 = angles if angles is not None else (torch.atan(w1 / h1), torch.atan(w2 / h2))
    v = (4 / math.pi**2) * (a2 - a1).pow(2)
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / c2 + v * alpha)


# ------------------------------------------------------------------------------------ targets


def pad_targets(
    targets: torch.Tensor, batch_size: int, image_hw: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, 6) rows [image, class, xc, yc, w, h] (normalised) -> per-image GTs padded to the largest count:
    ``unpack_targets(pack_targets(...))`` on ``image_hw``'s device.

    Returns classes (B, M) long, boxes (B, M, 4) xyxy in input pixels and the mask (B, M) of real
    rows; padding is class 0, box 0 and masked out, and more of it changes no loss (the assigner never
    picks a masked slot). Rows may come in any image order (a stable sort keeps each image's own order).
    ``image_hw`` (2,) is the input size. Image indices must be below batch_size (not checked).
    """
    return unpack_targets(pack_targets(targets, batch_size, image_hw.device), image_hw)


def pack_targets(targets: torch.Tensor, batch_size: int, device: torch.device, slots: int = 0) -> torch.Tensor:
    """(N, 6) rows -> (B, M, 6) [class, xc, yc, w, h, real] on ``device``, M the largest count per image (at
    least ``slots``; a CUDA graph keeps M fixed across batches this way).

    The padding is built where ``targets`` are: the loader's host tensor, so reading M (a shape) costs no
    device sync; for a CUDA device in page-locked memory, as a copy from pageable memory may make the host
    wait for the stream (the forward still running) before the loss is even queued.
    """
    host, dtype = targets.device, targets.dtype
    n = targets.shape[0]
    image = targets[:, 0].long()
    counts = torch.zeros(batch_size, dtype=torch.long, device=host).scatter_add_(0, image, torch.ones_like(image))
    m = max(int(counts.max()) if n else 0, slots)  # free on the host; a device sync if the caller passed device targets
    pinned = host.type == "cpu" and torch.device(device).type == "cuda"
    packed = torch.zeros(batch_size, m, 6, dtype=dtype, device=host, pin_memory=pinned)
    if n:
        image_sorted, order = torch.sort(image, stable=True)
        slot = torch.arange(n, device=host) - (counts.cumsum(0) - counts)[image_sorted]
        packed[image_sorted, slot, :5] = targets[order, 1:6]
        packed[image_sorted, slot, 5] = 1
    return packed.to(device, non_blocking=True)


def unpack_targets(packed: torch.Tensor, image_hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_targets``' (B, M, 6) -> classes (B, M) long, boxes (B, M, 4) xyxy in pixels of the input
    ``image_hw`` (2,), and the mask (B, M) of real rows; device work only, no host sync."""
    boxes = xywh2xyxy(packed[..., 1:5] * image_hw.to(packed.dtype).flip(0).repeat(2))
    return packed[..., 0].long(), boxes, packed[..., 5] > 0


# ------------------------------------------------------------------------------------ assigner


class Assignment(NamedTuple):
    """What each anchor (B, A) is trained towards; off the foreground, labels/boxes/gt_index are
    those of the image's first GT slot and scores are 0 (they must be masked or weighted by scores)."""

    labels: torch.Tensor  # (B, A) long: class of the assigned GT
    boxes: torch.Tensor  # (B, A, 4): assigned GT box, xyxy in input pixels
    scores: torch.Tensor  # (B, A, nc): normalised alignment at the GT's class, 0 elsewhere
    fg: torch.Tensor  # (B, A) bool: the anchor is some GT's positive
    gt_index: torch.Tensor  # (B, A) long: slot of the assigned GT in the padded GT tensors


class TaskAlignedAssigner:
    """Batched task-aligned assignment: see the module docstring for the rule.

    Against Ultralytics 8.4.190's TaskAlignedAssigner: (1) a candidate whose metric is exactly 0
    never becomes a positive (Ultralytics may take one when a GT has fewer than k non-zero
    candidates; its class target and box weight are 0 there, so the loss is the same). (2) An
    anchor claimed by several GTs keeps the best overlap among those GTs; Ultralytics' argmax also
    sees GTs for which the anchor is merely a candidate, and may hand it to one of them (crowded
    images only). (3) Ultralytics 8.4 floors GT sides to the
    second stride when choosing candidates, so a tiny box between anchor centres still gets
    positives; here that is ``min_side``, off by default (the rule of TOOD and Ultralytics 8.0).
    Ties in the top-k ranking fall to torch.topk; ties in the overlap go to the lower GT slot.

    ``topk2`` (YOLO26's one-to-one branch: topk 7, topk2 1): after the conflicts are settled, each GT
    keeps only the ``topk2`` of its remaining positives with the highest metric, so the ranking runs
    over the same, wider candidate pool as a top-``topk`` assignment and the narrowing never takes an
    anchor that another GT kept. None (or >= topk) leaves the assignment as it was without it.
    """

    def __init__(self, topk: int = TAL_TOPK, alpha: float = TAL_ALPHA, beta: float = TAL_BETA,
                 eps: float = 1e-9, min_side: float = 0.0, chunk: int = CIOU_CHUNK, topk2: int | None = None) -> None:
        self.topk, self.alpha, self.beta, self.eps, self.min_side = topk, alpha, beta, eps, min_side
        self.chunk = chunk
        self.topk2 = topk if topk2 is None else topk2

    @torch.no_grad()
    def __call__(
        self,
        pd_scores: torch.Tensor,
        pd_boxes: torch.Tensor,
        anchor_points: torch.Tensor,
        gt_labels: torch.Tensor,
        gt_boxes: torch.Tensor,
        gt_mask: torch.Tensor,
    ) -> Assignment:
        """Assign anchors to GTs.

        pd_scores (B, A, nc) class probabilities; pd_boxes (B, A, 4) xyxy and anchor_points (A, 2),
        both in input pixels; gt_labels (B, M), gt_boxes (B, M, 4) xyxy pixels and gt_mask (B, M)
        as ``pad_targets`` makes them. No host sync; memory is a few (B, M, A) tensors.
        """
        bs, na, _ = pd_scores.shape
        m = gt_boxes.shape[1]
        device = pd_scores.device
        if m == 0:
            zeros = torch.zeros(bs, na, dtype=torch.long, device=device)
            return Assignment(zeros, torch.zeros_like(pd_boxes), torch.zeros_like(pd_scores),
                              torch.zeros(bs, na, dtype=torch.bool, device=device), zeros.clone())
        candidate = self.candidates(anchor_points, gt_boxes) & gt_mask[..., None]  # (B, M, A)
        overlap = self.overlaps(gt_boxes, pd_boxes, candidate)
        label = gt_labels[..., None].expand(bs, m, na)
        score = pd_scores.transpose(1, 2).gather(1, label)  # (B, M, A): each anchor's score for the GT's class
        metric = torch.where(candidate, score.pow(self.alpha) * overlap.pow(self.beta), 0)

        top = metric.topk(min(self.topk, na), dim=-1).indices
        pos = torch.zeros_like(candidate).scatter_(-1, top, True) & candidate & (metric > 0)

        fg = pos.any(1)  # (B, A)
        gt_index = torch.where(pos, overlap, -1).argmax(1)  # the best-overlapping GT among those claiming it
        pos = (torch.arange(m, device=device)[:, None] == gt_index[:, None]) & fg[:, None]
        if self.topk2 < self.topk:
            pos = self.narrow(pos, metric)
            fg = pos.any(1)
            gt_index = torch.where(fg, gt_index, 0)  # a dropped anchor is background: first slot, as documented
        metric = metric * pos
        overlap = overlap * pos
        norm = metric * overlap.amax(-1, keepdim=True) / (metric.amax(-1, keepdim=True) + self.eps)
        norm = norm.amax(1)  # (B, A): one GT per anchor is left, so this picks its value

        labels = gt_labels.gather(1, gt_index)
        boxes = gt_boxes.gather(1, gt_index[..., None].expand(bs, na, 4))
        scores = torch.zeros_like(pd_scores).scatter_(-1, labels[..., None], norm[..., None])
        return Assignment(labels, boxes, scores, fg, gt_index)

    def narrow(self, pos: torch.Tensor, metric: torch.Tensor) -> torch.Tensor:
        """(B, M, A) positives -> those among each GT's own that rank in its top ``topk2`` by metric.

        Every positive's metric is above 0, so a GT with fewer positives than topk2 keeps them all (the
        extra top-k picks land on zeros, off its positives, and the mask drops them).
        """
        top = (metric * pos).topk(min(self.topk2, pos.shape[-1]), dim=-1).indices
        return torch.zeros_like(pos).scatter_(-1, top, True) & pos

    def overlaps(self, gt_boxes: torch.Tensor, pd_boxes: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """(B, M, A) CIoU of each GT with each predicted box, clamped at 0, and 0 off the candidates.

        CIoU makes a dozen (B, M, A) temporaries, so it runs over slices of about ``chunk`` / (B * A) GTs:
        a dense scene does not run out of memory, and the values are those of one pass (elementwise
        work, with the aspect angles computed once on the unsliced boxes).
        """
        bs, m, na = candidate.shape
        gt, pd = gt_boxes[:, :, None], pd_boxes[:, None]
        gt_angle, pd_angle = aspect_angle(gt), aspect_angle(pd)

        def part(s: slice) -> torch.Tensor:
            ciou = bbox_ciou(gt[:, s], pd, angles=(gt_angle[:, s], pd_angle)).clamp(min=0)
            return torch.where(candidate[:, s], ciou, 0)

        return cat_in_chunks(part, m, self.chunk // max(bs * na, 1))

    def candidates(self, anchor_points: torch.Tensor, gt_boxes: torch.Tensor) -> torch.Tensor:
        """(B, M, A) bool: anchor centre strictly inside the GT (by eps), sides floored to min_side."""
        if self.min_side > 0:
            centre = (gt_boxes[..., :2] + gt_boxes[..., 2:]) / 2
            half = (gt_boxes[..., 2:] - gt_boxes[..., :2]).clamp(min=self.min_side) / 2
            gt_boxes = torch.cat((centre - half, centre + half), -1)
        lt, rb = gt_boxes[:, :, None, :2], gt_boxes[:, :, None, 2:]
        return torch.cat((anchor_points - lt, rb - anchor_points), -1).amin(-1) > INSIDE_EPS
