"""Image augmentations and letterboxing.

Every random draw comes from the ``rng`` argument (a ``np.random.Generator`` the dataset seeds
from ``(seed, epoch, index)``), never from a global RNG: a sample's augmentation is then the same
whatever the worker count, world size, or resume point. Each augmentation draws a fixed number
of values whether or not it fires, so changing one gain does not reshuffle the others' draws.

Random perspective and mixup work on pixel xyxy labels [cls, x1, y1, x2, y2], as
``LoadImagesAndLabels`` holds them before normalising; the mosaic itself is assembled in
utils/data/dataset.py (it needs the dataset to load its other three images).
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


def random_perspective(
    img: np.ndarray,
    labels: np.ndarray,
    rng: np.random.Generator,
    degrees: float = 10.0,
    translate: float = 0.1,
    scale: float = 0.1,
    shear: float = 10.0,
    perspective: float = 0.0,
    border: tuple[int, int] = (0, 0),
) -> tuple[np.ndarray, np.ndarray]:
    """Random perspective, rotation, scale, shear and translation of an image and its boxes.

    ``labels`` are (n, 5) [cls, x1, y1, x2, y2] in pixels. The output is ``img`` grown by
    ``2 * border`` (h, w): a mosaic passes ``(-s // 2, -s // 2)`` to crop its 2s canvas back to s.
    The matrix is built as YOLOv5 does (centre, perspective, rotation+scale, shear, translation),
    so hyperparameters tuned there mean the same here. Boxes are the hull of their transformed
    corners, clipped to the image and filtered by ``box_candidates``. Always draws 8 values
    from ``rng`` in one call, so the sample's later draws do not depend on the gains.
    """
    height, width = img.shape[0] + border[0] * 2, img.shape[1] + border[1] * 2
    u = rng.uniform(-1.0, 1.0, 8)  # perspective x, y; angle; scale; shear x, y; translation x, y
    C = np.eye(3)
    C[0, 2], C[1, 2] = -img.shape[1] / 2, -img.shape[0] / 2  # move the centre to the origin
    P = np.eye(3)
    P[2, 0], P[2, 1] = u[0] * perspective, u[1] * perspective
    R = np.eye(3)
    s = 1 + u[3] * scale
    R[:2] = cv2.getRotationMatrix2D(angle=u[2] * degrees, center=(0, 0), scale=s)
    S = np.eye(3)
    S[0, 1], S[1, 0] = math.tan(u[4] * shear * math.pi / 180), math.tan(u[5] * shear * math.pi / 180)
    T = np.eye(3)
    T[0, 2], T[1, 2] = (0.5 + u[6] * translate) * width, (0.5 + u[7] * translate) * height
    M = T @ S @ R @ P @ C  # right to left: centre first
    if border[0] or border[1] or (M != np.eye(3)).any():
        if perspective:
            img = cv2.warpPerspective(img, M, dsize=(width, height), borderValue=(114, 114, 114))
        else:
            img = cv2.warpAffine(img, M[:2], dsize=(width, height), borderValue=(114, 114, 114))
    n = len(labels)
    if not n:
        return img, labels.reshape(0, 5).copy()
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
    return img, out


def mixup(img1: np.ndarray, labels1: np.ndarray, img2: np.ndarray, labels2: np.ndarray,
          rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Blend two same-shape images with a Beta(32, 32) ratio (about 0.5) and keep both label sets.

    https://arxiv.org/abs/1710.09412. The ratio is concentrated near one half so both images stay
    visible; labels keep full weight, as in YOLOv5.
    """
    r = rng.beta(32.0, 32.0)
    img = (img1 * r + img2 * (1 - r)).astype(np.uint8)
    return img, np.concatenate((labels1, labels2), 0)
