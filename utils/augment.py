"""Image augmentations and letterboxing.

Every random draw comes from the ``rng`` argument (a ``np.random.Generator`` the dataset seeds
from ``(seed, epoch, index)``), never from a global RNG: a sample's augmentation is then the same
whatever the worker count, world size, or resume point. Each augmentation draws a fixed number
of values whether or not it fires, so changing one gain does not reshuffle the others' draws.

Mosaic, random perspective and mixup belong here too (a later change); they take the same
``rng`` argument and work on pixel xyxy labels, as ``LoadImagesAndLabels`` holds them before
normalising.
"""
from __future__ import annotations

import math

import cv2
import numpy as np


def letterbox(
    img: np.ndarray,
    new_shape: int | tuple[int, int] = 640,
    color: tuple[int, int, int] = (114, 114, 114),
    auto: bool = False,
    scaleup: bool = True,
    stride: int = 32,
) -> tuple[np.ndarray, tuple[float, float], tuple[float, float]]:
    """Resize keeping the aspect ratio, then pad to ``new_shape`` (h, w), padding split evenly.

    ``auto`` pads only up to a multiple of ``stride`` (minimum rectangle); ``scaleup=False`` only
    shrinks, which keeps validation faithful to the original pixels. Returns the image, the
    scale ratio (rw, rh) and the padding (dw, dh) added on the left and top.
    """
    shape = img.shape[:2]  # h, w
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    r = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    if not scaleup:
        r = min(r, 1.0)
    new_unpad = int(round(shape[1] * r)), int(round(shape[0] * r))  # w, h
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = dw % stride, dh % stride
    dw, dh = dw / 2, dh / 2
    if (shape[1], shape[0]) != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=color)
    return img, (new_unpad[0] / shape[1], new_unpad[1] / shape[0]), (float(left), float(top))


def augment_hsv(img: np.ndarray, rng: np.random.Generator, hgain: float = 0.5, sgain: float = 0.5,
                vgain: float = 0.5) -> None:
    """Scale hue, saturation and value of a BGR uint8 image in place, by lookup tables.

    Each channel is multiplied by a factor drawn from 1 +- gain (hue wraps at 180).
    """
    r = rng.uniform(-1, 1, 3) * np.array([hgain, sgain, vgain]) + 1
    if not (hgain or sgain or vgain):
        return
    hue, sat, val = cv2.split(cv2.cvtColor(img, cv2.COLOR_BGR2HSV))
    x = np.arange(0, 256, dtype=np.float64)
    lut_hue = ((x * r[0]) % 180).astype(np.uint8)
    lut_sat = np.clip(x * r[1], 0, 255).astype(np.uint8)
    lut_val = np.clip(x * r[2], 0, 255).astype(np.uint8)
    hsv = cv2.merge((cv2.LUT(hue, lut_hue), cv2.LUT(sat, lut_sat), cv2.LUT(val, lut_val)))
    cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR, dst=img)


def random_flip(img: np.ndarray, labels: np.ndarray, rng: np.random.Generator, fliplr: float = 0.5,
                flipud: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Flip left-right with probability ``fliplr`` and up-down with ``flipud``.

    ``labels`` are (n, 5) [cls, xc, yc, w, h] normalised; returns new image and label arrays.
    """
    u = rng.random(2)
    labels = labels.copy()
    if u[0] < fliplr:
        img = np.ascontiguousarray(img[:, ::-1])
        labels[:, 1] = 1 - labels[:, 1]
    if u[1] < flipud:
        img = np.ascontiguousarray(img[::-1])
        labels[:, 2] = 1 - labels[:, 2]
    return img, labels


def resize_long_side(img: np.ndarray, img_size: int, augment: bool) -> np.ndarray:
    """Scale so the long side is ``img_size``: INTER_AREA when shrinking for evaluation (sharper)."""
    h0, w0 = img.shape[:2]
    r = img_size / max(h0, w0)
    if r == 1:
        return img
    interp = cv2.INTER_LINEAR if (augment or r > 1) else cv2.INTER_AREA
    size = (min(max(1, math.ceil(w0 * r)), img_size), min(max(1, math.ceil(h0 * r)), img_size))
    return cv2.resize(img, size, interpolation=interp)
