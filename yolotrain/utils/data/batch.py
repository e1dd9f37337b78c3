"""A batch as the loader hands it over, and the memory it is written into.

A loader worker writes each batch's pixels straight into shared memory, so the batch reaches the training
process without a copy; when the consumer lets go of each batch before it asks for the next but one (the
training loop, or a loader that pins every batch into its own page-locked copy), the worker reuses a
small ring of buffers instead of allocating, and page-faulting, fresh memory for every batch.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import get_worker_info

from yolotrain.utils.data.geometry import Placement
from yolotrain.utils.data.pinning import PAGE_LOCKS
from yolotrain.utils.data.plan import SamplePlan


class DeferredImages(NamedTuple):
    """A batch whose pixels the training device draws (utils/data/device_augment.py): every distinct tile
    image once, and each sample's plan as numbers. A NamedTuple, so the DataLoader pins its tensors."""

    tiles: torch.Tensor  # uint8 (N,): the tiles' BGR pixels back to back
    table: torch.Tensor  # int64 (T, 3): each tile's first pixel, h, w
    composites: torch.Tensor  # float64 (C, COMPOSITE_COLUMNS): canvas, flips, inverse matrix, tile slots
    samples: torch.Tensor  # float64 (B, SAMPLE_COLUMNS): composites, mixup ratio, HSV on
    luts: torch.Tensor  # uint8 (B, 3, 256): each sample's hue, saturation and value lookups
    out_hw: tuple[int, int]


class Batch(NamedTuple):
    """One collated batch. targets rows are [image index in batch, cls, xc, yc, w, h] normalised.

    ``images`` is a (B, 3, H, W) view of (B, H, W, 3) memory (channels_last strides): the loader writes
    each image in the order OpenCV produces it. When the training device renders the batch, ``images`` is
    None and ``deferred`` holds the tiles and plans instead. ``pin_in_place``: the pixels lie in a reused
    buffer whose consumer lets go of each batch in time (BatchMemory.pin_in_place).
    """

    images: torch.Tensor | None  # uint8 (B, 3, H, W) RGB
    targets: torch.Tensor  # float32 (N, 6)
    paths: tuple[str, ...]
    placements: tuple[Placement | None, ...]  # where each original image lies in ``images``; None for a mosaic
    indices: torch.Tensor  # int64 (B,) dataset indices
    deferred: DeferredImages | None = None
    pin_in_place: bool = False

    @property
    def size(self) -> int:
        """Images in the batch."""
        return len(self.indices)

    def pin_memory(self) -> Batch:
        """The DataLoader's pinning (a CUDA run): the pixels' reused buffer page-locked where it lies when
        ``pin_in_place`` (then ``pin_memory()`` returns the pixels as they are), every other tensor copied
        into page-locked memory."""
        if self.pin_in_place:
            PAGE_LOCKS.lock(self.images if self.deferred is None else self.deferred.tiles)
        deferred = self.deferred
        if deferred is not None:
            deferred = deferred._replace(tiles=deferred.tiles.pin_memory(), table=deferred.table.pin_memory(),
                                         composites=deferred.composites.pin_memory(),
                                         samples=deferred.samples.pin_memory(), luts=deferred.luts.pin_memory())
        return self._replace(images=None if self.images is None else self.images.pin_memory(),
                             targets=self.targets.pin_memory(), indices=self.indices.pin_memory(), deferred=deferred)


def collate_fn(batch: Batch) -> Batch:
    """The DataLoader's collate step: the dataset builds whole batches (``__getitems__``), handed over as
    they are."""
    return batch


def batch_targets(plans: list[SamplePlan]) -> torch.Tensor:
    """Every plan's labels as target rows [k, cls, xc, yc, w, h] (float32)."""
    rows = [np.concatenate((np.full((len(p.labels), 1), k, np.float32), p.labels.astype(np.float32)), 1)
            for k, p in enumerate(plans)]
    return torch.from_numpy(np.concatenate(rows, 0) if rows else np.zeros((0, 6), np.float32))


GROWTH = 4  # a slot outgrown grows by a quarter more than asked: tile bytes vary from batch to batch, and each
# new buffer is a new allocation (and, pinned in place, a new page-lock)


class BatchMemory:
    """Where a loader process writes its batches' pixels: a ring of ``slots`` reused buffers when ``reuse``,
    else fresh memory per batch. Inside a DataLoader worker the memory is shared with the training process.
    Each process keeps its own ring (a forked worker never writes into memory its parent may still read).
    ``pin_in_place``: the consumer lets go of each batch before asking for the next but one, and of its
    copy to the device before the next but one arrives, so pinning may lock the ring's buffers in place."""

    def __init__(self, reuse: bool = False, slots: int = 4, pin_in_place: bool = False) -> None:
        self.reuse, self.slots, self.pin_in_place = reuse, slots, pin_in_place and reuse
        self._pid, self._ring, self._next = -1, [], 0

    def __getstate__(self) -> dict:  # a spawned worker starts with its own, empty ring
        return {"reuse": self.reuse, "slots": self.slots, "pin_in_place": self.pin_in_place,
                "_pid": -1, "_ring": [], "_next": 0}

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` to write one batch into."""
        shared = get_worker_info() is not None
        if not self.reuse:
            return _allocate(nbytes, shared)
        if self._pid != os.getpid():
            self._pid, self._ring, self._next = os.getpid(), [], 0
        k = self._next
        self._next = (k + 1) % self.slots
        if k == len(self._ring):
            self._ring.append(_allocate(nbytes, shared))
        elif self._ring[k].numel() < nbytes:  # a larger batch (rect shapes, the device path's tiles): grow
            self._ring[k] = _allocate(nbytes + nbytes // GROWTH, shared)
        return self._ring[k][:nbytes]


def _allocate(nbytes: int, shared: bool) -> torch.Tensor:
    """Fresh uint8 memory: shared (a file descriptor the training process maps) inside a worker."""
    if shared:
        return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))
    return torch.empty(nbytes, dtype=torch.uint8)
