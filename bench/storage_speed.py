"""Benchmark: training from shards in an S3-compatible store against the same images as a folder.

    python bench/storage_speed.py                                      # built-in shapes, 320 px, batch 16
    python bench/storage_speed.py --data /work/photo800/data.yaml --workers 0 2 8

Takes the data yaml's training split (default: the shapes set, generated under --root), converts it to shards
(``python -m yolotrain shards``: images/s and MB/s), starts moto's S3 server on 127.0.0.1 and uploads the
shards to a bucket. Then it prints the index's open time (local; from the bucket on a node's first open, which
fetches its arrays; and on the next, which maps the node's copy) and the training loader's steady images/s
(augmented, shuffled, each worker's first batch excluded) per worker count, from the folder, the local shards
and the bucket, with each as a fraction of the folder's rate. Every image from the bucket is one byte-range GET
over HTTP to the local server. Needs requirements-s3.txt (fsspec, s3fs, moto[server]).
Figures are measured in this run only; run it alone on the machine.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from yolotrain.utils.data.shapes import SHAPE_NAMES, generate_shapes  # noqa: E402
from bench.loader_speed import epochs  # noqa: E402
from yolotrain.utils.core.cli import ArgumentParser, Range  # noqa: E402
from yolotrain.utils.core.dist import DistInfo  # noqa: E402
from yolotrain.utils.core.hyp import Hyp  # noqa: E402
from yolotrain.utils.core.logging import setup_logging  # noqa: E402
from yolotrain.utils.data.config import load_data_config  # noqa: E402
from yolotrain.utils.data.loader import create_dataloader  # noqa: E402
from yolotrain.utils.data.shardcache import BUDGET_ENV  # noqa: E402
from yolotrain.utils.data.shards import ShardIndex  # noqa: E402
from yolotrain.app import shards  # noqa: E402

BUCKET = "bench"


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None, help="a data yaml (default: the shapes set under --root)")
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "yolotrain-storage-bench")
    ap.add_argument("--imgsz", type=Range(int, min=32), default=320)
    ap.add_argument("--batch-size", type=Range(int, min=1), default=16)
    ap.add_argument("--workers", type=Range(int, min=0), nargs="+", default=[0, 2, 8])
    ap.add_argument("--batches", type=Range(int, min=1), default=20, help="timed batches per loader")
    ap.add_argument("--shard-size", type=Range(int, min=1), default=64, help="MiB per shard (the shards tool's flag)")
    return ap


class S3Server:
    """moto's S3 server on 127.0.0.1; the client environment is exported to this process (and its workers)."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{self.port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit("moto's S3 server did not start (pip install -r requirements-s3.txt)")
                time.sleep(0.2)

    def upload(self, folder: Path) -> str:
        import s3fs  # requirements-s3.txt

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
        fs.mkdir(BUCKET)
        fs.put(f"{folder}/", f"{BUCKET}/shards/", recursive=True)
        return f"s3://{BUCKET}/shards"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def copy_every_shard(url: str, node: Path) -> None:
    """The node's copy of each shard, as the first epoch makes them (one read from each starts its copy)."""
    index = ShardIndex.open(url, cache_dir=node)
    first = np.unique(np.asarray(index.arrays["shard"]), return_index=True)[1]
    for i in first:
        index.read(int(i))
    index.cache.wait()


def loader_rate(split: str, nc: int, opt: argparse.Namespace, workers: int, cache_dir: Path,
                budget: str | None) -> float:
    """Steady images/s of the training loader over ``split`` (each worker's first batch excluded: start-up);
    ``budget``: YOLOTRAIN_SHARD_CACHE_GB while the loader is built."""
    if budget is None:
        os.environ.pop(BUDGET_ENV, None)
    else:
        os.environ[BUDGET_ENV] = budget
    loader = create_dataloader(split, opt.imgsz, opt.batch_size, 32, info=DistInfo(), hyp=Hyp(), augment=True,
                               shuffle=True, workers=workers, nc=nc, seed=0, reuse_memory=True, cache_dir=cache_dir)
    it = epochs(loader)
    for _ in range(max(workers, 1)):
        next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(opt.batches):
        n += next(it).size
    rate = n / (time.perf_counter() - t0)
    del it, loader
    return rate


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(opt: argparse.Namespace) -> None:
    setup_logging(verbose=False)
    opt.root.mkdir(parents=True, exist_ok=True)
    if opt.data is None:
        generate_shapes(opt.root / "shapes", n_train=400, n_val=40, img_size=opt.imgsz)
        train, nc = str(opt.root / "shapes" / "images" / "train"), len(SHAPE_NAMES)
    else:
        data = load_data_config(opt.data)
        if len(data.train) != 1:
            raise SystemExit(f"{opt.data}: the bench takes a training split of one folder or list, not {data.train}")
        train, nc = data.train[0], data.nc
    work = Path(tempfile.mkdtemp(dir=opt.root))
    out = work / "shards"
    _, seconds = timed(lambda: shards.main(shards.build_parser().parse_args(
        [str(train), str(out), "--nc", str(nc), "--split", "train", "--shard-size", str(opt.shard_size)])))
    index = ShardIndex.open(out / "train.index")
    n, nbytes = len(index), sum(p.stat().st_size for p in out.glob("train-*.tar"))
    print(f"data: {train} ({n} images, {nbytes / 2**20:.0f} MiB of shards in {len(index.meta['shards'])} files)")
    print(f"conversion: {seconds:.1f} s, {n / seconds:.0f} images/s, {nbytes / 2**20 / seconds:.0f} MiB/s")
    server = S3Server()
    try:
        url = server.upload(out) + "/train.index"
        node = work / "node-disk"
        t_local = timed(lambda: ShardIndex.open(out / "train.index"))[1]
        t_fetch = timed(lambda: ShardIndex.open(url, cache_dir=node))[1]
        t_mapped = timed(lambda: ShardIndex.open(url, cache_dir=node))[1]
        print(f"index open: local {t_local * 1e3:.0f} ms; from the bucket {t_fetch * 1e3:.0f} ms (the node's first "
              f"open, fetching its arrays), {t_mapped * 1e3:.0f} ms (the next, mapping the node's copy)")
        t_copy = timed(lambda: copy_every_shard(url, node))[1]
        print(f"the node's copy of every shard: {t_copy:.1f} s ({nbytes / 2**20 / t_copy:.0f} MiB/s)")
        ranged = work / "no-copies"  # an empty node folder, and no copies made there: every image by range
        sources = {"folder": (str(train), node, None), "local shards": (str(out / "train.index"), node, None),
                   "S3 by range": (url, ranged, "0"), "S3 node copies": (url, node, None)}
        print(f"training loader, {opt.imgsz} px, batch {opt.batch_size}, images/s (x the folder's rate):")
        print(f"{'workers':>8s}" + "".join(f"{name:>22s}" for name in sources))
        for w in opt.workers:
            rates = [loader_rate(split, nc, opt, w, folder, budget) for split, folder, budget in sources.values()]
            print(f"{w:8d}" + "".join(f"{r:>13.1f} ({r / rates[0]:4.2f}x)" for r in rates))
    finally:
        server.stop()
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main(build_parser().parse_args())
