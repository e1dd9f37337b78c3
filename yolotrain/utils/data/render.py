"""Drawing sample plans with OpenCV, in the loader: tiles pasted on a grey canvas, one warp to the output
size, then colour and the BGR -> RGB order in a single pass that writes straight into the batch's memory,
and flips in place. Each image a batch needs is read once (``TileSource``), however many mosaics use it.
"""
from __future__ import annotations

from typing import Callable

import cv2
import numpy as np

from yolotrain.utils.data.augment import apply_hsv, blend, warp_image
from yolotrain.utils.data.plan import Composite, SamplePlan, Tile


class TileSource:
    """The images one batch needs, each read (decoded and resized by ``load``) once for the whole batch."""

    def __init__(self, load: Callable[[int], np.ndarray]) -> None:
        self._load = load
        self._images: dict[int, np.ndarray] = {}

    def image(self, index: int) -> np.ndarray:
        """Image ``index`` as the dataset loads it (BGR, long side img_size)."""
        img = self._images.get(index)
        if img is None:
            img = self._images[index] = self._load(index)
        return img

    def get(self, tile: Tile) -> np.ndarray:
        """The tile's image at the tile's size (letterbox's own resize, when its box is smaller)."""
        img = self.image(tile.image)
        if img.shape[:2] != tuple(tile.hw):
            img = cv2.resize(img, (tile.hw[1], tile.hw[0]), interpolation=cv2.INTER_LINEAR)
        return img

    @property
    def reads(self) -> int:
        """Images read so far (a benchmark's count of decodes per batch)."""
        return len(self._images)


class Scratch:
    """Arrays a process reuses from sample to sample (canvas, warp output): allocating a mosaic's 2s x 2s
    canvas afresh for every sample costs page faults on each."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None or a.shape != shape:
            a = self._arrays[name] = np.empty(shape, np.uint8)
        return a


def render(plan: SamplePlan, tiles: TileSource, out: np.ndarray, scratch: Scratch) -> None:
    """Draw ``plan`` into ``out`` ((h, w, 3) uint8, RGB)."""
    imgs = [draw_composite(c, tiles, scratch, k) for k, c in enumerate(plan.composites)]
    img = imgs[0] if len(imgs) == 1 else blend(imgs[0], imgs[1], plan.mix_ratio)
    colour_into(img, out, plan.hsv, scratch)
    if plan.flip_lr or plan.flip_ud:
        flip_in_place(out, plan.flip_lr, plan.flip_ud)


def colour_into(img: np.ndarray, out: np.ndarray, gains: np.ndarray | None, scratch: Scratch) -> None:
    """BGR ``img`` -> RGB ``out``, through the HSV gains when there are any."""
    if gains is not None:
        h, w = img.shape[:2]
        apply_hsv(img, gains, dst=out, rgb=True, planes=[scratch.array(f"plane{c}", (h, w)) for c in range(3)])
    else:
        cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=out)


def flip_in_place(img: np.ndarray, lr: bool, ud: bool) -> None:
    """Flip left-right and/or up-down without a copy."""
    cv2.flip(img, -1 if lr and ud else int(lr), dst=img)


def draw_composite(comp: Composite, tiles: TileSource, scratch: Scratch, k: int = 0) -> np.ndarray:
    """The composite's canvas (tiles on grey 114), warped to its output size when it has a matrix (BGR).
    The array belongs to ``scratch``: the next sample overwrites it."""
    canvas = scratch.array(f"canvas{k}", (*comp.canvas_hw, 3))
    canvas.fill(114)
    for t in comp.tiles:
        x1a, y1a, x2a, y2a = t.rect
        x1b, y1b = t.origin
        canvas[y1a:y2a, x1a:x2a] = tiles.get(t)[y1b:y1b + y2a - y1a, x1b:x1b + x2a - x1a]
    if comp.matrix is None:
        return canvas
    return warp_image(canvas, comp.matrix, comp.out_hw, comp.perspective,
                      dst=scratch.array(f"warp{k}", (*comp.out_hw, 3)))
