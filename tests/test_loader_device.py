"""DataLoaders on GPU hosts: batches pinned only for a CUDA run (pinning opens a CUDA context on GPU 0),
and workers sized by the CPUs this process may use (its affinity), not by the machine's count."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import write_val_split
from yolotrain.utils.core import cpu
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.data.batch import BatchMemory
from yolotrain.utils.data.loader import create_dataloader, worker_share
from yolotrain.utils.data.pinning import PAGE_LOCKS, PageLocks
from yolotrain.utils.data.shapes import generate_shapes


@pytest.fixture
def split(tmp_path) -> Path:
    return write_val_split(tmp_path, 4, (24, 32), lambda k: 40 + k)


@pytest.mark.parametrize("initialized", [False, True])
def test_pinned_only_once_the_process_uses_cuda(split, monkeypatch, initialized):
    """A --device cpu run on a GPU host (CUDA available, never initialised) does not pin; a CUDA run does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    assert create_dataloader(split, 64, 2, 32, nc=1, workers=0).pin_memory is initialized
    assert create_dataloader(split, 64, 2, 32, nc=1, workers=0, pin_memory=False).pin_memory is False


def test_no_cuda_no_pinning(split, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert create_dataloader(split, 64, 2, 32, nc=1, workers=0).pin_memory is False


def test_usable_cpus_follow_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5}, raising=False)
    assert cpu.usable_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    assert cpu.usable_cpus() == 64


def test_workers_are_sized_by_the_affinity_mask(split, monkeypatch):
    """Two ranks on a node whose process may use 4 of 64 CPUs: 2 workers each, not 8."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    info = DistInfo(rank=0, local_rank=0, world_size=2, local_world_size=2)
    assert create_dataloader(split, 64, 4, 32, nc=1, workers=8, info=info).num_workers == 2



@pytest.mark.parametrize("reuse", [False, True])
def test_batches_are_pinned_in_place_only_where_the_consumer_lets_go(split, reuse):
    """Pinning may lock a batch's buffer where it lies only when the consumer promised to let go of each batch
    in time (reuse_memory); otherwise a pinned batch stays a copy. The promise reaches the workers."""
    loader = create_dataloader(split, 64, 2, 32, nc=1, workers=1, pin_memory=False, reuse_memory=reuse)
    assert loader.dataset.memory.pin_in_place is reuse
    assert all(b.pin_in_place is reuse for b in loader)  # written by the worker process
    assert BatchMemory(reuse=False, pin_in_place=True).pin_in_place is False  # fresh memory per batch: never


@pytest.mark.cuda
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("device_path", [False, True], ids=["workers-path", "device-path"])
def test_a_cuda_loader_pins_its_ring_in_place(tmp_path, workers, device_path):
    """A CUDA run's loader locks each reused buffer once and hands over batches in those same buffers (no copy
    per batch), holding the same pixels a copying loader gives. Three epochs: a slot that a larger batch
    outgrows (the device path's tile bytes vary) is a new buffer, so the count is bounded, not the slots'."""
    generate_shapes(tmp_path / "s", seed=3, n_train=48, n_val=0, img_size=96)
    train = tmp_path / "s" / "images" / "train"
    torch.cuda.init()

    def batches(reuse: bool) -> list:
        loader = create_dataloader(train, 96, 4, 32, hyp=Hyp(mosaic=1.0), augment=True, shuffle=True, nc=6,
                                   workers=workers, seed=1, pin_memory=True, reuse_memory=reuse,
                                   render_on_device=device_path)
        out = []
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            for b in loader:
                pixels = b.images if b.deferred is None else b.deferred.tiles
                assert pixels.is_pinned()
                out.append((pixels.untyped_storage().data_ptr(), pixels.clone()))  # cloned: the ring is reused
        return out

    copied, in_place = batches(False), batches(True)
    assert len(copied) == len(in_place) == 36
    for (_, a), (_, b) in zip(copied, in_place):
        assert torch.equal(a, b)
    buffers = {address for address, _ in in_place}
    assert len(buffers) <= 36 // 2  # buffers come round: far fewer than batches
    assert all(address in PAGE_LOCKS for address in buffers)


@pytest.mark.cuda
def test_page_locks_let_go_of_the_oldest_past_their_limit():
    torch.cuda.init()
    locks, buffers = PageLocks(limit=2), [torch.empty(1 << 16, dtype=torch.uint8) for _ in range(3)]
    for b in buffers:
        assert locks.lock(b) and b.is_pinned()
    assert locks.lock(buffers[1]) and len(locks) == 2
    assert not buffers[0].is_pinned() and buffers[1].is_pinned() and buffers[2].is_pinned()
    locks.release_all()
    assert len(locks) == 0 and not any(b.is_pinned() for b in buffers)


def test_worker_share_divides_the_batch_among_the_workers():
    assert [worker_share(128, w) for w in (0, 1, 2, 6, 8, 200)] == [128, 128, 64, 16, 16, 1]
    assert worker_share(100, 8) == 10 and worker_share(7, 2) == 1  # a divisor: a part never spans two rect batches


def test_an_evaluation_batch_split_among_workers_holds_the_same_images(tmp_path):
    """A CUDA evaluation loader hands each batch over in one part per worker: the same letterboxed pixels,
    indices and targets, in the same order, each part inside one rect batch's shape."""
    wide = write_val_split(tmp_path / "w", 6, (24, 64), lambda k: 30 + 10 * k)
    tall = write_val_split(tmp_path / "t", 6, (64, 24), lambda k: 100 + 10 * k)
    for src in (wide, tall):  # one split of both shapes
        for f in src.iterdir():
            (tmp_path / "all" / "images" / "val").mkdir(parents=True, exist_ok=True)
            (tmp_path / "all" / "labels" / "val").mkdir(parents=True, exist_ok=True)
            (tmp_path / "all" / "images" / "val" / f"{src.parent.parent.name}{f.name}").write_bytes(f.read_bytes())
            label = src.parent.parent / "labels" / "val" / f"{f.stem}.txt"
            (tmp_path / "all" / "labels" / "val" / f"{src.parent.parent.name}{f.stem}.txt").write_text(label.read_text())
    split = tmp_path / "all" / "images" / "val"

    def batches(parts: bool) -> list:
        loader = create_dataloader(split, 64, 6, 32, nc=1, workers=2, rect=True, pad=0.5, reuse_memory=True,
                                   pin_memory=False, split_batches=parts)
        return [(b.images.clone(), b.indices.clone(), b.targets.clone()) for b in loader]

    whole, parts = batches(False), batches(True)
    assert len(whole) == 2 and len(parts) == 4 and all(len(p[1]) == 3 for p in parts)
    for k, (images, indices, targets) in enumerate(whole):
        a, b = parts[2 * k], parts[2 * k + 1]
        assert torch.equal(torch.cat([a[0], b[0]]), images) and torch.equal(torch.cat([a[1], b[1]]), indices)
        b_targets = b[2].clone()
        b_targets[:, 0] += 3  # image index within the batch
        assert torch.equal(torch.cat([a[2], b_targets]), targets)
