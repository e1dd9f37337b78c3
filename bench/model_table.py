"""Benchmark: our YOLOv5 n/s/m/l/x builds against the published YOLOv5 v6 model table.

    python bench/model_table.py [--imgsz 640] [--nc 80] [--tol 2.0] [--models n,s,m,l,x]

Builds each bundled ``models/yolov5{n,s,m,l,x}.yaml``, fuses it (the published table counts
fused models: Conv+BN folded, so no BN parameters), counts parameters and estimates GFLOPs the way
``Model.info`` does (thop), and prints both next to the published figures with the relative
difference and PASS/FAIL against the tolerance. The published figures are rounded (0.1M, 0.1G),
so a faithful build lands well inside 2%. Exits 1 if any model fails, so it can gate a change.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

# Published YOLOv5 v6.0 table (github.com/ultralytics/yolov5 README): params (M), FLOPs @640 (G).
PUBLISHED: dict[str, tuple[float, float]] = {
    "n": (1.9, 4.5),
    "s": (7.2, 16.5),
    "m": (21.2, 49.0),
    "l": (46.5, 109.1),
    "x": (86.7, 205.7),
}


class Row(NamedTuple):
    """One model's measured and published figures."""

    name: str
    params_m: float
    gflops: float
    pub_params_m: float
    pub_gflops: float
    seconds: float

    @property
    def d_params(self) -> float:
        return rel_diff(self.params_m, self.pub_params_m)

    @property
    def d_gflops(self) -> float:
        return rel_diff(self.gflops, self.pub_gflops)


def rel_diff(ours: float, published: float) -> float:
    """Signed relative difference in percent."""
    return 100.0 * (ours - published) / published


def measure(size: str, nc: int, imgsz: int) -> Row:
    """Build, fuse and measure one model (imports here: the repo root is on sys.path by now)."""
    import torch

    from models.parse import MODELS_DIR
    from models.yolo import Model

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = Model(MODELS_DIR / f"yolov5{size}.yaml", nc=nc).eval().fuse()
    params = sum(p.numel() for p in model.parameters())
    gflops = model.info(imgsz).gflops
    pub_p, pub_g = PUBLISHED[size]
    return Row(f"yolov5{size}", params / 1e6, gflops, pub_p, pub_g, time.perf_counter() - t0)


def format_table(rows: list[Row], tol: float) -> tuple[str, bool]:
    """The printed table and whether every model is within tol % on both figures."""
    head = (f"{'model':<9}{'params(M)':>11}{'published':>11}{'diff%':>8}"
            f"{'GFLOPs':>10}{'published':>11}{'diff%':>8}  {'result':<6}{'build s':>9}")
    lines, all_ok = [head, "-" * len(head)], True
    for r in rows:
        ok = abs(r.d_params) <= tol and abs(r.d_gflops) <= tol
        all_ok &= ok
        lines.append(f"{r.name:<9}{r.params_m:>11.3f}{r.pub_params_m:>11.1f}{r.d_params:>+8.2f}"
                     f"{r.gflops:>10.2f}{r.pub_gflops:>11.1f}{r.d_gflops:>+8.2f}  "
                     f"{'PASS' if ok else 'FAIL':<6}{r.seconds:>9.1f}")
    return "\n".join(lines), all_ok


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's (import here: see __main__)."""
    from utils.core.cli import IMGSZ, ArgumentParser, Range

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--imgsz", type=IMGSZ, default=640, help="image side for GFLOPs")
    ap.add_argument("--nc", type=Range(int, min=1), default=80, help="number of classes (the published table uses 80)")
    ap.add_argument("--tol", type=Range(float, min=0), default=2.0, help="allowed relative difference, percent")
    ap.add_argument("--models", default="n,s,m,l,x", help="comma-separated sizes")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse flags, measure each model, print the table; 0 if all pass, else 1."""
    ap = build_parser()
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.models.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in PUBLISHED]
    if unknown:
        ap.error(f"unknown model size(s) {unknown}; choose from {', '.join(PUBLISHED)}")
    print(f"YOLOv5 v6 models, fused, nc={args.nc}, {args.imgsz}x{args.imgsz}; "
          f"tolerance {args.tol:g}% against the published table")
    table, ok = format_table([measure(s, args.nc, args.imgsz) for s in sizes], args.tol)
    print(table)
    print("all within tolerance" if ok else "SOME MODELS OUTSIDE TOLERANCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
    sys.exit(main())
