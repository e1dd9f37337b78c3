"""Benchmark: a shard index of millions of images opened by every rank of a 2-node x 2-rank job.

    python bench/index_scale.py                                # 2,000,000 images, 15,000,000 boxes
    python bench/index_scale.py --images 20000 --boxes 150000  # a quick look

Writes a synthetic index (utils/data/shards.py's arrays and json; no image files: nothing here reads a
pixel) once per --root, then starts two torchrun agents on 127.0.0.1 (``--nnodes 2 --nproc_per_node 2``,
gloo). Each rank times what training does before its first step: the training loader over the index
(``create_dataloader``: the dataset, its checks, the sampler), the loaded sizes planning reads, and the
epoch's first sample key. Then every rank reads every label row once, as an epoch does, and while all four
are alive each reports its RSS and PSS, and the PSS of its mappings of the index's files: the kernel
shares a mapped file's pages, so those PSS add up to about one copy of the index on the machine, however
many ranks map it. Both "nodes" run on this one machine, so the copy shown is this machine's.
Prints measured figures only.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from yolotrain.utils.core import dist  # noqa: E402
from yolotrain.utils.core.cli import ArgumentParser, Range  # noqa: E402
from yolotrain.utils.core.hyp import Hyp  # noqa: E402
from yolotrain.utils.data.labels import COUNT_KEYS  # noqa: E402
from yolotrain.utils.data.loader import create_dataloader  # noqa: E402
from yolotrain.utils.data.shards import INDEX_SUFFIX, save_index  # noqa: E402

NC = 80
PER_SHARD = 1000  # synthetic samples per shard name (no shard is written)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "yolotrain-index-bench")
    ap.add_argument("--images", type=Range(int, min=1), default=2_000_000)
    ap.add_argument("--boxes", type=Range(int, min=1), default=15_000_000)
    ap.add_argument("--imgsz", type=Range(int, min=32), default=640)
    ap.add_argument("--batch-size", type=Range(int, min=1), default=16, help="per rank")
    ap.add_argument("--probe", type=Path, default=None, help=argparse.SUPPRESS)  # a rank's work (torchrun)
    ap.add_argument("--report", type=Path, default=None, help=argparse.SUPPRESS)
    return ap


def synthetic_index(index: Path, images: int, boxes: int) -> float:
    """An index of ``images`` images holding ``boxes`` boxes spread at random; seconds taken to write it."""
    t = time.perf_counter()
    rng = np.random.default_rng(0)
    counts = np.bincount(rng.integers(0, images, boxes), minlength=images).astype(np.int64)
    labels = np.empty((boxes, 5), np.float64)
    labels[:, 0] = rng.integers(0, NC, boxes)
    labels[:, 1:3] = rng.uniform(0.1, 0.9, (boxes, 2))
    labels[:, 3:5] = rng.uniform(0.01, 0.2, (boxes, 2))
    size = rng.integers(20_000, 200_000, images)
    arrays = {"shard": (np.arange(images) // PER_SHARD).astype(np.int32),
              "offset": (np.cumsum(size) - size).astype(np.int64), "size": size.astype(np.int64),
              "suffix": np.zeros(images, np.uint8), "image_hw": rng.integers(240, 1281, (images, 2)).astype(np.int32),
              "label_start": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), "labels": labels,
              "sources": np.char.add(np.char.add(b"images/train/", np.char.zfill(
                  np.arange(images).astype(np.bytes_), 9)), b".jpg")}
    scan = {k: 0 for k in COUNT_KEYS}
    backgrounds = int((counts == 0).sum())
    scan.update(images=images, backgrounds=backgrounds, found=images - backgrounds, empty=backgrounds)
    meta = {"nc": NC, "shards": [f"train-{k:06d}.tar" for k in range(int(arrays["shard"][-1]) + 1)],
            "suffixes": [".jpg"], "counts": scan, "msgs": []}
    tmp = index.with_name(index.name + ".tmp")
    if tmp.exists():
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
    save_index(tmp, arrays, meta)
    os.replace(tmp, index)
    return time.perf_counter() - t


def memory_kb(index: Path) -> dict[str, int]:
    """This process's RSS and PSS, and the PSS of its mappings of the index's files (kB)."""
    out = {"rss": 0, "pss": 0, "index_pss": 0}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("Rss", "Pss"):
                out[key.lower()] = int(line.split()[1])
    inside, prefix = False, str(index.resolve())
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping header: "start-end perms ... path"
                inside = line.rstrip().split()[-1].startswith(prefix)
            elif inside and first == "Pss:":
                out["index_pss"] += int(line.split()[1])
    return out


def probe(index: Path, opt: argparse.Namespace) -> None:
    """One rank: open the training loader over the index, time it, read every label once, report memory."""
    info = dist.dist_info()
    with dist.process_group(info, torch.device("cpu")):
        dist.barrier()
        t0 = time.perf_counter()
        batch = opt.batch_size * info.world_size  # the flag is per rank, the loader's batch global
        loader = create_dataloader(str(index), opt.imgsz, batch, 32, info=info, hyp=Hyp(), augment=True,
                                   workers=0, shuffle=True, seed=0, nc=NC)
        dataset, sampler = loader.dataset, loader.sampler
        t_open = time.perf_counter() - t0
        dataset.loaded_hw  # noqa: B018 - planning's first read of the sizes
        sampler.set_epoch(0)
        first = next(iter(sampler))
        t_first = time.perf_counter() - t0
        t1 = time.perf_counter()
        rows = dataset.labels.rows
        checksum = float(np.asarray(rows[:, 3]).sum())  # every row read once, as an epoch's samples do
        t_read = time.perf_counter() - t1
        dist.barrier()  # all four alive and done reading: their mappings are what an epoch leaves
        report = {"rank": info.rank, "node": info.rank // info.local_world_size, "open_s": t_open,
                  "first_key_s": t_first, "read_labels_s": t_read, "images": len(dataset),
                  "first_index": int(first.index), "checksum": checksum, **memory_kb(index)}
        reports = dist.all_gather_object(report)
        dist.barrier()
    if info.rank == 0:
        opt.report.write_text(json.dumps(reports))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(index: Path, opt: argparse.Namespace, report: Path) -> None:
    """Two torchrun agents (node 0 and 1, two ranks each) on 127.0.0.1, each rank running ``probe``."""
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(k),
                                "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                                __file__, "--probe", str(index), "--report", str(report), "--imgsz", str(opt.imgsz),
                                "--batch-size", str(opt.batch_size)], env=env, cwd=ROOT)
              for k in (0, 1)]
    codes = [a.wait() for a in agents]
    if any(codes):
        raise SystemExit(f"the job failed: torchrun exit codes {codes}")


def main(opt: argparse.Namespace) -> None:
    if opt.probe is not None:
        return probe(opt.probe, opt)
    index = opt.root / f"train-{opt.images}-{opt.boxes}{INDEX_SUFFIX}"
    opt.root.mkdir(parents=True, exist_ok=True)
    if not index.is_dir():
        print(f"writing a synthetic index of {opt.images:,} images, {opt.boxes:,} boxes: {index}")
        print(f"  written in {synthetic_index(index, opt.images, opt.boxes):.1f} s")
    size = sum(f.stat().st_size for f in index.iterdir())
    print(f"index: {opt.images:,} images, {opt.boxes:,} boxes, {size / 2**20:.0f} MiB on disk")
    report = opt.root / "report.json"
    report.unlink(missing_ok=True)
    run_job(index, opt, report)
    rows = json.loads(report.read_text())
    if len({r["checksum"] for r in rows}) != 1 or len({r["first_index"] for r in rows}) != len(rows):
        raise SystemExit(f"the ranks disagree on the labels or share a first sample: {rows}")
    print("rank node  loader open s  to first key s  read all labels s  RSS MiB  PSS MiB  index PSS MiB")
    for r in sorted(rows, key=lambda r: r["rank"]):
        print(f"{r['rank']:4d} {r['node']:4d} {r['open_s']:14.2f} {r['first_key_s']:15.2f} {r['read_labels_s']:18.2f} "
              f"{r['rss'] / 1024:8.0f} {r['pss'] / 1024:8.0f} {r['index_pss'] / 1024:14.0f}")
    slowest = max(r["first_key_s"] for r in rows)
    mapped = sum(r["index_pss"] for r in rows) / 1024
    print(f"slowest rank to its first sample key: {slowest:.2f} s")
    print(f"index mappings, PSS of all four ranks together: {mapped:.0f} MiB "
          f"({mapped * 2**20 / size:.2f}x the index's {size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main(build_parser().parse_args())
