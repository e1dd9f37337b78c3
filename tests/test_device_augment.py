"""Augmentation drawn on the training device (--augment-on device) against the loader's OpenCV path: the same
plans, so identical labels and images within interpolation rounding; batches that do not depend on worker
count; and the loader's pools, shared batch memory and one read per image."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import global_indices
from yolotrain.utils.core.dist import BatchSplit
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.data.batch import BatchMemory
from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels, SampleKey
from yolotrain.utils.data.device_augment import render_batch
from yolotrain.utils.data.loader import MOSAIC_POOL, TrainSampler, create_dataloader

FULL = Hyp(hsv_h=0.015, hsv_s=0.7, hsv_v=0.4, fliplr=0.5, flipud=0.1, mosaic=1.0, mixup=0.5,
           degrees=10.0, translate=0.1, scale=0.5, shear=2.0, perspective=0.0)
CASES = {
    "full": FULL,
    "perspective": dataclasses.replace(FULL, perspective=0.0005),
    "plain": dataclasses.replace(FULL, mosaic=0.0),
    "no-colour": dataclasses.replace(FULL, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0),
}


@pytest.fixture(scope="module")
def shapes(shapes_dataset) -> Path:
    return shapes_dataset(seed=2, n_train=40, n_val=0, img_size=96) / "images" / "train"


def _both(data: LoadImagesAndLabels, keys: list) -> tuple:
    """The batch from the loader's OpenCV path and from the device path (CPU tensors), same keys."""
    data.render_on_device = False
    cpu = data.__getitems__(keys)
    data.render_on_device = True
    dev = data.__getitems__(keys)
    data.render_on_device = False
    return cpu, dev, render_batch(dev.deferred, torch.device("cpu"))


def test_drawing_never_reads_the_device(shapes):
    """Every decision comes from the host's rows: drawn on the meta device (shapes, no data), a batch with
    mosaic, mixup, perspective and HSV comes out, as no data-dependent step on the device's tensors could."""
    hyp = dataclasses.replace(FULL, perspective=0.0005)
    data = LoadImagesAndLabels(DatasetSpec(shapes, nc=6, img_size=96, augment=True, hyp=hyp, seed=4), verbose=False)
    data.render_on_device = True
    batch = data.__getitems__([SampleKey(0, i, True, tuple(j for j in range(16) if j != i)) for i in range(12)])
    plan = batch.deferred.samples.numpy()
    assert (plan[:, 1] >= 0).any() and (plan[:, 3] > 0).any()  # some mixup, some HSV
    img = render_batch(batch.deferred, torch.device("meta"))
    assert img.device.type == "meta" and img.shape == (12, 3, 96, 96)


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_path_draws_what_the_loader_draws(shapes, case):
    data = LoadImagesAndLabels(DatasetSpec(shapes, nc=6, img_size=96, augment=True, hyp=CASES[case], seed=4),
                               verbose=False)
    keys = [SampleKey(e, i, True, tuple(j for j in range(16) if j != i)) for e in (0, 3) for i in range(12)]
    cpu, dev, img = _both(data, keys)
    assert dev.images is None and torch.equal(cpu.targets, dev.targets) and torch.equal(cpu.indices, dev.indices)
    assert img.dtype == torch.float32 and img.shape == cpu.images.shape and 0 <= img.min() and img.max() <= 1
    diff = (cpu.images.float() - img * 255).abs()
    # the same pixels but for the warp's rare roundings (OpenCV 5's float bilinear; its colour tables exactly)
    assert (diff > 0.5).float().mean() < 1e-3 and diff.mean() < 0.01, ((diff > 0.5).float().mean(), diff.mean())
    if case == "plain":
        assert all(p is not None for p in dev.placements)


def test_rect_letterbox_batches_render_alike(shapes):
    """Rectangular training (no mosaic, letterboxed to the batch shape) on the device path."""
    data = LoadImagesAndLabels(DatasetSpec(shapes, nc=6, img_size=96, augment=True, hyp=FULL, rect=True),
                               batch_size=4, verbose=False)
    cpu, dev, img = _both(data, [SampleKey(1, i) for i in range(4)])
    assert torch.equal(cpu.targets, dev.targets) and img.shape == cpu.images.shape
    assert (cpu.images.float() - img * 255).abs().mean() < 0.05


