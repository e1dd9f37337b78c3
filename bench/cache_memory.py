"""Benchmark: memory of ``--cache ram`` shared by ranks x workers, and cached vs uncached read speed.

    python bench/cache_memory.py [--images 2000] [--img-size 320] [--ranks 2] [--workers 2]

Generates the synthetic shapes dataset (reused across runs), builds the ram cache, then forks
``ranks`` processes that each fork ``workers`` DataLoader-like workers. Every one of them gets the
cache by unpickling it (as a spawned worker would: paths only, mapped on first access) and reads
every image. While all are alive it sums their PSS (``/proc/<pid>/smaps_rollup``; shared pages
are split between the processes that map them) and compares it with the cache file size: with a
shared mapping total PSS / cache size stays near 1, where per-process copies would give ~N.
Then it times images/s from the cache against cv2.imread + resize (the uncached load_image).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2

from yolotrain.utils.data.shapes import generate_shapes
from yolotrain.utils.data.augment import resize_long_side
from yolotrain.utils.core.cli import ArgumentParser, Range
from yolotrain.utils.data.imgcache import build_or_open
from yolotrain.utils.data.split import FileCacheSource
from yolotrain.utils.core.logging import setup_logging


def pss_kb(pid: int, only: str | None = None) -> int:
    """PSS of a process in kB: the whole process (smaps_rollup), or only mappings of file ``only`` (smaps)."""
    if only is None:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping header: "start-end perms ... path"
                inside = line.rstrip().endswith(only)
            elif inside and first == "Pss:":
                total += int(line.split()[1])
    return total


def read_all(blob: bytes):
    """Unpickle the cache (maps it in this process) and touch every image, like a worker's epoch.

    Returns the cache so the caller keeps it (and its mapping) alive while PSS is measured.
    """
    cache = pickle.loads(blob)
    for i in range(len(cache)):
        cache.get(i)
    return cache


def worker(blob: bytes, ready: mp.Queue, done: mp.Event) -> None:
    cache = read_all(blob)
    ready.put(("worker", os.getpid()))
    done.wait()
    del cache


def rank(blob: bytes, workers: int, ready: mp.Queue, done: mp.Event) -> None:
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=worker, args=(blob, ready, done)) for _ in range(workers)]
    for p in procs:
        p.start()
    cache = read_all(blob)  # the rank's main process reads too (validation, plotting...)
    ready.put(("rank", os.getpid()))
    done.wait()
    del cache
    for p in procs:
        p.join()


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=Range(int, min=1), default=2000)
    ap.add_argument("--img-size", type=Range(int, min=64, note="the shapes generator's smallest image"), default=320)
    ap.add_argument("--ranks", type=Range(int, min=1), default=2)
    ap.add_argument("--workers", type=Range(int, min=0), default=2)
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "yolotrain-bench-shapes")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    setup_logging()

    generate_shapes(args.root, seed=0, n_train=args.images, n_val=0, img_size=args.img_size)
    im_files = sorted(str(p) for p in (args.root / "images" / "train").iterdir())
    cache = build_or_open(im_files, args.img_size, False, "ram", FileCacheSource(im_files), num_threads=2)
    try:
        size_kb = cache.file.stat().st_size / 1024
        blob = pickle.dumps(cache)
        ctx = mp.get_context("fork")
        ready, done = ctx.Queue(), ctx.Event()
        ranks = [ctx.Process(target=rank, args=(blob, args.workers, ready, done)) for _ in range(args.ranks)]
        for p in ranks:
            p.start()
        who = [ready.get(timeout=600) for _ in range(args.ranks * (1 + args.workers))]
        pids = [pid for _, pid in who]
        pss = {pid: pss_kb(pid) for pid in pids}
        pss_cache = {pid: pss_kb(pid, str(cache.file)) for pid in pids}
        done.set()
        for p in ranks:
            p.join()

        total, total_cache = sum(pss.values()), sum(pss_cache.values())
        n = len(pids)
        print(f"\ncache file        : {cache.file} ({size_kb / 1024:.1f} MiB, {len(im_files)} images "
              f"at {args.img_size} px)")
        print(f"processes         : {args.ranks} ranks x (1 + {args.workers} workers) = {n}, each read every image")
        for (kind, pid) in who:
            print(f"  {kind:6s} pid {pid:6d}: PSS {pss[pid] / 1024:7.1f} MiB "
                  f"(of which cache mapping {pss_cache[pid] / 1024:6.1f} MiB)")
        print(f"total PSS         : {total / 1024:.1f} MiB ({total / n / 1024:.1f} MiB per process)")
        print(f"cache-mapping PSS : {total_cache / 1024:.1f} MiB summed over {n} processes "
              f"= {total_cache / size_kb:.2f} x cache size (the rest: interpreters, torch, cv2)")
        print(f"total PSS / cache : {total / size_kb:.2f}  (per-process copies would be ~{n})")

        k = min(500, len(im_files))
        t0 = time.perf_counter()
        for i in range(len(im_files)):
            cache.get(i)
        t_cache = time.perf_counter() - t0
        t0 = time.perf_counter()
        for f in im_files[:k]:
            resize_long_side(cv2.imread(f), args.img_size, False)
        t_disk = time.perf_counter() - t0
        print(f"read speed        : cache {len(im_files) / t_cache:8.0f} img/s, "
              f"cv2.imread+resize {k / t_disk:8.0f} img/s ({len(im_files) / t_cache / (k / t_disk):.1f}x), one process")
    finally:
        cache.remove()  # /dev/shm is RAM: do not leave the benchmark's cache behind


if __name__ == "__main__":
    main()
