#!/usr/bin/env python
"""Label-scan speed: the first scan of a 20,000-image split (every image fully decoded, every
label row checked) against loading the same result from the label cache.

    python bench/scan_speed.py                          # 20,000 images at 160 px in a temp folder
    python bench/scan_speed.py --root /tmp/shapes20k --n 20000 --img-size 160 --workers 2

The dataset is generated once per --root (the generator skips an identical existing one);
the cache is deleted before the first scan so it is always a cold scan. Prints measured figures only.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from yolotrain.utils.data.shapes import generate_shapes  # noqa: E402
from yolotrain.utils.core.cli import ArgumentParser, Range  # noqa: E402
from yolotrain.utils.data.labelcache import cache_paths, load_or_scan  # noqa: E402
from yolotrain.utils.data.labels import format_summary, img2label_paths, resolve_image_files, scan_labels  # noqa: E402

NC = 6  # classes in the shapes dataset


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "yolotrain-scan-bench")
    ap.add_argument("--n", type=Range(int, min=1), default=20000, help="training images")
    ap.add_argument("--img-size", type=Range(int, min=64, note="the shapes generator's smallest image"), default=160)
    ap.add_argument("--workers", type=Range(int, min=1), default=None, help="scan threads (default: min(8, cpus))")
    return ap


def main() -> None:
    args = build_parser().parse_args()

    t = time.perf_counter()
    generate_shapes(args.root, seed=0, n_train=args.n, n_val=0, img_size=args.img_size)
    print(f"dataset: {args.root} ({args.n} images, {args.img_size} px), ready in {time.perf_counter() - t:.1f} s")

    src = args.root / "images" / "train"
    imgs = resolve_image_files(src)
    lbls = img2label_paths(imgs)
    for f in cache_paths(src, lbls, None):
        f.unlink(missing_ok=True)

    if args.workers:  # load_or_scan uses the default worker count; time an explicit one separately
        t = time.perf_counter()
        scan_labels(imgs, lbls, NC, num_workers=args.workers)
        print(f"scan with {args.workers} worker(s): {time.perf_counter() - t:.2f} s")
        for f in cache_paths(src, lbls, None):
            f.unlink(missing_ok=True)

    t = time.perf_counter()
    first, hit1 = load_or_scan(src, imgs, lbls, NC)
    t_scan = time.perf_counter() - t
    t = time.perf_counter()
    second, hit2 = load_or_scan(src, imgs, lbls, NC)
    t_cache = time.perf_counter() - t
    assert not hit1 and hit2 and second.counts == first.counts, "second call must be a cache hit"

    n = len(imgs)
    print(format_summary(first.counts, "train"))
    print(f"first scan (no cache): {t_scan:.2f} s ({n / t_scan:.0f} images/s, {os.cpu_count()} cpus, "
          f"{min(8, os.cpu_count() or 1)} threads)")
    print(f"cache load:            {t_cache:.3f} s ({n / t_cache:.0f} images/s)")
    print(f"ratio scan / cache:    {t_scan / t_cache:.0f}x")


if __name__ == "__main__":
    main()
