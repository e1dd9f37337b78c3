"""AutoAnchor: check the model's anchors against the dataset's boxes and re-fit them if poor.

The algorithm follows YOLOv5's ``utils/engine/autoanchor.py``: a target can only be learned by an anchor
whose width and height are both within a factor ``thr`` (``hyp.anchor_t``) of the target's, which
is exactly the rule ``ComputeLoss.build_targets`` applies. The share of labels that at least one
anchor covers is the best possible recall (BPR). If it is below 0.98, k-means on the label sizes
gives starting anchors, a mutation-only genetic search improves them, and the model's anchors
are replaced only if the new set covers more labels. A hyp file's ``anchors`` count (YOLOv5's
hyp.VOC/Objects365) builds the model with that many placeholder anchors per level, which are
fitted whatever their BPR (``force``).

Every random draw comes from ``np.random.default_rng(seed)``, so the result is a pure function of
the labels, the model's anchors and the seed. Training still computes it on rank 0 only and
broadcasts ``AnchorResult.anchors_px`` (floating-point results of a long search could differ in
the last bit across heterogeneous hosts); other ranks apply it with ``set_anchors``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from yolotrain.models.heads.anchor import check_anchor_order
from yolotrain.models.yolo import de_parallel
from yolotrain.utils.core import dist
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER, colorstr
from yolotrain.utils.data.labels import LabelTable

PREFIX = "AutoAnchor: "
BPR_GOOD = 0.98  # below this share of coverable labels, anchors are re-fitted (YOLOv5's threshold)
MIN_WH = 2.0  # k-means ignores boxes with both sides under this many pixels (YOLOv5)
SMALL_WH = 3.0  # boxes with a side under this are reported as "extremely small" (YOLOv5)
SCALE_AUG = (0.9, 1.1)  # per-image scale jitter applied to label sizes when measuring BPR
MUTATION_PROB, MUTATION_SIGMA = 0.9, 0.1  # YOLOv5's genetic search settings
KMEANS_RESTARTS, KMEANS_ITERS = 3, 30
YAML_DECIMALS = 2  # anchors are rounded to this many pixel decimals before being applied


@dataclass(frozen=True)
class AnchorFit:
    """How well a set of anchors covers a set of label sizes.

    bpr: fraction of labels with at least one anchor within ``thr`` on both sides.
    aat: mean number of anchors per label within ``thr`` (how many anchors can learn each label).
    """

    bpr: float
    aat: float


@dataclass
class AnchorResult:
    """Outcome of ``check_anchors``; ``anchors_px`` is what rank 0 should broadcast.

    anchors_px: per-level flat pixel pairs ``[[w0, h0, w1, h1, ...], ...]`` (model.yaml format),
    i.e. the anchors the model holds after the check, replaced or not. BPRs are NaN when the
    dataset has no labels.
    """

    bpr_before: float
    bpr_after: float
    replaced: bool
    anchors_px: list[list[float]] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# label sizes and metrics


def _image_wh(dataset: Any, img_size: int, scale: np.ndarray | None = None) -> np.ndarray:
    """All labels' (w, h) in pixels of the training image (long side img_size), unfiltered.

    ``scale`` (N, 1) optionally multiplies each image's size, YOLOv5's scale augmentation.
    """
    wh = np.asarray(dataset.image_hw, dtype=np.float64).reshape(-1, 2)[:, ::-1]  # (w, h), as the label columns
    labels = LabelTable.of(dataset.labels)
    if len(labels) != len(wh):
        raise ValueError(f"dataset has {len(labels)} label arrays but {len(wh)} image sizes")
    if not labels:
        return np.zeros((0, 2))
    sizes = img_size * wh / wh.max(1, keepdims=True).clip(min=1)
    if scale is not None:
        sizes = sizes * scale
    return labels.stacked()[:, 3:5] * np.repeat(sizes, labels.counts(), axis=0)


def label_wh(dataset: Any, img_size: int) -> np.ndarray:
    """(M, 2) label widths/heights in pixels at the training size, as k-means should see them.

    Boxes with both sides under 2 px are dropped (YOLOv5): they carry no shape information and
    would drag clusters towards zero. Boxes with a side under 3 px are only counted in a warning.
    """
    wh = _image_wh(dataset, img_size)
    n_small = int((wh < SMALL_WH).any(1).sum())
    if n_small:
        LOGGER.warning(f"{PREFIX}WARNING: extremely small objects found: {n_small} of {len(wh)} labels "
                       f"are under {SMALL_WH:g} pixels in size")
    return wh[(wh >= MIN_WH).any(1)]


def _ratio_metric(k: np.ndarray, wh: np.ndarray) -> np.ndarray:
    """(M, k) worst-side size ratio in (0, 1] of every label to every anchor; 1 is a perfect fit.

    min(r, 1/r) over both sides > 1/thr is the same test as the loss's max(r, 1/r) < thr.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        r = wh[:, None, :] / k[None, :, :]
        x = np.minimum(r, 1 / r).min(2)
    return np.nan_to_num(x, nan=0.0)


