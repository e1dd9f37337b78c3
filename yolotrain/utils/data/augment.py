"""Image augmentations and letterboxing.

Every random draw comes from the ``rng`` argument (a ``np.random.Generator`` the dataset seeds
from ``(seed, epoch, index)``), never from a global RNG: a sample's augmentation is then the same
whatever the worker count, world size, or resume point. Each augmentation draws a fixed number
of values whether or not it fires, so changing one gain does not reshuffle the others' draws.

These are the pieces: utils/data/plan.py draws a sample's whole augmentation from them (mosaic,
perspective, mixup, colour, flips) and utils/data/render.py (OpenCV, in the loader) or
utils/data/device_augment.py (torch, on the training device) draws its pixels. The warp works on pixel xyxy
labels [cls, x1, y1, x2, y2].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cv2
import numpy as np


@dataclass(frozen=True)
class LetterboxFit:
    """Where an image of some size lands in a letterbox: its resized size, the per-axis ratio (rw, rh)
    resized / original, and the padding added on each side. One rule for pixels and labels."""

    resized_hw: tuple[int, int]
    ratio: tuple[float, float]
    top: int
    bottom: int
    left: int
    right: int

    @property
    def out_hw(self) -> tuple[int, int]:
        return self.resized_hw[0] + self.top + self.bottom, self.resized_hw[1] + self.left + self.right

    @property
    def pad(self) -> tuple[float, float]:
        """(left, top): the padding before the image, as labels and Placement take it."""
        return float(self.left), float(self.top)


def letterbox_fit(hw: tuple[int, int], new_shape: int | tuple[int, int] = 640, auto: bool = False,
                  scaleup: bool = True, stride: int = 32) -> LetterboxFit:
    """letterbox's geometry for an (h, w) image, without the image: resize keeping the aspect ratio,
    then pad to ``new_shape`` (h, w), the padding split evenly (see ``letterbox``)."""
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    r = min(new_shape[0] / hw[0], new_shape[1] / hw[1])
    if not scaleup:
        r = min(r, 1.0)
    new_unpad = int(round(hw[1] * r)), int(round(hw[0] * r))  # w, h
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = dw % stride, dh % stride
    dw, dh = dw / 2, dh / 2
    return LetterboxFit(resized_hw=(new_unpad[1], new_unpad[0]), ratio=(new_unpad[0] / hw[1], new_unpad[1] / hw[0]),
                        top=int(round(dh - 0.1)), bottom=int(round(dh + 0.1)),
                        left=int(round(dw - 0.1)), right=int(round(dw + 0.1)))


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
    fit = letterbox_fit(img.shape[:2], new_shape, auto, scaleup, stride)
    if img.shape[:2] != fit.resized_hw:
        img = cv2.resize(img, fit.resized_hw[::-1], interpolation=cv2.INTER_LINEAR)
    img = cv2.copyMakeBorder(img, fit.top, fit.bottom, fit.left, fit.right, cv2.BORDER_CONSTANT, value=color)
    return img, fit.ratio, fit.pad


def hsv_gains(rng: np.random.Generator, hgain: float = 0.5, sgain: float = 0.5,
              vgain: float = 0.5) -> np.ndarray | None:
    """Hue, saturation and value multipliers drawn from 1 +- gain; None when every gain is 0.

    Always draws three values, so the sample's later draws do not depend on the gains.
    """
    r = rng.uniform(-1, 1, 3) * np.array([hgain, sgain, vgain]) + 1
    return r if (hgain or sgain or vgain) else None


def hsv_luts(r: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 lookup tables that scale OpenCV's 8-bit H (0-179, wrapping), S and V by ``r``."""
    x = np.arange(0, 256, dtype=np.float64)
    return (((x * r[0]) % 180).astype(np.uint8), np.clip(x * r[1], 0, 255).astype(np.uint8),
            np.clip(x * r[2], 0, 255).astype(np.uint8))


