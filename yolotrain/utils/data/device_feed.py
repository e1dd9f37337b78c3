"""Batches with their images on the training device, float in [0, 1] in the run's memory format.

``DeviceFeed`` hands the training loop one batch at a time. The loop calls ``ahead()`` once the current
step's forward and backward are queued: the next batch is then fetched from the loader and its
host-to-device copy (and, --augment-on device, its drawing) queued while the device still runs this
step's work, so the loop's host time for the next batch overlaps the device's time instead of following
its one sync per step. On CUDA that work runs on a side stream: the training stream waits only for the
batch's own event, and the images are marked as used by it so the allocator never hands their memory
back early. A CUDA run's loader page-locks its reused batch buffers in place (utils/data/pinning.py), so
the copy reads the worker's buffer itself: before asking the loader for a batch, the feed waits until
the copy of the batch before last is done, and a worker, which writes into a buffer only once the batch
that held it is two behind, never overwrites pixels still being copied. Elsewhere each batch is
prepared on the one stream: the same operations, so the pixels are identical either way.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from yolotrain.utils.data.batch import Batch
from yolotrain.utils.data.device_augment import render_batch


@dataclass(frozen=True)
class OnDevice:
    """A loader batch and its images on the training device."""

    batch: Batch
    images: torch.Tensor  # float (B, 3, H, W) in [0, 1], the run's memory format


def batch_images(batch: Batch, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
    """The loader's uint8 pixels as float 0-1 on ``device``, or (--augment-on device) the pixels the device
    draws from the batch's tiles and plans."""
    if batch.deferred is not None:
        imgs = render_batch(batch.deferred, device)
    else:
        imgs = batch.images.to(device, non_blocking=True).float().div_(255)
    return imgs.contiguous(memory_format=memory_format)


@dataclass(frozen=True)
class _Prepared:
    batch: Batch
    images: torch.Tensor
    ready: torch.cuda.Event | None  # CUDA: recorded on the side stream after the batch's copy and drawing


class DeviceFeed(Iterator[OnDevice]):
    """The loader's batches as ``OnDevice``, each prepared when ``ahead()`` asks for it (or, at the latest,
    when it is taken). One batch is prepared ahead at most: the device holds the images of the batch in
    training and of the next one, never more."""

    def __init__(self, batches: Iterable[Batch], device: torch.device, memory_format: torch.memory_format) -> None:
        self._batches = iter(batches)
        self.device, self.memory_format = device, memory_format
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: _Prepared | None = None
        self._ended = False
        self._handed: deque[torch.cuda.Event] = deque(maxlen=2)  # the last two batches' copy events

    def ahead(self) -> None:
        """Fetch the next batch and queue its copy (and drawing) now, unless that is done or the loader ended."""
        if self._next is not None or self._ended:
            return
        if len(self._handed) == self._handed.maxlen:
            self._handed[0].synchronize()  # the batch before last's buffer may be written again once we ask
        batch = next(self._batches, None)
        if batch is None:
            self._ended = True
            return
        if self._side is None:
            self._next = _Prepared(batch, batch_images(batch, self.device, self.memory_format), None)
            return
        with torch.cuda.stream(self._side):
            imgs = batch_images(batch, self.device, self.memory_format)
            ready = torch.cuda.Event()
            ready.record(self._side)
        self._next = _Prepared(batch, imgs, ready)

    def __next__(self) -> OnDevice:
        self.ahead()
        item, self._next = self._next, None
        if item is None:
            raise StopIteration
        if item.ready is not None:  # the training stream waits for the side stream's work on this batch
            main = torch.cuda.current_stream(self.device)
            main.wait_event(item.ready)
            item.images.record_stream(main)
            self._handed.append(item.ready)
        return OnDevice(item.batch, item.images)