def test_device_batches_do_not_depend_on_workers(shapes):
    """Packs from 2 persistent workers over two epochs equal the in-process ones; so do their pictures."""
    def epochs(workers: int) -> list:
        loader = create_dataloader(shapes, 96, 8, 32, hyp=FULL, augment=True, shuffle=True, workers=workers, seed=3,
                                   nc=6, render_on_device=True, reuse_memory=True)
        out = []
        for e in (0, 1):
            loader.sampler.set_epoch(e)
            out += [(render_batch(b.deferred, torch.device("cpu")), b.targets) for b in loader]
        return out

    a, b = epochs(0), epochs(2)
    assert len(a) == len(b) == 10
    for (ia, ta), (ib, tb) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(ta, tb)


# ---------------------------------------------------------------- sampler: rank blocks and mosaic pools
def test_each_rank_takes_a_block_of_every_global_batch():
    n, per_rank = 45, 4
    for ws in (1, 2, 3):
        samplers = [TrainSampler(n, r, ws, seed=1, batch=BatchSplit(per_rank * ws, ws)) for r in range(ws)]
        for s in samplers:
            s.set_epoch(2)
        order = global_indices(samplers[0])
        g = per_rank * ws
        for r, s in enumerate(samplers):
            keys = [k.index for k in s]
            for j in range(0, len(keys), per_rank):  # batch j // per_rank is inside global batch j // per_rank
                block = order[j * ws:j * ws + g]
                assert set(keys[j:j + per_rank]) <= set(block)
        assert sorted(k.index for s in samplers for k in s) == sorted(order)


def test_pools_do_not_depend_on_the_world_size():
    """A sample's pool (and so its mosaic) is a function of its place in the epoch's order only."""
    n = 70
    seen: dict[int, dict] = {}
    for ws, per_rank in ((1, 32), (2, 16), (4, 8)):
        pools = {}
        for r in range(ws):
            s = TrainSampler(n, r, ws, seed=5, batch=BatchSplit(per_rank * ws, ws))
            s.set_epoch(1)
            pools.update({k.index: k.pool for k in s})
        seen[ws] = pools
    assert seen[1] == seen[2] == seen[4] and len(seen[1]) == n
    assert all(len(p) == MOSAIC_POOL - 1 and i not in p for i, p in seen[1].items())


def test_a_batch_reads_each_image_once(shapes, monkeypatch):
    """With the per-rank batch a multiple of the pool, every mosaic partner is in the batch: one read per sample."""
    hyp = dataclasses.replace(FULL, mixup=0.0)
    data = LoadImagesAndLabels(DatasetSpec(shapes, nc=6, img_size=96, augment=True, hyp=hyp), verbose=False)
    reads = []
    load = data.load_image
    monkeypatch.setattr(data, "load_image", lambda i: reads.append(i) or load(i))
    sampler = TrainSampler(len(data), batch=BatchSplit(16, 1))
    sampler.set_epoch(0)
    keys = list(sampler)[:16]
    batch = data.__getitems__(keys)
    assert sorted(reads) == sorted(k.index for k in keys) and batch.size == 16


def test_mosaics_take_partners_from_their_pool(shapes):
    data = LoadImagesAndLabels(DatasetSpec(shapes, nc=6, img_size=96, augment=True, hyp=FULL), verbose=False)
    pool = (3, 5, 7, 11)
    for e in range(4):
        plan = data.plan(SampleKey(e, 0, True, pool))
        used = {t.image for c in plan.composites for t in c.tiles}
        assert used <= {0, *pool} and 0 in used


# ---------------------------------------------------------------- batch memory
def test_reused_memory_comes_round_after_its_slots():
    memory = BatchMemory(reuse=True, slots=3)
    first = [memory.take(100).data_ptr() for _ in range(3)]
    assert len(set(first)) == 3 and [memory.take(100).data_ptr() for _ in range(3)] == first
    grown = memory.take(200)  # a larger batch grows its slot, with room for a larger one still
    assert grown.numel() == 200 and grown.data_ptr() != first[0]
    memory.take(100), memory.take(100)
    assert memory.take(240).data_ptr() == grown.data_ptr()  # in the room left: no new buffer
    fresh = BatchMemory(reuse=False)
    a, b = fresh.take(10), fresh.take(10)
    assert a.data_ptr() != b.data_ptr()  # every batch its own memory: a consumer may keep them all


def test_worker_batches_arrive_in_shared_memory_unchanged(shapes):
    """Reused shared-memory buffers from 2 workers: the same bytes as the in-process loader, batch after batch."""
    def run(workers: int) -> list:
        loader = create_dataloader(shapes, 96, 4, 32, hyp=FULL, augment=True, shuffle=True, workers=workers, seed=1,
                                   nc=6, reuse_memory=True)
        loader.sampler.set_epoch(0)
        return [(b.images.numpy().tobytes(), b.images.is_shared() if workers else None) for b in loader]

    zero, two = run(0), run(2)
    assert [z[0] for z in zero] == [t[0] for t in two] and all(t[1] for t in two)
    assert len(zero) == 10 and np.frombuffer(zero[0][0], np.uint8).size == 4 * 3 * 96 * 96