def anchor_metrics(anchors_px: np.ndarray, wh: np.ndarray, thr: float = 4.0) -> AnchorFit:
    """BPR and anchors-above-threshold of anchors (k, 2) on label sizes (M, 2), both in pixels."""
    k = np.asarray(anchors_px, dtype=np.float64).reshape(-1, 2)
    wh = np.asarray(wh, dtype=np.float64).reshape(-1, 2)
    if not len(wh):
        return AnchorFit(bpr=float("nan"), aat=float("nan"))
    x = _ratio_metric(k, wh)
    above = x > 1 / thr
    return AnchorFit(bpr=float(above.any(1).mean()), aat=float(above.sum(1).mean()))


class _Fitness:
    """YOLOv5's anchor fitness: mean best ratio, counting only labels some anchor can learn.

    Called once per generation on every label, so it works in log space on per-anchor (M,)
    vectors with reused buffers: log-ratio distance max(|dlog w|, |dlog h|) is -log of the ratio
    metric, and avoids broadcasting (M, k, 2) ratio arrays, which dominated the search on
    COCO-sized label sets.
    """

    def __init__(self, wh: np.ndarray, thr: float) -> None:
        with np.errstate(divide="ignore"):  # a zero side gives -inf: matched by no anchor, as it should
            self.lw, self.lh = np.log(wh[:, 0]), np.log(wh[:, 1])
        self.log_thr = math.log(thr)
        self._a, self._b, self._best = (np.empty(len(wh)) for _ in range(3))

    def __call__(self, k: np.ndarray) -> float:
        a, b, best = self._a, self._b, self._best
        best.fill(np.inf)
        for kw, kh in np.log(k):
            np.abs(np.subtract(self.lw, kw, out=a), out=a)
            np.abs(np.subtract(self.lh, kh, out=b), out=b)
            np.minimum(best, np.maximum(a, b, out=a), out=best)
        return float((np.exp(-best) * (best < self.log_thr)).mean())


# ----------------------------------------------------------------------------------------------
# k-means + genetic evolution


