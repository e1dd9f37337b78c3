#!/usr/bin/env python
"""Training-loader throughput: images/s with the full augmentation (mosaic on) at several
worker counts, with and without the image cache, next to what the model consumes.

    python bench/loader_speed.py                       # built-in shapes data, 320 px, batch 16
    python bench/loader_speed.py --workers 0 1 2 --batches 30

Prints measured figures only; the ratio loader/model says whether data loading can keep up.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.core.cli import IMGSZ, ArgumentParser, Range  # noqa: E402
from utils.core.dist import DistInfo  # noqa: E402
from utils.core.hyp import load_hyp  # noqa: E402
from utils.data.config import load_data_config, prepare_dataset  # noqa: E402
from utils.data.imgcache import release_ram_caches  # noqa: E402
from utils.data.loader import create_dataloader  # noqa: E402


def loader_rate(data, hyp, imgsz: int, batch: int, workers: int, cache: str | None, batches: int) -> float:
    """Steady-state images/s of the training loader (first batch excluded: worker start-up)."""
    loader = create_dataloader(data.train, imgsz, batch, 32, info=DistInfo(), hyp=hyp, augment=True, shuffle=True,
                               workers=workers, nc=data.nc, cache=cache, seed=0, prefix="")
    loader.sampler.set_epoch(0)
    it = iter(loader)
    next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(batches):
        try:
            b = next(it)
        except StopIteration:
            break
        n += b.images.shape[0]
    rate = n / (time.perf_counter() - t0)
    release_ram_caches(0, loader.dataset.imgcache)  # do not leave the /dev/shm file behind
    del it, loader
    return rate


def model_rate(imgsz: int, batch: int, steps: int = 5) -> float:
    """Training images/s of yolov5n (forward + loss-free backward) on this CPU, for comparison."""
    from models.parse import MODELS_DIR
    from models.yolo import Model

    model = Model(MODELS_DIR / "yolov5n.yaml", nc=6).train()
    x = torch.rand(batch, 3, imgsz, imgsz)
    sum(p.sum() for p in model(x)).backward()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        sum(p.sum() for p in model(x)).backward()
    return steps * batch / (time.perf_counter() - t0)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"))
    p.add_argument("--hyp", default=str(ROOT / "hyps" / "hyp.scratch-low.yaml"))
    p.add_argument("--imgsz", type=IMGSZ, default=320)
    p.add_argument("--batch", type=Range(int, min=1), default=16)
    p.add_argument("--batches", type=Range(int, min=1), default=25)
    p.add_argument("--workers", type=Range(int, min=0), nargs="+", default=[0, 1, 2])
    p.add_argument("--cache", nargs="+", default=["none", "ram"])
    return p


def main() -> None:
    a = build_parser().parse_args()
    from utils.core.logging import setup_logging

    setup_logging(verbose=False)
    data = load_data_config(a.data)
    prepare_dataset(data)
    hyp = load_hyp(a.hyp)
    print(f"training loader, mosaic={hyp.mosaic} mixup={hyp.mixup}, {a.imgsz}px, batch {a.batch}, {a.batches} batches")
    m = model_rate(a.imgsz, a.batch)
    print(f"model (yolov5n fwd+bwd, {torch.get_num_threads()} threads): {m:8.1f} img/s")
    for cache in a.cache:
        for w in a.workers:
            r = loader_rate(data, hyp, a.imgsz, a.batch, w, None if cache == "none" else cache, a.batches)
            print(f"loader cache={cache:<4} workers={w}: {r:8.1f} img/s   loader/model {r / m:5.2f}x")


if __name__ == "__main__":
    main()
