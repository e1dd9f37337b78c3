"""The training/validation Dataset: loads an image, letterboxes it and applies augmentation.

Finding and verifying files and the label cache live in utils/labels.py. Every random draw for a
sample comes from ``np.random.default_rng([seed, epoch, index])``, so a batch's content does not
depend on worker count, world size or resume.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from utils.augment import augment_hsv, letterbox, random_flip, resize_long_side
from utils.boxes import xywhn2xyxy, xyxy2xywhn
from utils.errors import UserError
from utils.labels import img2label_paths, resolve_image_files, report_messages, load_or_scan, _describe
from utils.logging import LOGGER

HYP_DEFAULTS = {"hsv_h": 0.015, "hsv_s": 0.7, "hsv_v": 0.4, "fliplr": 0.5, "flipud": 0.0}


def _hyp(hyp: Any, key: str) -> float:
    """A hyperparameter from an object (attribute) or dict, YOLOv5's default when absent."""
    value = hyp.get(key) if isinstance(hyp, dict) else getattr(hyp, key, None)
    return float(HYP_DEFAULTS[key] if value is None else value)


class LoadImagesAndLabels(torch.utils.data.Dataset):
    """Images letterboxed to ``img_size`` (or per-batch rectangles) with normalised labels.

    ``__getitem__`` takes an index or ``(epoch, index)``; augmentation draws from
    ``np.random.default_rng([seed, epoch, index])`` only, so a sample is the same whichever
    worker, rank or resumed run produces it.
    """

    def __init__(self, path: Any, img_size: int = 640, batch_size: int = 16, augment: bool = False,
                 hyp: Any = None, rect: bool = False, stride: int = 32, pad: float = 0.0,
                 single_cls: bool = False, *, nc: int, seed: int = 0, cache_dir: Path | None = None,
                 prefix: str = "", verbose: bool = True) -> None:
        self.path, self.img_size, self.augment, self.hyp = path, img_size, augment, hyp
        self.rect, self.stride, self.pad, self.seed = rect, stride, pad, seed
        img_files = resolve_image_files(path)
        label_files = img2label_paths(img_files)
        result, self.cache_hit = load_or_scan(path, img_files, label_files, nc, cache_dir)
        c, where = result.counts, _describe(path)
        if verbose:
            report_messages(result.msgs, prefix)
            LOGGER.info(f"{prefix}Scanning {where}... {c['images']} images, {c['backgrounds']} backgrounds, "
                        f"{c['corrupt']} corrupt" + (" (from cache)" if self.cache_hit else ""))
        if not c["images"]:
            raise UserError(f"{where}: no usable images ({c['corrupt']} corrupt, see the warnings above)")
        self.im_files, self.label_files = list(result.img_files), list(result.label_files)
        self.labels = [x.astype(np.float32).reshape(-1, 5).copy() for x in result.labels]
        if single_cls:
            for x in self.labels:
                x[:, 0] = 0
        self.shapes = np.asarray(result.shapes, dtype=np.int32).reshape(-1, 2)
        self.counts, self.msgs = dict(c), list(result.msgs)
        self.batch_index = np.arange(len(self.im_files)) // batch_size
        self.batch_shapes: np.ndarray | None = None
        if rect:
            self._set_rect_shapes(batch_size)

    def _set_rect_shapes(self, batch_size: int) -> None:
        """Sort by aspect ratio and give each batch the smallest stride-multiple shape that fits it."""
        ar = self.shapes[:, 1] / self.shapes[:, 0]  # h / w
        order = ar.argsort(kind="stable")
        self.im_files = [self.im_files[i] for i in order]
        self.label_files = [self.label_files[i] for i in order]
        self.labels = [self.labels[i] for i in order]
        self.shapes, ar = self.shapes[order], ar[order]
        nb = math.ceil(len(ar) / batch_size)
        shapes = np.ones((nb, 2))
        for i in range(nb):
            ari = ar[i * batch_size:(i + 1) * batch_size]
            if ari.max() < 1:
                shapes[i] = [ari.max(), 1]
            elif ari.min() > 1:
                shapes[i] = [1, 1 / ari.min()]
        self.batch_shapes = np.ceil(shapes * self.img_size / self.stride + self.pad).astype(int) * self.stride

    def __len__(self) -> int:
        return len(self.im_files)

    def load_image(self, i: int) -> tuple[np.ndarray, tuple[int, int]]:
        """BGR image resized so its long side is img_size, and its original (h, w)."""
        img = cv2.imread(self.im_files[i])
        if img is None:
            raise UserError(f"{self.im_files[i]}: OpenCV cannot read this image")
        return resize_long_side(img, self.img_size, self.augment), img.shape[:2]

    def __getitem__(self, item: int | tuple[int, int]):
        epoch, index = item if isinstance(item, tuple) else (0, item)
        index = int(index)
        rng = np.random.default_rng([self.seed, int(epoch), index])
        img, (h0, w0) = self.load_image(index)
        h, w = img.shape[:2]
        shape = tuple(self.batch_shapes[self.batch_index[index]]) if self.rect else self.img_size
        img, ratio, pad = letterbox(img, shape, auto=False, scaleup=self.augment)
        shapes = (h0, w0), ((h * ratio[1] / h0, w * ratio[0] / w0), pad)
        labels = self.labels[index].copy()
        if len(labels):
            labels[:, 1:] = xywhn2xyxy(labels[:, 1:], ratio[0] * w, ratio[1] * h, padw=pad[0], padh=pad[1])
        if self.augment:  # pixel-space augmentations (mosaic, perspective) will go before HSV
            augment_hsv(img, rng, _hyp(self.hyp, "hsv_h"), _hyp(self.hyp, "hsv_s"), _hyp(self.hyp, "hsv_v"))
        if len(labels):
            labels[:, 1:] = xyxy2xywhn(labels[:, 1:], w=img.shape[1], h=img.shape[0], clip=True)
        if self.augment:
            img, labels = random_flip(img, labels, rng, _hyp(self.hyp, "fliplr"), _hyp(self.hyp, "flipud"))
        labels_out = torch.zeros((len(labels), 6))
        if len(labels):
            labels_out[:, 1:] = torch.from_numpy(labels)
        img = np.ascontiguousarray(img.transpose((2, 0, 1))[::-1])  # HWC BGR -> CHW RGB
        return torch.from_numpy(img), labels_out, self.im_files[index], shapes, index
