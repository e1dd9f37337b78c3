"""Does an exported file detect what its checkpoint detects? Both run on the same real images.

Two measures: the largest absolute difference of the decoded outputs (box centre/size in input
pixels, and class scores) over every candidate row, and whether the detections after NMS (at
detect.py's thresholds) pair up one to one with the same class, box and score within tolerance.

Tolerances. Two float32 runtimes of one graph differ only in the order they add products. Float32
keeps 24 significant bits: a coordinate near 640 pixels is stored to 6e-5 pixel, a score near 1
to 6e-8, and reordered sums through a network of about a hundred layers grow that by at most a
couple of orders of magnitude. A wrong export (a missing sigmoid, a stride, grid or anchor off, a
dropped layer, swapped channels, wrong input scaling) moves boxes by pixels and scores by tenths.
``FP32`` allows 0.01 pixel and 1e-4 of score: clear of rounding, a hundred times below the
smallest real error, and invisible in a drawn box or an mAP50-95 to three decimals. FP16 keeps 11
bits (3 decimal digits): a 600-pixel coordinate is known to 0.3 pixel and a score to 5e-4 before
any layer adds its own rounding, so ``FP16`` allows 2 pixels and 0.01 of score.

NMS turns near-ties into either-or choices: a box scoring within rounding of the confidence
threshold or of the max_det cut, two overlapping boxes of one class scoring the same within
rounding, or an overlap within rounding of the IoU threshold. Such a box kept by one runtime only
is counted as a near-tie, not as a difference; any other unpaired box is a difference.

An end-to-end model (no NMS) outputs its top ``max_det`` detections (B, K, 6), sorted by score.
Rows are paired, not compared by position: two rows scoring the same within rounding may swap
places. Each row scoring clearly above the K-th score (by more than twice the score tolerance:
it is in both runtimes' top K whatever the rounding) must have a twin in the other output, of
the same class, and the largest box and score differences are taken over these pairs. Rows near
the cut may be replaced by a near-tied rival, as NMS's near-ties. The detections above
detect.py's confidence threshold are counted as the report's detections.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from torchvision.ops import box_iou

from yolotrain.utils.core.boxes import non_max_suppression, postprocess, xywh2xyxy
from yolotrain.utils.infer.backends import Backend

PARITY_CONF, PARITY_IOU, PARITY_MAX_DET = 0.25, 0.45, 300  # detect.py's thresholds: the detections users see
IOU_ROUNDING = 0.01  # how far box differences within tolerance can move an IoU (boxes of a few pixels and up)


@dataclass(frozen=True)
class Tolerance:
    box_px: float  # largest allowed box coordinate difference, in input pixels
    score: float  # largest allowed class score difference

    def __str__(self) -> str:
        return f"{self.box_px:g} px, score {self.score:g}"


FP32 = Tolerance(box_px=0.01, score=1e-4)
FP16 = Tolerance(box_px=2.0, score=1e-2)


@dataclass(frozen=True)
class ParityReport:
    """One comparison on one input shape."""

    shape: tuple[int, ...]
    box_diff: float
    score_diff: float
    detections: int  # the reference's detections after NMS
    mismatch: str  # '' when the detections pair up; else the first difference, in words
    tolerance: Tolerance
    ties: int = 0  # boxes kept by one runtime only as near-ties (see the module docstring)

    @property
    def passed(self) -> bool:
        t = self.tolerance
        return self.box_diff <= t.box_px and self.score_diff <= t.score and not self.mismatch

    def __str__(self) -> str:
        ties = f" except {self.ties} near-tied boxes" if self.ties else ""
        verdict = f"same{ties}" if not self.mismatch else f"DIFFERENT ({self.mismatch})"
        return (f"input {tuple(self.shape)}: max |box diff| {self.box_diff:.3g} px, max |score diff| "
                f"{self.score_diff:.3g} (tolerance {self.tolerance}); detections after NMS {verdict}, "
                f"{self.detections} boxes")


@torch.no_grad()
def compare(exported: Backend, reference: Backend, images: torch.Tensor, tol: Tolerance) -> ParityReport:
    """Run both on ``images`` (uint8, B x 3 x H x W, on the reference's device) and compare."""
    a = exported(images)[0].float()
    b = reference(images)[0].float()
    if exported.end2end != reference.end2end:
        return ParityReport(tuple(images.shape), float("inf"), float("inf"), 0,
                            f"end2end {exported.end2end} instead of {reference.end2end}", tol)
    if a.shape != b.shape:
        return ParityReport(tuple(images.shape), float("inf"), float("inf"), 0,
                            f"output shape {tuple(a.shape)} instead of {tuple(b.shape)}", tol)
    if reference.end2end:
        return compare_end2end(a, b, tuple(images.shape), tol)
    box = float((a[..., :4] - b[..., :4]).abs().max()) if a.numel() else 0.0
    score = float((a[..., 4:] - b[..., 4:]).abs().max()) if a.numel() else 0.0
    da = non_max_suppression(a, PARITY_CONF, PARITY_IOU, max_det=PARITY_MAX_DET)
    db = non_max_suppression(b, PARITY_CONF, PARITY_IOU, max_det=PARITY_MAX_DET)
    mismatch, ties = "", 0
    for i in range(len(images)):
        mismatch, n = compare_detections(da[i], db[i], a[i], b[i], tol)
        ties += n
        if mismatch:
            mismatch = f"image {i}: {mismatch}"
            break
    return ParityReport(tuple(images.shape), box, score, sum(len(d) for d in db), mismatch, tol, ties)


def unmatched(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of (n, 6) detections ``a`` and ``b`` that do not pair up one to one (same class, box and
    score within ``tol``), greedily in ``a``'s order (highest score first)."""
    free = torch.ones(len(b), dtype=torch.bool, device=b.device)
    lone = []
    for row in a:
        fits = (free & (b[:, 5] == row[5]) & ((b[:, :4] - row[:4]).abs().amax(1) <= tol.box_px)
                & ((b[:, 4] - row[4]).abs() <= tol.score))
        if fits.any():
            free[int(fits.nonzero()[0])] = False
        else:
            lone.append(row)
    return (torch.stack(lone) if lone else a[:0]), b[free]


def near_tie(det: torch.Tensor, kept: torch.Tensor, other: torch.Tensor, decoded: torch.Tensor,
             tol: Tolerance) -> bool:
    """Whether runtime X keeping ``det`` (one of its ``kept`` detections, from its ``decoded`` output) while
    runtime Y (kept ``other``) did not is a tie that rounding may break either way: ``det`` scores within
    rounding of the confidence threshold or of the last detection under the max_det cut, overlaps a
    candidate of its class that scores the same within rounding, or overlaps one of Y's detections of
    its class with an IoU within rounding of the NMS threshold."""
    score, cls = float(det[4]), int(det[5])
    if abs(score - PARITY_CONF) <= 2 * tol.score:
        return True
    if len(kept) >= PARITY_MAX_DET and abs(score - float(kept[-1, 4])) <= 2 * tol.score:
        return True
    boxes = xywh2xyxy(decoded[:, :4])
    same_score = (decoded[:, 4 + cls] - score).abs() <= 2 * tol.score
    if int(((box_iou(det[None, :4], boxes[same_score])[0]) > PARITY_IOU).sum()) >= 2:  # itself and a rival
        return True
    rivals = other[other[:, 5] == cls]
    return bool(len(rivals) and ((box_iou(det[None, :4], rivals[:, :4])[0] - PARITY_IOU).abs() <= IOU_ROUNDING).any())


def compare_detections(da: torch.Tensor, db: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       tol: Tolerance) -> tuple[str, int]:
    """Whether one image's detections ``da`` (exported) and ``db`` (reference) agree: ('', near-ties) when
    they pair up within ``tol`` except for near-ties (``near_tie``), else (the first difference, 0)."""
    lone_a, lone_b = unmatched(da, db, tol)
    for rows, kept, other, decoded, where in ((lone_a, da, db, a, "only in the export"),
                                              (lone_b, db, da, b, "only in the checkpoint")):
        for row in rows:
            if not near_tie(row, kept, other, decoded, tol):
                return (f"class {int(row[5])} at {[round(v, 1) for v in row[:4].tolist()]} score "
                        f"{float(row[4]):.3f} {where}"), 0
    return "", len(lone_a) + len(lone_b)


def compare_end2end(a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...], tol: Tolerance) -> ParityReport:
    """End-to-end detections (B, K, 6) of the export ``a`` and the checkpoint ``b``: every row clear of the
    top-K cut pairs with a twin in the other (see the module docstring); the differences are the pairs'."""
    box = score = 0.0
    mismatch = ""
    for i in range(len(a)):
        for rows, other, where in ((a[i], b[i], "only in the export"), (b[i], a[i], "only in the checkpoint")):
            d_box, d_score, lone = twin_differences(rows, other, tol)
            box, score = max(box, d_box), max(score, d_score)
            if lone is not None and not mismatch:
                mismatch = (f"image {i}: class {int(lone[5])} at {[round(v, 1) for v in lone[:4].tolist()]} score "
                            f"{float(lone[4]):.3f} {where}")
    shown = postprocess(b, True, PARITY_CONF, max_det=b.shape[1])
    return ParityReport(shape, box, score, sum(len(d) for d in shown), mismatch, tol)


def twin_differences(rows: torch.Tensor, other: torch.Tensor,
                     tol: Tolerance) -> tuple[float, float, torch.Tensor | None]:
    """For each of ``rows`` (K, 6) scoring clearly above ``other``'s lowest score, its nearest row of the same
    class in ``other`` (distance in tolerances, box and score): the largest box and score differences of these
    pairs, and the first row with no twin within tolerance (None when all have one)."""
    settled = rows[rows[:, 4] > other[:, 4].min() + 2 * tol.score] if len(other) else rows
    if not len(settled):
        return 0.0, 0.0, None
    if not len(other):
        return float("inf"), float("inf"), settled[0]
    d_box = (settled[:, None, :4] - other[None, :, :4]).abs().amax(2)  # (n, K)
    d_score = (settled[:, None, 4] - other[None, :, 4]).abs()
    far = (d_box / tol.box_px).maximum(d_score / tol.score)
    far[settled[:, None, 5] != other[None, :, 5]] = float("inf")  # a twin has the same class
    j = far.argmin(1)
    n = torch.arange(len(settled), device=rows.device)
    paired = far[n, j].isfinite()
    lone = (~paired) | (far[n, j] > 1)
    box = float(d_box[n, j][paired].max()) if paired.any() else 0.0
    score = float(d_score[n, j][paired].max()) if paired.any() else 0.0
    if (~paired).any():
        box = score = float("inf")
    return box, score, settled[int(lone.nonzero()[0])] if lone.any() else None