def apply_hsv(img: np.ndarray, r: np.ndarray, dst: np.ndarray | None = None, rgb: bool = False,
              planes: list[np.ndarray] | None = None) -> np.ndarray:
    """Scale hue, saturation and value of a BGR uint8 image: to HSV, one lookup per channel, back. The way
    back writes into ``dst`` (default: ``img`` itself), in RGB order with ``rgb``, so a loader gets its
    tensor layout from the same pass. ``planes``: three (h, w) uint8 arrays to reuse for the lookups (split
    channels look up several times faster than a 3-channel table)."""
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV)
    if planes is None or planes[0].shape != img.shape[:2]:
        planes = [np.empty(img.shape[:2], np.uint8) for _ in range(3)]
    cv2.split(hsv, planes)
    for plane, lut in zip(planes, hsv_luts(r)):
        cv2.LUT(plane, lut, dst=plane)
    cv2.merge(planes, dst=hsv)
    out = img if dst is None else dst
    cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB if rgb else cv2.COLOR_HSV2BGR, dst=out)
    return out


def flip_draws(rng: np.random.Generator, fliplr: float = 0.5, flipud: float = 0.0) -> tuple[bool, bool]:
    """Whether to flip left-right (probability ``fliplr``) and up-down (``flipud``): always two draws."""
    u = rng.random(2)
    return bool(u[0] < fliplr), bool(u[1] < flipud)


def flip_labels(labels: np.ndarray, lr: bool, ud: bool) -> np.ndarray:
    """(n, 5) [cls, xc, yc, w, h] normalised labels of a flipped image (a new array)."""
    labels = labels.copy()
    if lr:
        labels[:, 1] = 1 - labels[:, 1]
    if ud:
        labels[:, 2] = 1 - labels[:, 2]
    return labels


def resized_hw(h0: int, w0: int, img_size: int) -> tuple[int, int]:
    """(h, w) after ``resize_long_side``: the long side becomes ``img_size``, each side rounded up on its own."""
    r = img_size / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(max(1, math.ceil(h0 * r)), img_size), min(max(1, math.ceil(w0 * r)), img_size)


def resized_hw_all(hw: np.ndarray, img_size: int) -> np.ndarray:
    """(n, 2) int64 ``resized_hw`` of every (h, w) row at once, the same float64 arithmetic."""
    hw = np.asarray(hw, np.int64).reshape(-1, 2)
    r = img_size / hw.max(1, keepdims=True).astype(np.float64)
    out = np.minimum(np.maximum(np.ceil(hw * r), 1), img_size).astype(np.int64)
    return np.where(r == 1, hw, out)


def resize_long_side(img: np.ndarray, img_size: int, augment: bool) -> np.ndarray:
    """Scale so the long side is ``img_size``: INTER_AREA when shrinking for evaluation (sharper)."""
    h0, w0 = img.shape[:2]
    h, w = resized_hw(h0, w0, img_size)
    if (h, w) == (h0, w0):
        return img
    interp = cv2.INTER_LINEAR if (augment or img_size > max(h0, w0)) else cv2.INTER_AREA
    return cv2.resize(img, (w, h), interpolation=interp)


def box_candidates(box1: np.ndarray, box2: np.ndarray, wh_thr: float = 2, ar_thr: float = 100,
                   area_thr: float = 0.1, eps: float = 1e-16) -> np.ndarray:
    """Mask of boxes worth keeping after a geometric transform: (n, 4) xyxy before (box1) and after (box2).

    A box survives if it is still more than ``wh_thr`` pixels wide and high, kept more than
    ``area_thr`` of its (scale-adjusted) area, and is not a sliver (aspect ratio below ``ar_thr``):
    boxes mostly cut off by the image edge or squashed to a line teach the model noise.
    """
    w1, h1 = box1[:, 2] - box1[:, 0], box1[:, 3] - box1[:, 1]
    w2, h2 = box2[:, 2] - box2[:, 0], box2[:, 3] - box2[:, 1]
    ar = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (ar < ar_thr)


