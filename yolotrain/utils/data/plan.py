"""What one training sample will be, decided before any pixel is touched: its random draws, the tiles on
its canvas, the warp, the colour gains and flips, and its final labels.

A plan reads only the scan's image sizes and labels, so it is cheap, and every renderer follows the same
one: the loader workers with OpenCV (utils/data/render.py), or the training device with torch for a
whole batch (utils/data/device_augment.py). The labels are therefore identical on both paths, and the
images agree to within interpolation rounding.

Draws come from ``np.random.default_rng([seed, epoch, index])`` in a fixed order: two decisions (mosaic,
mixup), then one child stream per stage (geometry, mixup, colour), each drawing a fixed number of values
whether or not its stage fires. So a sample is the same whatever the worker, rank or resume point, and
changing one gain does not reshuffle the others' draws. Sizes are (h, w) (utils/data/geometry.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from yolotrain.utils.core.boxes import xywhn2xyxy, xyxy2xywhn
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.data.augment import flip_draws, flip_labels, hsv_gains, letterbox_fit, mixup_ratio, needs_warp, \
    perspective_matrix, warp_boxes
from yolotrain.utils.data.geometry import Placement

GEOMETRY_KEYS = ("degrees", "translate", "scale", "shear", "perspective")


@dataclass(frozen=True)
class Tile:
    """One image on a canvas: dataset image ``image`` at size ``hw``; the canvas block ``rect``
    (x1a, y1a, x2a, y2a) is filled from it, starting at its pixel ``origin`` (x1b, y1b)."""

    image: int
    hw: tuple[int, int]
    rect: tuple[int, int, int, int]
    origin: tuple[int, int]


@dataclass(frozen=True)
class Composite:
    """A grey (114) canvas of ``canvas_hw`` with tiles on it, warped by ``matrix`` to ``out_hw``
    (``matrix`` None: the canvas is the output)."""

    canvas_hw: tuple[int, int]
    tiles: tuple[Tile, ...]
    matrix: np.ndarray | None
    perspective: bool
    out_hw: tuple[int, int]


@dataclass(frozen=True)
class SamplePlan:
    """Everything a renderer needs for one sample, and its labels (n, 5) float32 [cls, xc, yc, w, h]
    normalised to the output. ``mix_ratio`` weighs the first composite when a second one is blended
    (mixup); ``hsv`` holds the hue, saturation and value gains (None: no colour change)."""

    index: int
    composites: tuple[Composite, ...]
    mix_ratio: float
    hsv: np.ndarray | None
    flip_lr: bool
    flip_ud: bool
    labels: np.ndarray
    placement: Placement | None

    @property
    def out_hw(self) -> tuple[int, int]:
        return self.composites[0].out_hw


@dataclass(frozen=True)
class PlanInputs:
    """What planning reads of a dataset: per image its loaded size (after ``resize_long_side``), its
    original size and labels (normalised [cls, xc, yc, w, h]); the rectangle each image is letterboxed to (its
    rect batch's shape)."""

    img_size: int
    augment: bool
    hyp: Hyp
    loaded_hw: np.ndarray  # (n, 2) int
    orig_hw: np.ndarray  # (n, 2) int
    labels: Sequence[np.ndarray]
    batch_shapes: np.ndarray | None  # (batches, 2) letterbox shape per rect batch; None: img_size square
    batch_index: np.ndarray  # (n,) each image's rect batch


def plan_sample(inputs: PlanInputs, rng: np.random.Generator, index: int, mosaic: bool,
                partners: Sequence[int] | None) -> SamplePlan:
    """The plan of sample ``index`` from its own ``rng``. ``mosaic``: mosaic is allowed for this key
    (close_mosaic, rect); ``partners``: the images a mosaic may take its other tiles from (None: any)."""
    hyp = inputs.hyp
    if not inputs.augment:
        comp, labels, placed = letterboxed(inputs, index, None)
        return _finish(inputs, index, (comp,), 1.0, [labels], placed, None, None)
    u = rng.random(2)  # mosaic, mixup
    geo_rng, mix_rng, colour_rng = rng.spawn(3)
    placed = None
    if mosaic and u[0] < hyp.mosaic:
        first, labels = _mosaic(inputs, index, geo_rng, partners)
        composites, label_sets, ratio = (first,), [labels], 1.0
        if u[1] < hyp.mixup:  # a second mosaic, blended in
            other = _pick(mix_rng, partners, len(inputs.loaded_hw))
            second, labels2 = _mosaic(inputs, other, mix_rng, _without(partners, other, index))
            composites, ratio = (first, second), mixup_ratio(mix_rng)
            label_sets.append(labels2)
    else:
        comp, labels, placed = letterboxed(inputs, index, geo_rng)
        composites, label_sets, ratio = (comp,), [labels], 1.0
    return _finish(inputs, index, composites, ratio, label_sets, placed, colour_rng, hyp)


def _finish(inputs: PlanInputs, index: int, composites: tuple[Composite, ...], ratio: float,
            label_sets: list[np.ndarray], placed: Placement | None, colour_rng: np.random.Generator | None,
            hyp: Hyp | None) -> SamplePlan:
    """Labels normalised to the output, then the colour and flip draws (in that order)."""
    labels = label_sets[0] if len(label_sets) == 1 else np.concatenate(label_sets, 0)
    h, w = composites[0].out_hw
    if len(labels):
        labels[:, 1:] = xyxy2xywhn(labels[:, 1:], w=w, h=h, clip=True)
    gains, lr, ud = None, False, False
    if colour_rng is not None:
        gains = hsv_gains(colour_rng, hyp.hsv_h, hyp.hsv_s, hyp.hsv_v)
        lr, ud = flip_draws(colour_rng, hyp.fliplr, hyp.flipud)
        labels = flip_labels(labels, lr, ud)
    return SamplePlan(index=index, composites=composites, mix_ratio=ratio, hsv=gains, flip_lr=lr, flip_ud=ud,
                      labels=labels, placement=placed)


def _pick(rng: np.random.Generator, pool: Sequence[int] | None, n: int) -> int:
    """One image for mixup's second mosaic: from the pool, else from the whole dataset."""
    if pool:
        return int(pool[int(rng.integers(0, len(pool)))])
    return int(rng.integers(0, n))


def _without(pool: Sequence[int] | None, drop: int, add: int) -> list[int] | None:
    """Mixup's second mosaic takes its partners from the same pool, its own image swapped for the first's."""
    if pool is None:
        return None
    out = [p for p in pool if p != drop]
    return out + [add]


def draw_partners(rng: np.random.Generator, pool: Sequence[int] | None, n: int) -> np.ndarray:
    """A mosaic's three other images: three distinct members of ``pool`` (the images the loader decodes for
    this batch anyway), or, without a pool, three draws from the whole dataset."""
    if pool is None or not len(pool):
        return rng.integers(0, n, 3)
    pick = rng.choice(len(pool), 3, replace=len(pool) < 3)
    return np.asarray(pool, dtype=np.int64)[pick]


def _mosaic(inputs: PlanInputs, index: int, rng: np.random.Generator,
            partners: Sequence[int] | None) -> tuple[Composite, np.ndarray]:
    """Four images around a random centre on a 2s x 2s canvas, to be warped back to s x s.

    The tiles are ``index`` and three partners, in an order drawn from ``rng``, so the sample's own image
    is not always top-left. Labels come back as pixel [cls, x1, y1, x2, y2] in the s x s output. Draws:
    centre (2), partners (3), order (4), then the warp's 8, always in that order.
    """
    s = inputs.img_size
    xc, yc = (int(v) for v in rng.uniform(0.5 * s, 1.5 * s, 2))
    indices = np.concatenate(([index], draw_partners(rng, partners, len(inputs.loaded_hw))))[rng.permutation(4)]
    tiles = mosaic_tiles(indices.tolist(), (xc, yc), inputs.loaded_hw, s)
    labels = np.concatenate([tile_labels(t, inputs.labels[t.image]) for t in tiles], 0)
    np.clip(labels[:, 1:], 0, 2 * s, out=labels[:, 1:])  # tiles are cut only at the canvas edge
    return _warped(inputs, (2 * s, 2 * s), tiles, labels, rng, border=(-s // 2, -s // 2))


def _warped(inputs: PlanInputs, canvas_hw: tuple[int, int], tiles: tuple[Tile, ...], labels: np.ndarray,
            rng: np.random.Generator, border: tuple[int, int]) -> tuple[Composite, np.ndarray]:
    """The canvas's random perspective (matrix drawn from ``rng``) and its labels after it."""
    geometry = {k: getattr(inputs.hyp, k) for k in GEOMETRY_KEYS}
    M, scale, out_hw = perspective_matrix(canvas_hw, rng, **geometry, border=border)
    perspective = bool(geometry["perspective"])
    comp = Composite(canvas_hw=canvas_hw, tiles=tiles, matrix=M if needs_warp(M, canvas_hw, out_hw) else None,
                     perspective=perspective, out_hw=out_hw)
    return comp, warp_boxes(labels, M, scale, out_hw, perspective)


def mosaic_tiles(indices: Sequence[int], centre: tuple[int, int], loaded_hw: np.ndarray, s: int) -> tuple[Tile, ...]:
    """The four quadrants of a 2s x 2s mosaic canvas around ``centre`` (x, y): each image's corner
    nearest the centre sits on it, and what falls outside the canvas is cut."""
    xc, yc = centre
    tiles = []
    for k, i in enumerate(indices):
        h, w = (int(v) for v in loaded_hw[i])
        if k == 0:  # top left: the tile's bottom-right corner sits on the centre
            x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
            x1b, y1b = w - (x2a - x1a), h - (y2a - y1a)
        elif k == 1:  # top right
            x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, 2 * s), yc
            x1b, y1b = 0, h - (y2a - y1a)
        elif k == 2:  # bottom left
            x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(2 * s, yc + h)
            x1b, y1b = w - (x2a - x1a), 0
        else:  # bottom right
            x1a, y1a, x2a, y2a = xc, yc, min(xc + w, 2 * s), min(2 * s, yc + h)
            x1b, y1b = 0, 0
        tiles.append(Tile(image=int(i), hw=(h, w), rect=(x1a, y1a, x2a, y2a), origin=(x1b, y1b)))
    return tuple(tiles)


def tile_labels(tile: Tile, labels: np.ndarray) -> np.ndarray:
    """An image's normalised labels as canvas pixels [cls, x1, y1, x2, y2] (float32) for ``tile``."""
    out = labels.astype(np.float32)
    if len(out):
        h, w = tile.hw
        out[:, 1:] = xywhn2xyxy(out[:, 1:], w, h, padw=tile.rect[0] - tile.origin[0], padh=tile.rect[1] - tile.origin[1])
    return out


def letterboxed(inputs: PlanInputs, index: int,
                rng: np.random.Generator | None) -> tuple[Composite, np.ndarray, Placement]:
    """Image ``index`` letterboxed to its input shape (then, with ``rng``, randomly warped), its labels in
    pixels [cls, x1, y1, x2, y2], and where the original lies in the letterbox (to map predictions back)."""
    h, w = (int(v) for v in inputs.loaded_hw[index])
    h0, w0 = (int(v) for v in inputs.orig_hw[index])
    shapes = inputs.batch_shapes
    shape = tuple(int(v) for v in shapes[inputs.batch_index[index]]) if shapes is not None else inputs.img_size
    fit = letterbox_fit((h, w), shape, auto=False, scaleup=inputs.augment)
    ratio, pad = fit.ratio, fit.pad
    placed = Placement(orig_hw=(h0, w0), gain_hw=(h * ratio[1] / h0, w * ratio[0] / w0), pad_hw=(pad[1], pad[0]))
    labels = inputs.labels[index].astype(np.float32)
    if len(labels):
        labels[:, 1:] = xywhn2xyxy(labels[:, 1:], ratio[0] * w, ratio[1] * h, padw=pad[0], padh=pad[1])
    rh, rw = fit.resized_hw
    tile = Tile(image=index, hw=fit.resized_hw, rect=(fit.left, fit.top, fit.left + rw, fit.top + rh), origin=(0, 0))
    if rng is None:
        return Composite(fit.out_hw, (tile,), None, False, fit.out_hw), labels, placed
    comp, labels = _warped(inputs, fit.out_hw, (tile,), labels, rng, border=(0, 0))
    return comp, labels, placed