# ---------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_cuda_draws_what_the_cpu_draws(shapes):
    """The same packed batch drawn on CUDA and on CPU tensors: the same images but for float rounding."""
    data = LoadImagesAndLabels(DatasetSpec(shapes, nc=6, img_size=96, augment=True, hyp=CASES["perspective"], seed=4),
                               verbose=False)
    data.render_on_device = True
    batch = data.__getitems__([SampleKey(1, i, True, tuple(j for j in range(16) if j != i)) for i in range(16)])
    cpu = render_batch(batch.deferred, torch.device("cpu"))
    gpu = render_batch(batch.deferred, torch.device("cuda", 0))
    assert gpu.device.type == "cuda" and gpu.is_contiguous(memory_format=torch.channels_last)
    diff = (cpu - gpu.cpu()).abs() * 255
    assert diff.max() <= 2 and (diff > 0.5).float().mean() < 1e-3, (diff.max(), (diff > 0.5).float().mean())


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["workers", "device"])
def test_an_epoch_on_a_gpu_with_each_augmentation_path(tiny_data, tmp_path, where):
    """Pinned batches from reused loader memory (workers) and batches drawn on the GPU (device) both train."""
    import subprocess
    import sys

    from tests.helpers import ROOT, run_env

    cmd = [sys.executable, "train.py", "--data", str(tiny_data), "--device", "0", "--augment-on", where, "--epochs",
           "2", "--imgsz", "64", "--batch-size", "8", "--workers", "2", "--project", str(tmp_path), "--name", where,
           "--noplots"]
    p = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    ckpt = torch.load(tmp_path / where / "weights" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["args"]["augment_on"] == where


@pytest.mark.slow
def test_a_mosaic_run_drawn_on_the_device_resumes_exactly(tiny_data, tmp_path):
    """--augment-on device on CPU tensors, mosaic in every epoch: killed after a mid-epoch checkpoint and resumed,
    the run ends with the same bits as the undisturbed one."""
    import yaml

    from tests.helpers import DIE_AFTER_SAVE, PYTHON, ROOT, run

    hyp = yaml.safe_load((ROOT / "hyps" / "hyp.v8.yaml").read_text())
    (tmp_path / "hyp.yaml").write_text(yaml.safe_dump({**hyp, "close_mosaic": 0, "mixup": 0.5}))
    args = ["--data", str(tiny_data), "--hyp", str(tmp_path / "hyp.yaml"), "--augment-on", "device", "--imgsz", "64",
            "--batch-size", "4", "--val-batch-size", "4", "--workers", "1", "--seed", "2", "--epochs", "3",
            "--noplots", "--project", str(tmp_path)]
    run([PYTHON, "train.py", *args, "--name", "straight"])
    p = run([PYTHON, DIE_AFTER_SAVE, "--die-at", "2:2", *args, "--name", "cut", "--save-interval", "1e-9"], ok=None)
    assert p.returncode == 137, (p.stdout + p.stderr)[-3000:]
    last = tmp_path / "cut" / "weights" / "last.pt"
    run([PYTHON, "train.py", "--resume", last])
    a = torch.load(tmp_path / "straight" / "weights" / "last.pt", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert all(torch.equal(a[k][n], b[k][n]) for k in ("model", "ema") for n in a[k]) and a["metrics"] == b["metrics"]


@pytest.mark.parametrize("flag, resolved", [("auto", "workers"), ("workers", "workers"), ("device", "device")])
def test_augment_on_resolves_once_and_is_recorded(tiny_data, tmp_path, flag, resolved):
    """--augment-on is part of the frozen run config (so checkpoints record it); auto on a CPU: the workers."""
    from yolotrain.app import train
    from yolotrain.utils.core.cli import ResolvedArgs
    from yolotrain.utils.engine.config import Resume, resolve_config

    argv = ["--data", str(tiny_data), "--project", str(tmp_path), "--augment-on", flag]
    cfg = resolve_config(Resume(ResolvedArgs(**vars(train.build_parser().parse_args(argv)))), torch.device("cpu"))
    assert cfg.augment_on == resolved


def test_augment_on_auto_draws_on_the_gpu_of_a_cuda_run():
    from yolotrain.utils.engine.config import augment_default

    assert augment_default("auto", torch.device("cuda", 0)) == "device"
    assert augment_default("auto", torch.device("cpu")) == "workers"
    assert augment_default("workers", torch.device("cuda", 0)) == "workers"
