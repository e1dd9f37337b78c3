"""The training/validation Dataset: loads an image, letterboxes it and applies augmentation.

Finding and verifying files live in utils/data/labels.py, the scan cache in labelcache.py, the
messages about problems in problems.py. Every random draw for a sample comes from
``np.random.default_rng([seed, epoch, index])``, so a batch's content does not depend on worker
count, world size or resume. Sizes are (h, w) (utils/data/geometry.py).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from utils.core import watchdog
from utils.core.boxes import xywhn2xyxy, xyxy2xywhn
from utils.core.hyp import Hyp
from utils.core.logging import LOGGER
from utils.data.augment import augment_hsv, letterbox, mixup, random_flip, random_perspective, resize_long_side
from utils.data.geometry import Placement
from utils.data.images import read_image_bgr
from utils.data.labelcache import load_or_scan
from utils.data.labels import describe_source, format_summary, img2label_paths, require_usable, resolve_image_files
from utils.data.problems import check_label_presence, report_messages, write_problem_report


class SampleKey(NamedTuple):
    """What the train sampler hands a worker: the (epoch, index) that seeds the sample's augmentation,
    and whether mosaic is still on. close_mosaic is decided in the main process (TrainSampler), so
    persistent workers follow it without being told, even when --time moves it during the run."""

    epoch: int
    index: int
    mosaic: bool = True


# image (3, H, W) uint8 RGB, labels (n, 6) [0, cls, xc, yc, w, h] normalised, path, placement, index
Sample = tuple[torch.Tensor, torch.Tensor, str, Placement | None, int]


class LoadImagesAndLabels(torch.utils.data.Dataset):
    """Images letterboxed to ``img_size`` (or per-batch rectangles) with normalised labels.

    ``image_hw`` (n, 2) int32 holds each image's upright size (h, w). ``__getitem__`` takes an
    index or a ``SampleKey`` (epoch, index, mosaic) and returns a ``Sample``, whose Placement (None for a mosaic) maps
    predictions back to the original image. Augmentation draws from
    ``np.random.default_rng([seed, epoch, index])`` only, so a sample is the same whichever
    worker, rank or resumed run produces it.

    ``role`` says what the split is for: "train" refuses a split without any box, "val" warns
    about one, None (direct use) checks nothing. With ``verbose`` (rank 0) and a ``report_dir``,
    every scan problem is written to ``report_dir/dataset_problems_<split>.txt``.
    """

    def __init__(self, path: Any, img_size: int = 640, batch_size: int = 16, augment: bool = False,
                 hyp: Hyp | None = None, rect: bool = False, stride: int = 32, pad: float = 0.0,
                 single_cls: bool = False, *, nc: int, seed: int = 0, cache_dir: Path | None = None,
                 prefix: str = "", verbose: bool = True, role: str | None = None,
                 report_dir: Path | None = None) -> None:
        self.path, self.img_size, self.augment = path, img_size, augment
        self.hyp = hyp if hyp is not None else Hyp()
        self.rect, self.stride, self.pad, self.seed = rect, stride, pad, seed
        with watchdog.phase("scan", f"{prefix}{describe_source(path)}"):  # the scan beats per file
            img_files = resolve_image_files(path)
            label_files = img2label_paths(img_files)
            result, self.cache_hit = load_or_scan(path, img_files, label_files, nc, cache_dir)
        c, where, split = result.counts, describe_source(path), prefix.strip(" :") or "split"
        if verbose:
            report = write_problem_report(result.msgs, report_dir, split, where) if report_dir else None
            report_messages(result.msgs, prefix, report)
            LOGGER.info(f"{prefix}Scanning {where}... {c['images']} images, {c['backgrounds']} backgrounds, "
                        f"{c['corrupt']} corrupt" + (" (from cache)" if self.cache_hit else ""))
            LOGGER.info(format_summary(c, split))
        require_usable(result, where)
        check_label_presence(result, where, role, prefix, verbose)
        self.im_files, self.label_files = list(result.img_files), list(result.label_files)
        # float64 as written (evaluation and ground_truth.json); augmentation takes float32 copies
        self.labels = [x.astype(np.float64).reshape(-1, 5).copy() for x in result.labels]
        if single_cls:
            for x in self.labels:
                x[:, 0] = 0
        self.image_hw = np.asarray(result.image_hw, dtype=np.int32).reshape(-1, 2)
        self.counts, self.msgs = dict(c), list(result.msgs)
        self.batch_index = np.arange(len(self.im_files)) // batch_size
        self.batch_shapes: np.ndarray | None = None
        self.imgcache = None  # utils.data.imgcache.ImageCache when --cache ram|disk (set by create_dataloader)
        if rect:
            self._set_rect_shapes(batch_size)

    def _set_rect_shapes(self, batch_size: int) -> None:
        """Sort by aspect ratio and give each batch the smallest stride-multiple shape that fits it."""
        ar = self.image_hw[:, 0] / self.image_hw[:, 1]  # h / w
        order = ar.argsort(kind="stable")
        self.im_files = [self.im_files[i] for i in order]
        self.label_files = [self.label_files[i] for i in order]
        self.labels = [self.labels[i] for i in order]
        self.image_hw, ar = self.image_hw[order], ar[order]
        nb = math.ceil(len(ar) / batch_size)
        rel_hw = np.ones((nb, 2))  # each batch's (h, w) relative to img_size
        for i in range(nb):
            ari = ar[i * batch_size:(i + 1) * batch_size]
            if ari.max() < 1:
                rel_hw[i] = [ari.max(), 1]
            elif ari.min() > 1:
                rel_hw[i] = [1, 1 / ari.min()]
        self.batch_shapes = np.ceil(rel_hw * self.img_size / self.stride + self.pad).astype(int) * self.stride

    def __len__(self) -> int:
        return len(self.im_files)

    def load_image(self, i: int) -> tuple[np.ndarray, tuple[int, int]]:
        """BGR image resized so its long side is img_size, and its original (h, w)."""
        if self.imgcache is not None:  # byte-identical to the disk path below
            return self.imgcache.get(i)
        img = read_image_bgr(self.im_files[i])  # the scan's decoder: EXIF, alpha, 16-bit, CMYK, truncation
        return resize_long_side(img, self.img_size, self.augment), img.shape[:2]

    def load_mosaic(self, index: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Four images around a random centre on a 2s x 2s canvas, warped back to s x s.

        The tiles are ``index`` and three indices drawn from ``rng``, in an order drawn from
        ``rng``, so the sample's own image is not always top-left. Labels come back as pixel
        [cls, x1, y1, x2, y2] in the s x s output. Draws: centre (2), indices (3), order (4), then
        random_perspective's 8, always in that order.
        """
        s = self.img_size
        xc, yc = (int(v) for v in rng.uniform(0.5 * s, 1.5 * s, 2))
        indices = np.concatenate(([index], rng.integers(0, len(self), 3)))[rng.permutation(4)]
        img4 = np.full((2 * s, 2 * s, 3), 114, dtype=np.uint8)
        labels4 = []
        for k, i in enumerate(indices.tolist()):  # four tiles; boxes are handled as arrays
            img, _ = self.load_image(i)
            h, w = img.shape[:2]
            if k == 0:  # top left: the tile's bottom-right corner sits on the centre
                x1a, y1a, x2a, y2a = max(xc - w, 0), max(yc - h, 0), xc, yc
                x1b, y1b, x2b, y2b = w - (x2a - x1a), h - (y2a - y1a), w, h
            elif k == 1:  # top right
                x1a, y1a, x2a, y2a = xc, max(yc - h, 0), min(xc + w, 2 * s), yc
                x1b, y1b, x2b, y2b = 0, h - (y2a - y1a), min(w, x2a - x1a), h
            elif k == 2:  # bottom left
                x1a, y1a, x2a, y2a = max(xc - w, 0), yc, xc, min(2 * s, yc + h)
                x1b, y1b, x2b, y2b = w - (x2a - x1a), 0, w, min(y2a - y1a, h)
            else:  # bottom right
                x1a, y1a, x2a, y2a = xc, yc, min(xc + w, 2 * s), min(2 * s, yc + h)
                x1b, y1b, x2b, y2b = 0, 0, min(w, x2a - x1a), min(y2a - y1a, h)
            img4[y1a:y2a, x1a:x2a] = img[y1b:y2b, x1b:x2b]
            labels = self.labels[i].astype(np.float32)
            if len(labels):
                labels[:, 1:] = xywhn2xyxy(labels[:, 1:], w, h, padw=x1a - x1b, padh=y1a - y1b)
            labels4.append(labels)
        labels = np.concatenate(labels4, 0)
        np.clip(labels[:, 1:], 0, 2 * s, out=labels[:, 1:])  # tiles are cut only at the canvas edge
        return random_perspective(img4, labels, rng, **self._geometry(), border=(-s // 2, -s // 2))

    def _geometry(self) -> dict[str, float]:
        """random_perspective's gains from the hyperparameters."""
        return {k: getattr(self.hyp, k) for k in ("degrees", "translate", "scale", "shear", "perspective")}

    def mosaic_enabled(self, key: SampleKey) -> bool:
        """Mosaic is used for augmented square training while the key allows it (close_mosaic).

        Rectangular training keeps each image's aspect ratio, which a square mosaic would undo.
        """
        return self.augment and not self.rect and key.mosaic

    def __getitem__(self, item: int | tuple) -> Sample:
        key = SampleKey(*item) if isinstance(item, tuple) else SampleKey(0, item)
        epoch, index = int(key.epoch), int(key.index)
        rng = np.random.default_rng([self.seed, epoch, index])
        hyp, placed = self.hyp, None  # a mosaic has no placement to map predictions back through
        if self.augment:
            # Decisions first, then one independent child stream per stage (spawned from this
            # sample's seed, not drawn), so turning mixup on or changing a gain does not shift
            # the colour or flip draws. Everything still depends only on (seed, epoch, index).
            u = rng.random(2)  # mosaic, mixup
            geo_rng, mix_rng, colour_rng = rng.spawn(3)
        if self.augment and self.mosaic_enabled(key) and u[0] < hyp.mosaic:
            img, labels = self.load_mosaic(index, geo_rng)
            if u[1] < hyp.mixup:
                img2, labels2 = self.load_mosaic(int(mix_rng.integers(0, len(self))), mix_rng)
                img, labels = mixup(img, labels, img2, labels2, mix_rng)
        else:
            img, labels, placed = self.load_letterboxed(index)
            if self.augment:
                img, labels = random_perspective(img, labels, geo_rng, **self._geometry())
        if self.augment:
            augment_hsv(img, colour_rng, hyp.hsv_h, hyp.hsv_s, hyp.hsv_v)
        if len(labels):
            labels[:, 1:] = xyxy2xywhn(labels[:, 1:], w=img.shape[1], h=img.shape[0], clip=True)
        if self.augment:
            img, labels = random_flip(img, labels, colour_rng, hyp.fliplr, hyp.flipud)
        labels_out = torch.zeros((len(labels), 6))
        if len(labels):
            labels_out[:, 1:] = torch.from_numpy(labels)
        img = np.ascontiguousarray(img.transpose((2, 0, 1))[::-1])  # HWC BGR -> CHW RGB
        return torch.from_numpy(img), labels_out, self.im_files[index], placed, index

    def load_letterboxed(self, index: int) -> tuple[np.ndarray, np.ndarray, Placement]:
        """Image ``index`` letterboxed to its input shape, its labels in pixels [cls, x1, y1, x2, y2],
        and where the original lies in it (to map predictions back)."""
        img, (h0, w0) = self.load_image(index)
        h, w = img.shape[:2]
        shape = tuple(self.batch_shapes[self.batch_index[index]]) if self.rect else self.img_size
        img, ratio, pad = letterbox(img, shape, auto=False, scaleup=self.augment)
        placed = Placement(orig_hw=(h0, w0), gain_hw=(h * ratio[1] / h0, w * ratio[0] / w0),
                           pad_hw=(pad[1], pad[0]))
        labels = self.labels[index].astype(np.float32)
        if len(labels):
            labels[:, 1:] = xywhn2xyxy(labels[:, 1:], ratio[0] * w, ratio[1] * h, padw=pad[0], padh=pad[1])
        return img, labels, placed
