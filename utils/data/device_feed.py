"""Batches with their images on the training device, float in [0, 1] in the run's memory format.

On CUDA the next batch's host-to-device copy and (--augment-on device) its drawing run on a side stream
while the model trains on the current one, so neither waits in the step: the training stream waits only
for that batch's own event, and the images are marked as used by it so the allocator never hands their
memory back early. A CUDA run's loader page-locks its reused batch buffers in place
(utils/data/pinning.py), so the copy reads the worker's buffer itself: before asking the loader for a
batch, the feed waits until the copy of the batch before last is done, and a worker, which writes into
a buffer only once the batch that held it is two behind, never overwrites pixels still being copied.
Elsewhere each batch is prepared when it is asked for: the same operations on the same stream, so the
pixels are identical either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from utils.data.batch import Batch
from utils.data.device_augment import render_batch


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


def on_device(batches: Iterable[Batch], device: torch.device,
              memory_format: torch.memory_format) -> Iterator[OnDevice]:
    """Each batch with its images on ``device``; on CUDA prepared one batch ahead on a side stream."""
    if device.type != "cuda":
        for batch in batches:
            yield OnDevice(batch, batch_images(batch, device, memory_format))
        return
    side = torch.cuda.Stream(device)
    pending: tuple[Batch, torch.Tensor, torch.cuda.Event] | None = None
    for batch in batches:
        with torch.cuda.stream(side):
            imgs = batch_images(batch, device, memory_format)
            ready = torch.cuda.Event()
            ready.record(side)
        if pending is not None:
            yield _handed_over(*pending, device)
            pending[2].synchronize()  # its host buffer may be written again once the next batch is asked for
        pending = batch, imgs, ready
    if pending is not None:
        yield _handed_over(*pending, device)


def _handed_over(batch: Batch, imgs: torch.Tensor, ready: torch.cuda.Event, device: torch.device) -> OnDevice:
    """The training stream waits for this batch's side-stream work, and the allocator learns it uses the images."""
    main = torch.cuda.current_stream(device)
    main.wait_event(ready)
    imgs.record_stream(main)
    return OnDevice(batch, imgs)
