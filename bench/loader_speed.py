#!/usr/bin/env python
"""Training-loader speed, stage by stage, beside Ultralytics' loader on the same images.

    python bench/loader_speed.py                                   # built-in shapes, 320 px, batch 16
    python bench/loader_speed.py --data /work/photo640/data.yaml --imgsz 320 640 --batch 16 64 \\
        --workers 0 1 2 --ultralytics-python U

For every image size and batch it prints:

  stages   milliseconds per sample of each stage, in this process on one core. Ours: read + decode
           (``load_image``: file, decode, resize to the long side), plan (the draws and label maths),
           placement (mosaic canvas fill and tile copies), warp, colour (HSV and the BGR -> RGB write into
           the batch), flip, and assembly (the rest of a batch: targets, batch memory); for the device path
           (--augment-on device) pack (tiles into the batch) and render (the device's drawing of the batch;
           on CUDA where there is one, else on CPU tensors). Hand-over: worker -> main (a worker writes a
           prepared batch and the main process receives it: reused shared buffers, as training loads, and
           fresh memory per batch), pinning and host -> device with the uint8 -> float conversion (CUDA only).
           Ultralytics' stages come from bench/ultralytics_loader.py, run by its own interpreter, with its
           image decodes per sample (its mosaic takes three of four tiles from a buffer of recent images).
  rates    steady images/s of each loader built as its trainer builds it (ours: training's loader, with its
           reused batch memory; the device path's loader, whose workers only read and pack), per worker
           count, and ours / Ultralytics. Both tools get the same worker count, so the ratio is also the
           ratio per core. On CUDA also the device path's batches delivered to the GPU as a CUDA run feeds
           them (pinned, copied and drawn on a side stream: utils/data/device_feed.py), with each batch
           pinned by copying and with the reused buffers page-locked in place (utils/data/pinning.py).

Everything runs with one OpenCV and one torch thread per process, so 0 workers means one core and N workers
N cores (plus the main process, which only receives). Figures are measured in this run only. Run it alone
on the machine: a loader is as fast as its cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from bench.val_speed import Timers  # noqa: E402
from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range  # noqa: E402
from yolotrain.utils.core.cpu import tune_malloc  # noqa: E402
from yolotrain.utils.core.dist import BatchSplit, DistInfo  # noqa: E402
from yolotrain.utils.core.hyp import Hyp, load_hyp  # noqa: E402
from yolotrain.utils.data import dataset as dataset_module  # noqa: E402
from yolotrain.utils.data import render as render_module  # noqa: E402
from yolotrain.utils.data.batch import Batch, BatchMemory  # noqa: E402
from yolotrain.utils.data.config import load_data_config, prepare_dataset  # noqa: E402
from yolotrain.utils.data.device_feed import DeviceFeed  # noqa: E402
from yolotrain.utils.data.device_augment import render_batch  # noqa: E402
from yolotrain.utils.data.imgcache import release_ram_caches  # noqa: E402
from yolotrain.utils.data.loader import PREFETCH, TrainSampler, create_dataloader  # noqa: E402

STAGES = ("read+decode", "plan", "placement", "warp", "colour", "flip", "assembly")


def stage_times(data, hyp: Hyp, imgsz: int, batch: int, batches: int) -> dict[str, float]:
    """Ours, in process: ms per sample of each stage over ``batches`` training batches (epoch 0, mosaic on)."""
    spec = dataset_module.DatasetSpec(data.train, nc=data.nc, img_size=imgsz, augment=True, hyp=hyp)
    ds = dataset_module.LoadImagesAndLabels(spec, batch_size=batch, verbose=False)
    ds.memory = BatchMemory(reuse=True)
    sampler = TrainSampler(len(ds), seed=0, batch=BatchSplit(batch, 1))
    sampler.set_epoch(0)
    keys = list(sampler)
    groups = [keys[i:i + batch] for i in range(0, min(len(keys), batch * (batches + 1)), batch)]
    ds.__getitems__(groups[0])  # warm: scratch buffers, the batch ring
    timer = Timers()  # bench/val_speed.py's: wrapped module-level names, looked up at call time
    for owner, name, stage in ((dataset_module.LoadImagesAndLabels, "load_image", "read+decode"),
                               (dataset_module, "plan_sample", "plan"), (render_module, "warp_image", "warp"),
                               (render_module, "draw_composite", "placement"),  # holds the warp and reads: subtracted
                               (render_module, "colour_into", "colour"), (render_module, "flip_in_place", "flip")):
        if not timer.wrap(owner, name, stage):
            raise SystemExit(f"loader_speed.py: {owner.__name__}.{name} is gone; update the stage list")
    n, t0 = 0, time.perf_counter()
    try:
        for g in groups[1:]:
            n += ds.__getitems__(g).size
    finally:
        total = time.perf_counter() - t0
        timer.restore()
    s = dict(timer.seconds)
    s["placement"] -= s.get("warp", 0.0) + s.get("read+decode", 0.0)  # it draws the tiles, read on first use
    s["assembly"] = total - sum(s.get(k, 0.0) for k in STAGES if k != "assembly")
    out = {k: 1e3 * s.get(k, 0.0) / max(n, 1) for k in STAGES}
    out["total"] = 1e3 * total / max(n, 1)
    out.update(device_stages(ds, groups[1:], n))
    return out


def device_stages(ds, groups: list, n: int) -> dict[str, float]:
    """The device path: the workers' share (plans, reads, pack), and the device's render of each batch (on
    CUDA from pinned tiles, as a CUDA run's loader hands them over, with the tiles' copy alone beside it)."""
    ds.render_on_device = True
    packed, t0 = [], time.perf_counter()
    for g in groups[:4]:
        packed.append(ds.__getitems__(g))
    worker = time.perf_counter() - t0
    ds.render_on_device = False
    images = sum(b.size for b in packed)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        packed = [b._replace(deferred=b.deferred._replace(tiles=b.deferred.tiles.pin_memory())) for b in packed]
    render_batch(packed[0].deferred, device)  # warm (kernels, allocator)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for b in packed:
        render_batch(b.deferred, device)
    sync()
    out = {"device path: workers (plan, read, pack)": 1e3 * worker / images,
           f"device path: render on {device.type}": 1e3 * (time.perf_counter() - t0) / images}
    if cuda:
        t0 = time.perf_counter()
        for b in packed:
            b.deferred.tiles.to(device, non_blocking=True)
        sync()
        out["device path: of which the tiles' copy (pinned)"] = 1e3 * (time.perf_counter() - t0) / images
    return out


class _Prepared(torch.utils.data.Dataset):
    """A dataset whose batches are ready-made pixels: a loader over it times the hand-over alone."""

    def __init__(self, batch: int, imgsz: int, reuse: bool) -> None:
        self.batch, self.imgsz = batch, imgsz
        self.pixels = np.random.default_rng(0).integers(0, 255, (batch, imgsz, imgsz, 3), dtype=np.uint8)
        self.memory = BatchMemory(reuse=reuse)

    def __len__(self) -> int:
        return 1 << 20

    def __getitems__(self, items: list) -> Batch:
        buf = self.memory.take(self.pixels.nbytes).view(self.pixels.shape)
        buf.numpy()[...] = self.pixels
        n = len(items)
        return Batch(buf.permute(0, 3, 1, 2), torch.zeros(0, 6), ("",) * n, (None,) * n, torch.arange(n))


def handover_times(imgsz: int, batch: int, batches: int) -> dict[str, float]:
    """ms per sample to write a ready batch in a worker and receive it in the main process (one worker),
    with reused shared buffers and with fresh memory per batch; pinning and host -> device on CUDA."""
    out = {}
    for reuse in (True, False):
        loader = DataLoader(_Prepared(batch, imgsz, reuse), batch_size=batch, num_workers=1, collate_fn=lambda b: b,
                            persistent_workers=False, prefetch_factor=2)
        it = iter(loader)
        first = next(it)
        n, t0 = 0, time.perf_counter()
        for _ in range(batches):
            n += next(it).size
        out[f"worker -> main ({'reused' if reuse else 'fresh'} memory)"] = 1e3 * (time.perf_counter() - t0) / n
        del it, loader, first
    if torch.cuda.is_available():
        images = torch.from_numpy(_Prepared(batch, imgsz, True).pixels).permute(0, 3, 1, 2)
        pinned = images.pin_memory()
        t0 = time.perf_counter()
        for _ in range(batches):
            pinned = images.pin_memory()
        out["pin (page-locked copy)"] = 1e3 * (time.perf_counter() - t0) / (batches * batch)
        dev = torch.device("cuda")
        pinned.to(dev, non_blocking=True).float().div_(255)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(batches):
            pinned.to(dev, non_blocking=True).float().div_(255)
        torch.cuda.synchronize()
        out["host -> device + uint8 -> float"] = 1e3 * (time.perf_counter() - t0) / (batches * batch)
    return out


def loader_rate(data, hyp: Hyp, imgsz: int, batch: int, workers: int, cache: str | None, batches: int,
                device_path: bool) -> float:
    """Steady images/s of the training loader as build_training makes it (after ``warm_batches``)."""
    loader = create_dataloader(data.train, imgsz, batch, 32, info=DistInfo(), hyp=hyp, augment=True, shuffle=True,
                               workers=workers, nc=data.nc, cache=cache, seed=0, prefix="", reuse_memory=True,
                               render_on_device=device_path)
    it = epochs(loader)
    for _ in range(warm_batches(workers)):
        next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(batches):
        n += next(it).size
    rate = n / (time.perf_counter() - t0)
    release_ram_caches(0, loader.dataset.imgcache)  # do not leave the /dev/shm file behind
    del it, loader
    return rate


def delivered_rate(data, hyp: Hyp, imgsz: int, batch: int, workers: int, batches: int, in_place: bool) -> float:
    """Steady images/s of the device path's batches on the GPU, fed as training feeds them: pinned (copied, or
    the reused buffers locked in place), then copied and drawn on a side stream one batch ahead."""
    loader = create_dataloader(data.train, imgsz, batch, 32, info=DistInfo(), hyp=hyp, augment=True, shuffle=True,
                               workers=workers, nc=data.nc, seed=0, prefix="", pin_memory=True,
                               reuse_memory=in_place, render_on_device=True)
    fed = DeviceFeed(epochs(loader), torch.device("cuda"), torch.channels_last)
    for _ in range(warm_batches(workers)):
        next(fed)
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    for _ in range(batches):
        n += next(fed).batch.size
        fed.ahead()  # as the training loop asks for the next batch during a step
    torch.cuda.synchronize()
    rate = n / (time.perf_counter() - t0)
    del fed, loader
    return rate


def warm_batches(workers: int) -> int:
    """Batches taken before the timing starts: each worker's first (start-up), and twice the batches the
    workers prepare ahead, so the timed ones come at the rate they are made, not from the queue."""
    return max(workers, 1) + 2 * PREFETCH * workers


def epochs(loader):
    """The loader's batches epoch after epoch (a small set runs out before the timed batches do)."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def ultralytics(python: str, data, imgsz: int, batch: int, workers: list[int], batches: int) -> dict:
    """bench/ultralytics_loader.py under Ultralytics' interpreter: its rates per worker count and its stages.
    It reads a yaml of the resolved splits (absolute paths): Ultralytics resolves a relative ``path:`` against
    its own datasets folder, ours against the yaml's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ultralytics.json"
        data_yaml = Path(tmp) / "data.yaml"
        one = {k: v[0] if len(v) == 1 else list(v) for k, v in (("train", data.train), ("val", data.val))}
        data_yaml.write_text(yaml.safe_dump({"path": str(data.root), **one, "names": dict(enumerate(data.names))}))
        env = dict(os.environ, YOLO_CONFIG_DIR=str(Path(tmp) / "cfg"), YOLO_OFFLINE="1", YOLO_AUTOINSTALL="false",
                   MPLCONFIGDIR=str(Path(tmp) / "mpl"))
        cmd = [python, str(ROOT / "bench" / "ultralytics_loader.py"), "--data", str(data_yaml), "--imgsz", str(imgsz),
               "--batch", str(batch), "--workers", *map(str, workers), "--batches", str(batches), "--json", str(out)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode or not out.exists():
            raise SystemExit(f"Ultralytics' loader bench failed (exit {p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
        return json.loads(out.read_text())


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"))
    p.add_argument("--hyp", default=str(ROOT / "hyps" / "hyp.v8.yaml"), help="ours (Ultralytics uses its defaults)")
    p.add_argument("--imgsz", type=IMGSZ, nargs="+", default=[320])
    p.add_argument("--batch", type=Range(int, min=1), nargs="+", default=[16])
    p.add_argument("--batches", type=Range(int, min=1), default=10, help="timed batches per figure")
    p.add_argument("--workers", type=Range(int, min=0), nargs="+", default=[0, 1, 2])
    p.add_argument("--cache", choices=("none", "ram"), nargs="+", default=["none"], help="ours: --cache")
    p.add_argument("--ultralytics-python", default=None, help="python of a venv with ultralytics (its loader beside ours)")
    p.add_argument("--no-stages", action="store_true", help="rates only")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    return p


def table(title: str, rows: dict[str, float], peer: dict[str, float] | None = None) -> str:
    lines = [title]
    for k, v in rows.items():
        lines.append(f"  {k:<44}{v:9.3f}")
    for k, v in (peer or {}).items():
        lines.append(f"  ultralytics: {k:<31}{v:9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    from yolotrain.utils.core.logging import setup_logging

    setup_logging(verbose=False)
    tune_malloc()  # as train.py on a CPU (its loader workers do it on any device)
    torch.set_num_threads(1)
    cv2.setNumThreads(1)  # in process, one core: OpenCV would otherwise spread a warp over every core
    data = load_data_config(a.data)
    prepare_dataset(data)
    hyp = load_hyp(a.hyp)
    report: dict[str, Any] = {"data": a.data, "cpus": os.cpu_count(), "torch": torch.__version__, "results": []}
    print(f"training loader, mosaic={hyp.mosaic} mixup={hyp.mixup}, {os.cpu_count()} CPUs, data {a.data}")
    for imgsz in a.imgsz:
        for batch in a.batch:
            res: dict[str, Any] = {"imgsz": imgsz, "batch": batch}
            peer = ultralytics(a.ultralytics_python, data, imgsz, batch, a.workers, a.batches) \
                if a.ultralytics_python else None
            print(f"\n{imgsz} px, batch {batch}")
            res["rates"] = rates(a, data, hyp, imgsz, batch, peer)  # first: forked workers of a lean process
            if not a.no_stages:
                res["stages_ms"] = stage_times(data, hyp, imgsz, batch, a.batches)
                res["handover_ms"] = handover_times(imgsz, batch, a.batches)
                print(table("  stages, ms per sample (one core, in process)", res["stages_ms"],
                            peer.get("stages_ms") if peer else None))
                if peer and "decodes_per_sample" in peer:
                    print(f"  ultralytics: decodes per sample {peer['decodes_per_sample']:.2f}; ours: 1 read per image "
                          "of the batch (mosaic partners come from the batch's pools)")
                print(table("  hand-over, ms per sample", res["handover_ms"]))
            report["results"].append(res)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


def rates(a, data, hyp: Hyp, imgsz: int, batch: int, peer: dict | None) -> list[dict]:
    """Images/s per worker count for each of our loaders and Ultralytics'; printed as a table."""
    rows = []
    print(f"  {'loader':<38}{'workers':>8}{'img/s':>10}{'ultralytics':>13}{'ours/ultra':>12}")
    for cache in a.cache:
        for device_path in (False, True):
            name = ("ours, device path (workers read)" if device_path else "ours") + (f", --cache {cache}" if cache != "none" else "")
            for w in a.workers:
                r = loader_rate(data, hyp, imgsz, batch, w, None if cache == "none" else cache, a.batches, device_path)
                u = peer["rates"].get(str(w)) if peer else None
                rows.append({"loader": name, "workers": w, "img_s": r, "ultralytics_img_s": u})
                ratio = f"{r / u:.2f}x" if u else ""
                print(f"  {name:<38}{w:>8}{r:>10.1f}{(f'{u:.1f}' if u else '-'):>13}{ratio:>12}")
    if torch.cuda.is_available():
        for in_place in (False, True):
            name = f"device path on the GPU, pinned {'in place' if in_place else 'by copy'}"
            for w in a.workers:
                r = delivered_rate(data, hyp, imgsz, batch, w, a.batches, in_place)
                rows.append({"loader": name, "workers": w, "img_s": r, "ultralytics_img_s": None})
                print(f"  {name:<38}{w:>8}{r:>10.1f}{'-':>13}{'':>12}")
    return rows


if __name__ == "__main__":
    main()