def _kmeans_pp_init(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """k-means++ seeding; None when x has fewer than n distinct points."""
    centers = [x[rng.integers(len(x))]]
    d2 = ((x - centers[0]) ** 2).sum(1)
    for _ in range(n - 1):
        total = d2.sum()
        if total <= 0:
            return None
        centers.append(x[rng.choice(len(x), p=d2 / total)])
        d2 = np.minimum(d2, ((x - centers[-1]) ** 2).sum(1))
    return np.stack(centers)


def _sq_dist(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """(k, M) squared distances of every point to every centre.

    Built column by column: reducing numpy's tiny trailing axis of size 2 is several times slower.
    """
    cols = [np.ascontiguousarray(x[:, j]) for j in range(x.shape[1])]
    return np.stack([sum((col - cj[j]) ** 2 for j, col in enumerate(cols)) for cj in c])


def _lloyd(x: np.ndarray, c: np.ndarray, iters: int) -> tuple[np.ndarray, float]:
    """Lloyd iterations from centres c; returns (centres, mean distance), like scipy's kmeans.

    An empty cluster is moved to the point farthest from its centre so n centres survive.
    """
    n, dist = len(c), np.zeros(len(x))
    for _ in range(iters):
        d = _sq_dist(x, c)
        assign = d.argmin(0)
        dist = np.sqrt(d.min(0))
        counts = np.bincount(assign, minlength=n)
        sums = np.stack([np.bincount(assign, weights=x[:, j], minlength=n) for j in range(x.shape[1])], 1)
        new = sums / np.maximum(counts, 1)[:, None]
        for j in np.flatnonzero(counts == 0):
            far = int(dist.argmax())
            new[j], dist[far] = x[far], 0.0
        if np.allclose(new, c, rtol=0, atol=1e-9):
            break
        c = new
    return c, float(dist.mean())


def _kmeans(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """Best of a few k-means++/Lloyd runs by mean distance; None if x cannot give n clusters."""
    best, best_d = None, math.inf
    for _ in range(KMEANS_RESTARTS):
        c0 = _kmeans_pp_init(x, n, rng)
        if c0 is None:
            return None
        c, d = _lloyd(x, c0, KMEANS_ITERS)
        if d < best_d:
            best, best_d = c, d
    return best


def _initial_anchors(wh: np.ndarray, n: int, img_size: int, rng: np.random.Generator) -> np.ndarray:
    """k-means on sizes whitened by their std (so w and h weigh alike); random if that fails."""
    if n <= len(wh):
        s = wh.std(0)
        s = np.where(s > 0, s, 1.0)
        c = _kmeans(wh / s, n, rng)
        if c is not None:
            return c * s
    LOGGER.warning(f"{PREFIX}WARNING: switching strategies from k-means to random init "
                   f"({len(wh)} label sizes for {n} anchors)")
    return np.sort(rng.random(n * 2)).reshape(n, 2) * img_size


def _evolve(k: np.ndarray, wh: np.ndarray, thr: float, gen: int, rng: np.random.Generator) -> np.ndarray:
    """YOLOv5's genetic search: multiplicative mutations, keep a child only if it is fitter."""
    fitness = _Fitness(wh, thr)
    f = fitness(k)
    for _ in range(gen):
        v = np.ones(k.shape)
        while (v == 1).all():  # mutate until something changes
            v = ((rng.random(k.shape) < MUTATION_PROB) * rng.random() * rng.standard_normal(k.shape)
                 * MUTATION_SIGMA + 1).clip(0.3, 3.0)
        kg = (k * v).clip(min=MIN_WH)
        fg = fitness(kg)
        if fg > f:
            f, k = fg, kg
    return k


def kmean_anchors(wh: np.ndarray, n: int = 9, img_size: int = 640, thr: float = 4.0, gen: int = 1000,
                  seed: int = 0) -> np.ndarray:
    """n anchors (n, 2) in pixels fitted to label sizes wh (M, 2), sorted by area ascending.

    k-means gives a start that is good on average; the genetic search then optimises the metric
    that matters for training (how many labels some anchor covers, and how closely).
    """
    wh = np.asarray(wh, dtype=np.float64).reshape(-1, 2)
    if not len(wh):
        raise ValueError("kmean_anchors: no label sizes to fit anchors to")
    rng = np.random.default_rng(seed)
    LOGGER.info(f"{PREFIX}Running k-means for {n} anchors on {len(wh)} points...")
    k = _initial_anchors(wh, n, img_size, rng)
    k = _evolve(k, wh, thr, gen, rng)
    k = k[np.argsort(k.prod(1), kind="stable")]
    fit = anchor_metrics(k, wh, thr)
    LOGGER.info(f"{PREFIX}thr={1 / thr:.2f}: {fit.bpr:.4f} best possible recall, {fit.aat:.2f} anchors past thr; "
                f"n={n}, img_size={img_size}, fitness={_Fitness(wh, thr)(k):.4f}")
    LOGGER.info(PREFIX + "anchors: " + ", ".join(f"{w:.0f},{h:.0f}" for w, h in k))
    return k


# ----------------------------------------------------------------------------------------------
# the model side


def model_anchors_px(model: nn.Module) -> np.ndarray:
    """The model's anchors (nl, na, 2) in pixels: the grid-unit buffer times each level's stride."""
    det = de_parallel(model).detect
    return (det.anchors.detach().cpu().double() * det.stride.detach().cpu().double().view(-1, 1, 1)).numpy()


def _yaml_anchors(anchors_px: np.ndarray) -> list[list[float]]:
    """(nl, na, 2) pixels -> [[w0, h0, w1, h1, ...], ...] plain floats, the model yaml format."""
    return [[round(float(v), YAML_DECIMALS) for v in level.reshape(-1)] for level in anchors_px]


def set_anchors(model: nn.Module, anchors_px: Any) -> None:
    """Make the model use these pixel anchors: Detect buffer (grid units) and ``model.yaml``.

    ``anchors_px`` is anything with nl*na pixel (w, h) pairs (flat per level as in the yaml,
    (k, 2) or (nl, na, 2)), small to large. Values are rounded to 2 decimals first and the buffer
    is computed the way ``Model.__init__`` computes it, so ``Model(model.yaml)`` rebuilds
    bit-identical anchors even without the state_dict. Used by ``check_anchors`` and by the other
    ranks to apply rank 0's broadcast result.
    """
    m = de_parallel(model)
    det = m.detect
    px = np.round(np.asarray(anchors_px, dtype=np.float64), YAML_DECIMALS)
    if px.size != det.anchors.numel():
        raise ValueError(f"set_anchors: got {px.size // 2} anchor pairs, the model has {det.nl}x{det.na}")
    px_list = _yaml_anchors(px.reshape(det.nl, det.na, 2))
    with torch.no_grad():
        new = torch.tensor(px_list, dtype=torch.float32).view(det.nl, det.na, 2)
        det.anchors[:] = new.to(det.anchors)
        check_anchor_order(det)  # in pixel space, as in Model.__init__
        det.anchors /= det.stride.view(-1, 1, 1)
    final = _yaml_anchors(model_anchors_px(m).round(YAML_DECIMALS))
    _update_yaml(m, final)


def _update_yaml(m: nn.Module, anchors: list[list[float]]) -> None:
    """Write anchors into the model yaml dict (and into an explicit list on the Detect row)."""
    d = getattr(m, "yaml", None)
    if not isinstance(d, dict):
        return
    d["anchors"] = [list(level) for level in anchors]
    for row in d.get("head") or []:
        if isinstance(row, list) and len(row) == 4 and row[2] == "Detect":
            args = row[3]
            if isinstance(args, list) and len(args) >= 2 and isinstance(args[1], list):
                args[1] = [list(level) for level in anchors]


def check_anchors(dataset: Any, model: nn.Module, thr: float = 4.0, imgsz: int = 640,
                  seed: int = 0, force: bool = False) -> AnchorResult:
    """Measure the model's anchors on the dataset's labels; re-fit and replace them if poor.

    BPR is measured on all labels with a seeded 0.9-1.1 per-image scale jitter (YOLOv5), so a
    borderline fit is judged under the size variation training will see. New anchors replace
    the old ones only if they cover more labels. ``force`` (the hyp file's ``anchors`` count,
    whose anchors are placeholders) fits whatever the BPR and keeps the fit unless it covers fewer.
    """
    current = model_anchors_px(model)
    current_yaml = _yaml_anchors(current)
    if not any(len(lb) for lb in dataset.labels):
        kept = "the placeholder anchors resampled from the model yaml's" if force else "the model's anchors"
        LOGGER.warning(f"{PREFIX}WARNING: the dataset has no labels; keeping {kept}")
        return AnchorResult(math.nan, math.nan, False, current_yaml)
    rng = np.random.default_rng(seed)
    scale = rng.uniform(*SCALE_AUG, size=(len(dataset.image_hw), 1))
    wh = _image_wh(dataset, imgsz, scale)
    before = anchor_metrics(current, wh, thr)
    msg = f"{colorstr(PREFIX)}{before.aat:.2f} anchors/target, {before.bpr:.3f} Best Possible Recall (BPR). "
    det = de_parallel(model).detect
    if force:
        LOGGER.info(msg + f"The hyp file asks for {det.na} anchors per level: fitting them to the dataset...")
    elif before.bpr >= BPR_GOOD:
        LOGGER.info(msg + "Current anchors are a good fit to dataset")
        return AnchorResult(before.bpr, before.bpr, False, current_yaml)
    else:
        LOGGER.info(msg + "Anchors are a poor fit to dataset, computing new anchors...")
    new = kmean_anchors(label_wh(dataset, imgsz), n=det.nl * det.na, img_size=imgsz, thr=thr, seed=seed)
    new = np.round(new, YAML_DECIMALS)  # score exactly what would be applied
    after = anchor_metrics(new, wh, thr)
    if after.bpr > before.bpr or (force and after.bpr >= before.bpr):
        set_anchors(model, new)
        applied = _yaml_anchors(model_anchors_px(model))
        LOGGER.info(f"{PREFIX}Done: new anchors (BPR {before.bpr:.3f} -> {after.bpr:.3f}) are in the "
                    f"checkpoint's model yaml; optionally put them in your model *.yaml:\n"
                    f"anchors:\n{format_anchors(applied)}")
        return AnchorResult(before.bpr, after.bpr, True, applied)
    LOGGER.info(f"{PREFIX}Done: original anchors are better than new anchors (BPR {after.bpr:.3f}), "
                "proceeding with original anchors")
    return AnchorResult(before.bpr, before.bpr, False, current_yaml)


def anchors_per_level(hyp_anchors: float, hyp_file: str | Path, noautoanchor: bool) -> int | None:
    """YOLOv5's hyp ``anchors``: the anchor count per level a fresh model is built with (None keeps
    the model yaml's). Those anchors only mean something once autoanchor has fitted them, so
    ``--noautoanchor`` together with the key is refused rather than training on placeholders."""
    if hyp_anchors <= 0:
        return None
    n = round(hyp_anchors)
    if noautoanchor:
        raise UserError(f"{hyp_file}: 'anchors: {hyp_anchors:g}' asks for {n} anchors per level fitted by "
                        "autoanchor, but --noautoanchor turns autoanchor off; drop --noautoanchor, or remove "
                        "'anchors' from the hyp file (or set it to 0) to keep the model yaml's anchors")
    return n


def format_anchors(anchors_px: Sequence[Sequence[float]]) -> str:
    """Anchors as a model-yaml snippet, for users who want to keep them."""
    return "\n".join(f"  - [{', '.join(f'{v:g}' for v in level)}]" for level in anchors_px)


def fit_anchors(model: nn.Module, dataset: Any, hyp: Any, imgsz: int, seed: int, info: DistInfo,
                force: bool = False) -> None:
    """check_anchors on rank 0 only; its result is broadcast and applied on the other ranks.

    Call before the EMA copy and the DDP wrap, so every copy of the model holds the anchors.
    """
    new_anchors = None
    if info.is_main:
        fit = check_anchors(dataset, model, thr=hyp.anchor_t, imgsz=imgsz, seed=seed, force=force)
        new_anchors = fit.anchors_px if fit.replaced else None
    new_anchors = dist.broadcast_object(new_anchors)  # computed once, the same on every rank
    if new_anchors is not None and not info.is_main:
        set_anchors(model, new_anchors)
