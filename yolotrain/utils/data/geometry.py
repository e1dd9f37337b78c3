"""Image geometry: one convention for sizes, and how an image sits in the network input.

Sizes, gains and paddings are (h, w) pairs everywhere (numpy's ``img.shape[:2]`` order): the
label scan's ``image_hw``, the rect ``batch_shapes``, ``Placement``. Only boxes keep their own
coordinate order, x before y (xyxy, xywh). Keeping one order for pairs means a swap is always a bug,
never a convention that differs between modules.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Placement(NamedTuple):
    """Where an original image lies in the letterboxed network input (a mosaic sample has none).

    A point y, x of the original image lands at ``y * gain_h + pad_h``, ``x * gain_w + pad_w``.
    Each axis has its own gain: the loader rounds the resized width and height separately.
    """

    orig_hw: tuple[int, int]  # original (upright) image size
    gain_hw: tuple[float, float]  # resized / original, per axis
    pad_hw: tuple[float, float]  # padding before the image: top, left


def unletterbox(det: torch.Tensor, placed: Placement) -> np.ndarray:
    """Detections (n, 6) [x1, y1, x2, y2, score, cls] from the network input to original pixels.

    float32, clipped to the image. One gain for both axes (as YOLOv5's scale_boxes uses) would
    shift boxes by up to a pixel against the labels, since each side is rounded on its own.
    """
    (h0, w0), (gain_h, gain_w), (pad_h, pad_w) = placed
    d = det.float().cpu().numpy().copy()
    d[:, [0, 2]] = np.clip((d[:, [0, 2]] - np.float32(pad_w)) / np.float32(gain_w), 0, w0)
    d[:, [1, 3]] = np.clip((d[:, [1, 3]] - np.float32(pad_h)) / np.float32(gain_h), 0, h0)
    return d
