"""The training/validation Dataset: loads an image, letterboxes it and applies augmentation.

The split comes from a ``SplitSource`` (utils/data/split.py: image files, a shard index, or a source of your own),
which scans it and reads its images; the dataset composes it with the label table, the sample plans
(utils/data/plan.py) and the renderers (render.py on the CPU, device_augment.py on the training device). The
messages about problems live in problems.py. Every random draw for a sample comes from
``np.random.default_rng([seed, epoch, index])``, so a batch's content does not depend on worker
count, world size or resume. Sizes are (h, w) (utils/data/geometry.py).
"""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from yolotrain.utils.core import watchdog
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.augment import resize_long_side, resized_hw_all
from yolotrain.utils.data.batch import Batch, BatchMemory, batch_targets
from yolotrain.utils.data.device_augment import pack
from yolotrain.utils.data.geometry import Placement
from yolotrain.utils.data.labels import LabelTable, format_summary, require_usable
from yolotrain.utils.data.plan import PlanInputs, SamplePlan, plan_sample
from yolotrain.utils.data.problems import check_label_presence, report_messages, write_problem_report
from yolotrain.utils.data.render import Scratch, TileSource, render
from yolotrain.utils.data.split import open_split


class SampleKey(NamedTuple):
    """What the train sampler hands a worker: the (epoch, index) that seeds the sample's augmentation,
    whether mosaic is still on, and the pool its mosaic partners come from. close_mosaic is decided in the
    main process (TrainSampler), so persistent workers follow it without being told, even when --time moves
    it during the run. An empty pool lets a mosaic take its partners from the whole dataset."""

    epoch: int
    index: int
    mosaic: bool = True
    pool: tuple[int, ...] = ()


@dataclass(frozen=True)
class DatasetSpec:
    """What a split is loaded as: ``source`` (a split's path: a folder, a .txt list, a shard index, or a list of
    those; or a ``SplitSource``) with ``nc`` classes (the scan checks the labels against it; ``single_cls`` then
    relabels every box 0), letterboxed to ``img_size`` (``rect``: per-batch rectangles of ``stride`` multiples,
    ``pad`` strides more), with ``augment`` drawing ``hyp``'s augmentation from ``seed``."""

    source: Any
    _: KW_ONLY
    nc: int
    img_size: int = 640
    stride: int = 32
    augment: bool = False
    hyp: Hyp | None = None
    rect: bool = False
    pad: float = 0.0
    single_cls: bool = False
    seed: int = 0


# image (3, H, W) uint8 RGB, labels (n, 6) [0, cls, xc, yc, w, h] normalised, path, placement, index
Sample = tuple[torch.Tensor, torch.Tensor, str, Placement | None, int]


