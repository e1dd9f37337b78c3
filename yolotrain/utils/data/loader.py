"""Samplers, batch collation and the DataLoader factory.

Training: a seeded permutation per epoch, padded and sharded by rank; each sample carries its
epoch so augmentation is seeded per sample. Evaluation: contiguous, batch-aligned shards with
no padding, so every image is scored exactly once and rectangular batches match across ranks.
"""
from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterator

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from yolotrain.utils.core.cpu import release_inherited_heap, tune_malloc, usable_cpus
from yolotrain.utils.core.dist import BatchSplit, DistInfo, batch_split, torch_distributed_zero_first
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.batch import Batch, BatchMemory, collate_fn  # noqa: F401 - Batch: the loaders' item type
from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels, SampleKey
from yolotrain.utils.data.imgcache import build_or_open, loader_shm_bytes


PREFETCH = 2  # batches each worker prepares ahead (the DataLoader's prefetch_factor)
SLOTS = PREFETCH + 2  # reused batch buffers per loader process: the prefetched ones, the one in use, one spare
MOSAIC_POOL = 16  # images per mosaic pool: a divisor of the usual per-rank batch sizes (16, 32, 64, ...)


class TrainSampler(Sampler):
    """Per-epoch seeded permutation, padded (or cut) to a multiple of world size; each global batch (``batch``: a
    ``BatchSplit``) is cut into one contiguous block per rank, its per-rank share.

    Yields ``SampleKey(epoch, index, mosaic, pool)`` so the dataset seeds augmentation from the sample, not
    the worker, and follows close_mosaic (``mosaic_off_from_epoch``, read here in the main process). ``pool``
    holds the other images of the sample's block of ``pool`` consecutive places in the permutation: a
    mosaic takes its partners there, so when the per-rank batch is a multiple of ``pool`` every partner is
    an image the same batch reads anyway (one image read per sample instead of four). The pool depends on
    the place in the permutation only, so a sample is the same for any world size.
    Call ``set_epoch`` before each epoch, as with DistributedSampler; ``skip`` starts the epoch part-way (a
    resumed mid-epoch checkpoint), at the same samples the uninterrupted run reaches.
    """

    def __init__(self, dataset_len: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False, batch: BatchSplit | None = None,
                 pool: int = MOSAIC_POOL) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        batch = batch or BatchSplit(world_size, world_size)  # one image per rank
        if batch.world_size != world_size or batch.per_rank < 1:
            raise ValueError(f"a batch of {batch.global_batch} over {batch.world_size} rank(s) for {world_size}")
        self.n, self.rank, self.world_size, self.seed = dataset_len, rank, world_size, seed
        self.shuffle, self.drop_last, self.epoch, self.skip = shuffle, drop_last, 0, 0
        self.batch, self.pool = batch, int(pool)
        self.mosaic_off_from_epoch: int | None = None  # close_mosaic: no mosaic from this epoch on
        self.num_samples = dataset_len // world_size if drop_last else math.ceil(dataset_len / world_size)
        self.total_size = self.num_samples * world_size

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's permutation; skip this rank's first ``skip`` samples of it."""
        if not 0 <= skip <= self.num_samples:
            raise ValueError(f"skip {skip} outside 0..{self.num_samples}")
        self.epoch, self.skip = int(epoch), int(skip)

    def close_mosaic_from(self, epoch: int) -> None:
        """close_mosaic: train without mosaic from ``epoch`` on (the build sets it; --time moves it)."""
        self.mosaic_off_from_epoch = int(epoch)

    def state_dict(self) -> dict[str, int | None]:
        return {"mosaic_off_from_epoch": self.mosaic_off_from_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.mosaic_off_from_epoch = state["mosaic_off_from_epoch"]

    def permutation(self) -> np.ndarray:
        """This epoch's order of the dataset (unpadded)."""
        if not self.shuffle:
            return np.arange(self.n)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).numpy()

    def positions(self) -> np.ndarray:
        """This rank's places in the padded order: its block of each global batch (the last one, shorter, split
        evenly: each rank's share is what is left of its ``num_samples``)."""
        k, share = np.arange(self.num_samples), self.batch.per_rank
        batch, within = k // share, k % share
        size = np.minimum(share, self.num_samples - batch * share)  # this rank's block of that batch
        return batch * self.batch.global_batch + self.rank * size + within

    def __iter__(self) -> Iterator[SampleKey]:
        """The epoch's order is array work; each key is made as the loader asks for it (a split of millions
        starts its epoch without a Python step per sample)."""
        epoch, off = self.epoch, self.mosaic_off_from_epoch
        mosaic = off is None or epoch < off
        if not self.n:
            return iter(())
        perm = self.permutation()
        places = (self.positions()[self.skip:] % self.n).tolist()
        if not (mosaic and self.pool > 1):
            return (SampleKey(epoch, int(perm[q]), mosaic) for q in places)
        return (SampleKey(epoch, int(perm[q]), mosaic, self._pool(perm, q)) for q in places)

    def _pool(self, perm: np.ndarray, q: int) -> tuple[int, ...]:
        """The mosaic pool of place ``q`` of the permutation: the other images of its block of ``pool`` places
        (a padded place has its original's; the last block is the permutation's last ``pool``), made when the
        key is."""
        size = min(self.pool, self.n)
        start = min(q // size * size, self.n - size)
        return tuple(perm[start:start + size][np.arange(size) != q - start].tolist())

    def __len__(self) -> int:
        return self.num_samples - self.skip


class InferenceSampler(Sampler):
    """Contiguous, batch-aligned shard per rank, no padding: every index exactly once across ranks."""

    def __init__(self, size: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        nb = math.ceil(size / batch_size)
        first, last = rank * nb // world_size, (rank + 1) * nb // world_size
        self.start, self.stop = min(first * batch_size, size), min(last * batch_size, size)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def _worker_init(_worker_id: int) -> None:
    """One thread per worker: the workers are the parallelism (randomness is seeded per sample).

    cv2.setNumThreads is deliberately not called here: in a forked worker, after the parent used
    OpenCV's thread pool, it can deadlock (seen here in test_workers_do_not_change_batches).

    Stop signals are the main process's business (utils/engine/preempt.py), which still needs its
    loader for the step it finishes: a worker leaves the rank's process group, so the SIGTERM that
    torchrun (or a shell) sends to the group does not kill it mid-step, and it ignores SIGUSR1
    (SLURM's warning signal reaches every process of the job). The DataLoader's own shutdown
    terminates its workers by pid, as usual.
    """
    torch.set_num_threads(1)
    release_inherited_heap()  # the parent's freed blocks: reusing them here would copy each page on first write
    tune_malloc()  # a worker's per-sample arrays (decoded images, warp and colour buffers) reuse the heap
    os.setpgid(0, 0)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def worker_share(batch_size: int, workers: int) -> int:
    """The part of an evaluation batch one worker loads: a divisor of the batch (a part never spans two rect
    batches of different shapes), at most the batch over the workers. A validation pass of a few large
    batches (500 images at 128) otherwise keeps one worker per batch busy while the rest idle, and the
    device waits for a whole batch to be letterboxed by one core."""
    if workers < 2:
        return batch_size
    most = math.ceil(batch_size / workers)
    return max(d for d in range(1, most + 1) if batch_size % d == 0)


def pins_by_default() -> bool:
    """Pin batches only in a process that already uses CUDA (select_device set its GPU): pinning opens a CUDA
    context, on GPU 0, which a --device cpu run on a GPU host must not do in every rank."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _dataset_once(info: DistInfo, cache_dir: Path | None,
                  build: Callable[[], LoadImagesAndLabels]) -> LoadImagesAndLabels:
    """``build()`` on every rank, the split scanned once per job: global rank 0 first (on a shared filesystem its
    label cache then serves every node), then each node's local rank 0 (a cache hit, or its own scan where the
    nodes do not share the folder), then the rest. With a --cache-dir (node-local disk) each node's local rank 0
    goes first, in one stage. A UserError comes from the files, so every rank reaches it and names it itself."""
    stages = [info.local_rank]
    if cache_dir is None and info.world_size > info.local_world_size:
        stages.insert(0, info.rank)
    dataset, error = None, None
    for k, first in enumerate(stages):
        with torch_distributed_zero_first(first):
            if dataset is None and error is None and (first == 0 or k == len(stages) - 1):
                try:
                    dataset = build()
                except UserError as e:
                    error = e
    if error is not None:
        raise error
    return dataset


@dataclass(frozen=True)
class LoaderSpec:
    """Everything a loader is built from, in one typed value (``build_loader``): ``data``, what is loaded (the split,
    its size, classes and augmentation: ``DatasetSpec``); ``batch``, the global batch and its share on each of
    ``info``'s ranks (``dist.batch_split``); the rest, how it is loaded and where its problems are written.

    ``training`` marks a training loader (TrainSampler, equal batch count on every rank, a split without any label
    is an error); otherwise evaluation (InferenceSampler; no labels is a warning). ``report_dir``: the run folder,
    where rank 0 writes the full list of the split's problems. ``pin_memory``: page-locked batches for CUDA; by
    default only once this process uses CUDA (``pins_by_default``). ``reuse_memory``: the consumer lets go of each
    batch, and of its copy to the device, before it asks for the next but one (the training loop and evaluation
    do), so the loader writes batches into a ring of reused buffers, which pinning locks in place
    (utils/data/pinning.py); without it pinned batches are copies, so they reuse the ring anyway.
    ``render_on_device``: batches carry tiles and plans for utils/data/device_augment.py instead of pixels.
    ``split_batches`` (evaluation; by default where batches are pinned, a CUDA process, whose inference is cheap
    beside the letterboxing): each batch arrives in parts of ``worker_share`` images, so every worker loads at
    once."""

    data: DatasetSpec
    batch: BatchSplit
    training: bool = False
    info: DistInfo = DistInfo()
    workers: int = 8
    cache: str | None = None
    cache_dir: Path | None = None
    prefix: str = ""
    report_dir: Path | None = None
    pin_memory: bool | None = None
    reuse_memory: bool = False
    render_on_device: bool = False
    split_batches: bool | None = None


def build_loader(spec: LoaderSpec) -> DataLoader:
    """The DataLoader for this process's place in the job (``spec.info``): the dataset (its source scanned once
    per job, ``_dataset_once``), its image cache, the sampler, the workers."""
    info, data, rect, shuffle = spec.info, spec.data, spec.data.rect, spec.training
    if spec.batch.world_size != info.world_size:
        raise ValueError(f"a batch split over {spec.batch.world_size} rank(s) for a job of {info.world_size}")
    if rect and shuffle:
        LOGGER.warning("WARNING: --rect is incompatible with shuffling, setting shuffle=False")
        shuffle = False
    # Rectangle shapes are shared across a global batch: a training batch is cut into one block per rank
    # (with drop_last no padded index from another batch lands in a rank's last batch), and an evaluation
    # shard's per-rank batches are aligned to it, so each image is letterboxed to the same shape whatever
    # the world size.
    ranks_here = info.local_world_size if info.world_size > 1 else 1  # share this node's cores, not the job's
    pin = pins_by_default() if spec.pin_memory is None else spec.pin_memory
    memory = BatchMemory(reuse=spec.reuse_memory or pin, slots=SLOTS, pin_in_place=spec.reuse_memory)
    dataset = _dataset_once(info, spec.cache_dir, lambda: LoadImagesAndLabels(
        data, spec.batch.global_batch, cache_dir=spec.cache_dir, prefix=spec.prefix, verbose=info.rank == 0,
        role="train" if spec.training else "val", report_dir=spec.report_dir, memory=memory,
        render_on_device=spec.render_on_device))
    batch_size = min(spec.batch.per_rank, len(dataset))
    nw = min(usable_cpus() // max(ranks_here, 1), batch_size if batch_size > 1 else 0, spec.workers)
    if spec.cache:  # after the block above: build_or_open runs its own zero-first, in final im_files order
        dataset.attach_image_cache(build_or_open(
            dataset.im_files, data.img_size, data.augment, spec.cache,
            dataset.source.cache_source(dataset.rows, spec.cache_dir, dataset.read_original),
            local_rank=info.local_rank, image_hw=dataset.image_hw, prefix=spec.prefix,
            workers_shm=loader_shm_bytes(ranks_here, nw, batch_size, data.img_size, SLOTS)))
    if spec.training:
        sampler: Sampler = TrainSampler(len(dataset), info.rank, info.world_size, data.seed, shuffle=shuffle,
                                        drop_last=rect and info.world_size > 1, batch=spec.batch)
    else:
        sampler = InferenceSampler(len(dataset), batch_size, info.rank, info.world_size)
        if spec.split_batches if spec.split_batches is not None else pin:
            batch_size = worker_share(batch_size, nw)
    if nw > 0:
        cv2.setNumThreads(0)  # OpenCV's thread pool does not survive fork into workers; they are the parallelism
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=nw, pin_memory=pin,
                      collate_fn=collate_fn, persistent_workers=nw > 0, worker_init_fn=_worker_init if nw > 0 else None,
                      prefetch_factor=PREFETCH if nw > 0 else None)


DATASET_FIELDS = {f.name for f in fields(DatasetSpec)} - {"source", "img_size", "stride"}  # the keyword options


def create_dataloader(source: Any, imgsz: int, batch_size: int, stride: int, *, shuffle: bool = False,
                      **options: Any) -> DataLoader:
    """``build_loader`` in keyword form: ``batch_size`` is the global batch (over ``info``'s ranks), the options
    ``DatasetSpec``'s fields and ``LoaderSpec``'s, ``shuffle`` for ``training``."""
    what = {k: options.pop(k) for k in DATASET_FIELDS & options.keys()}
    data = DatasetSpec(source, img_size=imgsz, stride=stride, **what)
    info = options.get("info", DistInfo())
    return build_loader(LoaderSpec(data, batch_split(batch_size, info), training=shuffle, **options))