def perspective_matrix(in_hw: tuple[int, int], rng: np.random.Generator, degrees: float = 10.0,
                       translate: float = 0.1, scale: float = 0.1, shear: float = 10.0, perspective: float = 0.0,
                       border: tuple[int, int] = (0, 0)) -> tuple[np.ndarray, float, tuple[int, int]]:
    """random_perspective's 3x3 matrix for an image of size ``in_hw``, its scale draw and the output (h, w).

    Built as YOLOv5 does (centre, perspective, rotation+scale, shear, translation), so hyperparameters
    tuned there mean the same here. Always draws 8 values from ``rng`` in one call.
    """
    height, width = in_hw[0] + border[0] * 2, in_hw[1] + border[1] * 2
    u = rng.uniform(-1.0, 1.0, 8)  # perspective x, y; angle; scale; shear x, y; translation x, y
    C = np.eye(3)
    C[0, 2], C[1, 2] = -in_hw[1] / 2, -in_hw[0] / 2  # move the centre to the origin
    P = np.eye(3)
    P[2, 0], P[2, 1] = u[0] * perspective, u[1] * perspective
    R = np.eye(3)
    s = 1 + u[3] * scale
    R[:2] = cv2.getRotationMatrix2D(angle=u[2] * degrees, center=(0, 0), scale=s)
    S = np.eye(3)
    S[0, 1], S[1, 0] = math.tan(u[4] * shear * math.pi / 180), math.tan(u[5] * shear * math.pi / 180)
    T = np.eye(3)
    T[0, 2], T[1, 2] = (0.5 + u[6] * translate) * width, (0.5 + u[7] * translate) * height
    return T @ S @ R @ P @ C, s, (height, width)  # right to left: centre first


def needs_warp(M: np.ndarray, in_hw: tuple[int, int], out_hw: tuple[int, int]) -> bool:
    """False when the warp would return its input unchanged (identity matrix, same size)."""
    return tuple(in_hw) != tuple(out_hw) or bool((M != np.eye(3)).any())


def warp_image(img: np.ndarray, M: np.ndarray, out_hw: tuple[int, int], perspective: bool,
               dst: np.ndarray | None = None) -> np.ndarray:
    """``img`` warped by ``M`` to ``out_hw`` (bilinear, grey 114 outside), into ``dst`` when given."""
    size = (out_hw[1], out_hw[0])
    if perspective:
        return cv2.warpPerspective(img, M, dsize=size, dst=dst, borderValue=(114, 114, 114))
    return cv2.warpAffine(img, M[:2], dsize=size, dst=dst, borderValue=(114, 114, 114))


def warp_boxes(labels: np.ndarray, M: np.ndarray, s: float, out_hw: tuple[int, int], perspective: bool) -> np.ndarray:
    """Pixel [cls, x1, y1, x2, y2] labels after the warp ``M``: the hull of each box's transformed corners,
    clipped to the output and filtered by ``box_candidates`` (``s``: the matrix's scale draw)."""
    n = len(labels)
    if not n:
        return labels.reshape(0, 5).copy()
    height, width = out_hw
    xy = np.ones((n * 4, 3))
    xy[:, :2] = labels[:, [1, 2, 3, 4, 1, 4, 3, 2]].reshape(n * 4, 2)  # the four corners
    xy = xy @ M.T
    xy = (xy[:, :2] / xy[:, 2:3] if perspective else xy[:, :2]).reshape(n, 8)
    x, y = xy[:, [0, 2, 4, 6]], xy[:, [1, 3, 5, 7]]
    new = np.stack((x.min(1), y.min(1), x.max(1), y.max(1)), 1)
    new[:, [0, 2]] = new[:, [0, 2]].clip(0, width)
    new[:, [1, 3]] = new[:, [1, 3]].clip(0, height)
    keep = box_candidates(labels[:, 1:5] * s, new)
    out = labels[keep].copy()
    out[:, 1:5] = new[keep]
    return out


def mixup_ratio(rng: np.random.Generator) -> float:
    """Mixup's blend weight of the first image, Beta(32, 32): about one half, so both images stay visible."""
    return float(rng.beta(32.0, 32.0))


def blend(img1: np.ndarray, img2: np.ndarray, r: float) -> np.ndarray:
    """``img1 * r + img2 * (1 - r)`` as uint8 (truncated), as YOLOv5 blends."""
    return (img1 * r + img2 * (1 - r)).astype(np.uint8)