class LoadImagesAndLabels(torch.utils.data.Dataset):
    """Images letterboxed to ``img_size`` (or per-batch rectangles) with normalised labels.

    ``image_hw`` (n, 2) int32 holds each image's upright size (h, w). ``__getitem__`` takes an
    index or a ``SampleKey`` (epoch, index, mosaic) and returns a ``Sample``, whose Placement (None for a mosaic) maps
    predictions back to the original image. Augmentation draws from
    ``np.random.default_rng([seed, epoch, index])`` only, so a sample is the same whichever
    worker, rank or resumed run produces it.

    ``spec``: what is loaded (``DatasetSpec``); ``batch_size``: images per batch over all ranks,
    which share one rectangle under ``rect``; ``cache_dir``: where the scan's cache goes when it cannot sit beside
    the labels. ``role`` says what the split is for: "train" refuses a split without any box, "val" warns
    about one, None (direct use) checks nothing. With ``verbose`` (rank 0) and a ``report_dir``,
    every scan problem is written to ``report_dir/dataset_problems_<split>.txt``. ``memory``: where batches are
    written (utils/data/batch.py); ``render_on_device``: batches carry tiles and plans for the training device.
    """

    def __init__(self, spec: DatasetSpec, batch_size: int = 16, *, cache_dir: Path | None = None, prefix: str = "",
                 verbose: bool = True, role: str | None = None, report_dir: Path | None = None,
                 memory: BatchMemory | None = None, render_on_device: bool = False) -> None:
        self.source = open_split(spec.source)
        self.img_size, self.augment = spec.img_size, spec.augment
        self.hyp = spec.hyp if spec.hyp is not None else Hyp()
        self.rect, self.stride, self.pad, self.seed = spec.rect, spec.stride, spec.pad, spec.seed
        where = self.source.where
        with watchdog.phase("scan", f"{prefix}{where}"):  # the scan beats per file
            scan = self.source.scan(spec.nc, cache_dir)
        result, self.cache_hit = scan.result, bool(scan.known)
        c, split = result.counts, prefix.strip(" :") or "split"
        if verbose:
            report = write_problem_report(result.msgs, report_dir, split, where) if report_dir else None
            report_messages(result.msgs, prefix, report)
            LOGGER.info(f"{prefix}Scanning {where}... {c['images']} images, {c['backgrounds']} backgrounds, "
                        f"{c['corrupt']} corrupt{scan.known}")
            LOGGER.info(format_summary(c, split))
        require_usable(result, where)
        check_label_presence(result, where, role, prefix, verbose)
        # a column of paths (a scan's list, a shard index's over its mapped arrays), reordered by take
        self.im_files = result.img_files
        # float64 as written (evaluation and ground_truth.json); augmentation takes float32 copies
        self.labels = LabelTable.of(result.labels)
        if spec.single_cls:
            self.labels = self.labels.with_class(0)
        self.image_hw = np.asarray(result.image_hw, dtype=np.int32).reshape(-1, 2)
        self.rows = np.arange(len(self.im_files))  # each sample's row in the shard index (rect reorders them)
        self.counts, self.msgs = dict(c), list(result.msgs)
        self.batch_index = np.arange(len(self.im_files)) // batch_size
        self.batch_shapes: np.ndarray | None = None
        self.imgcache = None  # yolotrain.utils.data.imgcache.ImageCache when --cache ram|disk (attach_image_cache)
        self.memory = memory or BatchMemory()  # where batches are written
        self.render_on_device = render_on_device and spec.augment  # the training device draws the pixels
        self._scratch, self._loaded_hw = Scratch(), None
        if spec.rect:
            self._set_rect_shapes(batch_size)

    def _set_rect_shapes(self, batch_size: int) -> None:
        """Sort by aspect ratio and give each batch the smallest stride-multiple shape that fits it."""
        ar = self.image_hw[:, 0] / self.image_hw[:, 1]  # h / w
        order = ar.argsort(kind="stable")
        self.im_files, self.labels = self.im_files.take(order), self.labels.take(order)
        self.image_hw, self.rows, ar = self.image_hw[order], self.rows[order], ar[order]
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
        cached = self.imgcache.get(i) if self.imgcache is not None else None  # byte-identical to the path below
        if cached is not None:
            return cached
        img = self.read_original(i)
        return resize_long_side(img, self.img_size, self.augment), img.shape[:2]

    def read_original(self, i: int) -> np.ndarray:
        """Image ``i`` decoded, as the scan decoded it (EXIF, alpha, 16-bit, CMYK, truncation), by its source."""
        return self.source.read(int(self.rows[i]))

    def attach_image_cache(self, cache) -> None:
        """--cache ram|disk: the decoded images, built over this dataset's final order (after rect's sort)."""
        self.imgcache = cache

    def plan_inputs(self) -> PlanInputs:
        """What planning reads of this dataset (its arrays, not copies)."""
        return PlanInputs(img_size=self.img_size, augment=self.augment, hyp=self.hyp, loaded_hw=self.loaded_hw,
                          orig_hw=self.image_hw, labels=self.labels,
                          batch_shapes=self.batch_shapes if self.rect else None, batch_index=self.batch_index)

    @property
    def loaded_hw(self) -> np.ndarray:
        """(n, 2) each image's size as ``load_image`` returns it (long side img_size)."""
        if self._loaded_hw is None:
            self._loaded_hw = resized_hw_all(self.image_hw, self.img_size)
        return self._loaded_hw

    def mosaic_enabled(self, key: SampleKey) -> bool:
        """Mosaic is used for augmented square training while the key allows it (close_mosaic).

        Rectangular training keeps each image's aspect ratio, which a square mosaic would undo.
        """
        return self.augment and not self.rect and key.mosaic

    def plan(self, item: int | tuple, inputs: PlanInputs | None = None) -> SamplePlan:
        """Sample ``item``'s plan (an index, or a ``SampleKey`` (epoch, index, mosaic, pool))."""
        key = SampleKey(*item) if isinstance(item, tuple) else SampleKey(0, item)
        rng = np.random.default_rng([self.seed, int(key.epoch), int(key.index)])
        return plan_sample(inputs or self.plan_inputs(), rng, int(key.index), self.mosaic_enabled(key),
                           key.pool if key.pool else None)

    def __getitem__(self, item: int | tuple) -> Sample:
        plan = self.plan(item)
        out = np.empty((*plan.out_hw, 3), np.uint8)
        render(plan, TileSource(self.load_image_only), out, self._scratch)
        labels_out = torch.zeros((len(plan.labels), 6))
        if len(plan.labels):
            labels_out[:, 1:] = torch.from_numpy(plan.labels)
        return torch.from_numpy(out).permute(2, 0, 1), labels_out, self.im_files[plan.index], plan.placement, plan.index

    def __getitems__(self, items: list) -> Batch:
        """A whole batch: every image it needs read once, each sample drawn straight into the batch's
        memory (or, with ``render_on_device``, its tiles and plans packed for the training device)."""
        inputs = self.plan_inputs()
        plans = [self.plan(item, inputs) for item in items]
        tiles = TileSource(self.load_image_only)
        common = dict(targets=batch_targets(plans), paths=tuple(self.im_files[p.index] for p in plans),
                      placements=tuple(p.placement for p in plans),
                      indices=torch.tensor([p.index for p in plans], dtype=torch.long),
                      pin_in_place=self.memory.pin_in_place)
        if self.render_on_device:
            return Batch(images=None, deferred=pack(plans, tiles, self.memory), **common)
        h, w = plans[0].out_hw
        if any(p.out_hw != (h, w) for p in plans):
            raise ValueError(f"samples of one batch differ in size: {sorted({p.out_hw for p in plans})}")
        images = self.memory.take(len(plans) * h * w * 3).view(len(plans), h, w, 3)
        pixels = images.numpy()
        for k, plan in enumerate(plans):
            render(plan, tiles, pixels[k], self._scratch)
        return Batch(images=images.permute(0, 3, 1, 2), **common)

    def load_image_only(self, i: int) -> np.ndarray:
        """``load_image`` without the original size (what rendering needs)."""
        return self.load_image(i)[0]
