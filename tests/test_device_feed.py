"""utils/data/device_feed.py: each batch arrives with its own images, in order, whatever the device
(CUDA draws the next batch on a side stream; the pixels must be the ones drawn inline)."""
from __future__ import annotations

import pytest
import torch

from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.data.device_feed import DeviceFeed, batch_images
from yolotrain.utils.data.loader import create_dataloader

HYP = Hyp(hsv_h=0.015, hsv_s=0.7, hsv_v=0.4, fliplr=0.5, flipud=0.1, mosaic=1.0, mixup=0.3,
          degrees=10.0, translate=0.1, scale=0.5, shear=2.0, perspective=0.0)


@pytest.fixture(scope="module")
def shapes(shapes_dataset):
    return shapes_dataset(seed=5, n_train=24, n_val=0, img_size=96) / "images" / "train"


def _batches(shapes, on_device_path: bool, pin: bool = False) -> list:
    loader = create_dataloader(shapes, 96, 8, 32, hyp=HYP, augment=True, shuffle=True, workers=0, seed=1, nc=6,
                               render_on_device=on_device_path, pin_memory=pin)
    loader.sampler.set_epoch(1)
    return list(loader)


@pytest.mark.parametrize("path", ["workers", "device"])
@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_each_batch_arrives_with_its_own_images(shapes, path, memory_format):
    batches = _batches(shapes, path == "device")
    cpu = torch.device("cpu")
    fed = list(DeviceFeed(iter(batches), cpu, memory_format))
    assert [f.batch.indices.tolist() for f in fed] == [b.indices.tolist() for b in batches]
    for f, b in zip(fed, batches):
        expected = batch_images(b, cpu, memory_format)
        assert f.images.dtype == torch.float32 and f.images.shape == (b.size, 3, 96, 96)
        assert f.images.is_contiguous(memory_format=memory_format)
        assert torch.equal(f.images, expected) and 0 <= float(f.images.min()) and float(f.images.max()) <= 1


class _Counted:
    """The loader's batches, counting how many were asked for."""

    def __init__(self, batches: list) -> None:
        self.batches, self.asked = batches, 0

    def __iter__(self):
        for b in self.batches:
            self.asked += 1
            yield b


@pytest.mark.parametrize("path", ["workers", "device"])
def test_ahead_fetches_the_next_batch_once_and_changes_nothing(shapes, path):
    """ahead() takes the next batch from the loader during a step: once however often it is called, never
    past the end, and every batch arrives with the images it would have without it."""
    batches = _batches(shapes, path == "device")
    cpu = torch.device("cpu")
    plain = list(DeviceFeed(iter(batches), cpu, torch.channels_last))
    loader = _Counted(batches)
    feed = DeviceFeed(loader, cpu, torch.channels_last)
    seen = []
    for k, f in enumerate(feed):
        assert loader.asked == k + 1
        feed.ahead()
        feed.ahead()
        assert loader.asked == min(k + 2, len(batches))
        seen.append(f)
    feed.ahead()
    assert loader.asked == len(batches) == len(seen) == len(plain)
    for a, b in zip(seen, plain):
        assert a.batch.indices.tolist() == b.batch.indices.tolist() and torch.equal(a.images, b.images)


def test_the_device_path_images_are_the_loaders_pixels(shapes):
    """The workers path's images are its uint8 pixels / 255, exactly."""
    batch = _batches(shapes, False)[0]
    img = batch_images(batch, torch.device("cpu"), torch.channels_last)
    assert torch.equal(img * 255, batch.images.float())


def test_an_empty_loader_feeds_nothing():
    feed = DeviceFeed(iter([]), torch.device("cpu"), torch.channels_last)
    feed.ahead()
    assert list(feed) == []


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["workers", "device"])
def test_the_side_stream_feeds_what_the_inline_path_draws(shapes, path):
    """On CUDA, one batch ahead on a side stream: the same images, in order, as drawn inline, ready for the
    training stream (read there while the side stream draws the next)."""
    batches = _batches(shapes, path == "device", pin=True)
    gpu = torch.device("cuda", 0)
    inline = [batch_images(b, gpu, torch.channels_last).cpu() for b in batches]
    seen = []
    feed = DeviceFeed(iter(batches), gpu, torch.channels_last)
    for f in feed:
        assert f.images.device.type == "cuda"
        feed.ahead()  # as the training loop asks: the next batch drawn while this one is read
        seen.append((f.images * 1).cpu())  # a kernel on the training stream reads it
    assert len(seen) == len(inline)
    for a, b in zip(seen, inline):
        assert torch.equal(a, b)
