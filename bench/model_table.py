"""Benchmark: our model builds against reference parameter counts and GFLOPs.

    python bench/model_table.py [--imgsz 640] [--nc 80] [--tol 2.0] [--models yolov5n,yolov8s,...]

Two families of references:
- YOLOv5 n/s/m/l/x (``models/yolov5{n,s,m,l,x}.yaml``) against YOLOv5's published v6 table, which
  counts fused models (Conv+BN folded, so no BN parameters) and rounds (0.1M, 0.1G), so a faithful
  build lands well inside 2%. ``--models n,s`` still means these.
- The anchor-free families (``yolov8{n..x}``, ``yolo11{n..x}``, ``yolo26{n..x}``, ``yolov5{n,s}u``: each a family
  yaml at a scale; ``yolov10{n,s,m,b,l,x}``: one yaml per size) against exact figures measured with Ultralytics 8.4.190 on unfused models;
  "not given" where no reference figure was available (ours are printed, nothing is checked).

GFLOPs are estimated the way ``Model.info`` does (thop, plus attention products for YOLO11's
C2PSA). Prints each model next to its reference with the relative difference and PASS/FAIL
against the tolerance; exits 1 if any checked figure fails, so it can gate a change.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple


class Reference(NamedTuple):
    """A model's reference figures: parameters (M) and GFLOPs at 640, None where not given."""

    params_m: float | None
    gflops: float | None
    fused: bool  # whether the figures describe the fused model (and so are measured fused)


# Published YOLOv5 v6.0 table (github.com/ultralytics/yolov5 README): fused, params (M), FLOPs @640 (G).
PUBLISHED_V5: dict[str, Reference] = {
    "yolov5n": Reference(1.9, 4.5, True),
    "yolov5s": Reference(7.2, 16.5, True),
    "yolov5m": Reference(21.2, 49.0, True),
    "yolov5l": Reference(46.5, 109.1, True),
    "yolov5x": Reference(86.7, 205.7, True),
}
# Measured with Ultralytics 8.4.190 at nc=80: unfused parameters, thop GFLOPs @640 (2 x MACs).
ULTRALYTICS_AF: dict[str, Reference] = {
    "yolov8n": Reference(3.157200, 8.86, False),
    "yolov8s": Reference(11.166560, 28.81, False),
    "yolov8m": Reference(25.902640, 79.31, False),
    "yolov8l": Reference(43.691520, 165.73, False),
    "yolov8x": Reference(68.229648, 258.54, False),
    "yolo11n": Reference(2.624080, 6.67, False),
    "yolo11s": Reference(9.458752, 21.84, False),
    "yolo11m": Reference(20.114688, 68.64, False),
    "yolo11l": Reference(25.372160, 87.85, False),
    "yolo11x": Reference(56.966176, 196.32, False),
    "yolov5nu": Reference(2.654816, 7.84, False),
    "yolov5su": Reference(9.153152, 24.21, False),
    "yolo26n": Reference(2.572280, 6.24, False),
    "yolo26s": Reference(10.009784, 23.08, False),
    "yolo26m": Reference(21.896248, 75.64, False),
    "yolo26l": Reference(26.299704, 94.16, False),
    "yolo26x": Reference(58.993368, 210.07, False),
    "yolov10n": Reference(2.775520, 8.80, False),
    "yolov10s": Reference(8.128272, 25.23, False),
    "yolov10m": Reference(16.576768, 64.61, False),
    "yolov10b": Reference(20.574384, 99.47, False),
    "yolov10l": Reference(25.888688, 127.99, False),
    "yolov10x": Reference(31.808960, 171.99, False),
}
REFERENCES: dict[str, Reference] = {**PUBLISHED_V5, **ULTRALYTICS_AF}


class Row(NamedTuple):
    """One model's measured and reference figures."""

    name: str
    params_m: float
    gflops: float
    ref: Reference
    seconds: float

    @property
    def d_params(self) -> float | None:
        return rel_diff(self.params_m, self.ref.params_m)

    @property
    def d_gflops(self) -> float | None:
        return rel_diff(self.gflops, self.ref.gflops)

    def ok(self, tol: float) -> bool:
        """Every figure that has a reference is within tol %."""
        return all(d is None or abs(d) <= tol for d in (self.d_params, self.d_gflops))


def rel_diff(ours: float, reference: float | None) -> float | None:
    """Signed relative difference in percent (None without a reference)."""
    return None if reference is None else 100.0 * (ours - reference) / reference


def measure(name: str, nc: int, imgsz: int) -> Row:
    """Build one model (fused when its reference is), measure it (imports here: the repo root is
    on sys.path by now)."""
    import torch

    from yolotrain.models.parse import MODELS_DIR
    from yolotrain.models.yolo import Model

    ref = REFERENCES[name]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = Model(MODELS_DIR / f"{name}.yaml", nc=nc).eval()
    if ref.fused:
        model.fuse()
    params = sum(p.numel() for p in model.parameters())
    gflops = model.info(imgsz).gflops
    return Row(name, params / 1e6, gflops, ref, time.perf_counter() - t0)


def _ref(value: float | None, width: int) -> str:
    """A reference figure as given (no invented digits), or 'not given'."""
    text = "not given" if value is None else f"{value:.6f}".rstrip("0").rstrip(".")
    return f"{text:>{width}}"


def _diff(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>+{width}.2f}"


def format_table(rows: list[Row], tol: float) -> tuple[str, bool]:
    """The printed table and whether every checked figure is within tol %."""
    head = (f"{'model':<10}{'fused':>6}{'params(M)':>11}{'reference':>11}{'diff%':>8}"
            f"{'GFLOPs':>9}{'reference':>11}{'diff%':>8}  {'result':<6}{'build s':>9}")
    lines, all_ok = [head, "-" * len(head)], True
    for r in rows:
        ok = r.ok(tol)
        all_ok &= ok
        given = r.ref.params_m is not None or r.ref.gflops is not None
        result = ("PASS" if ok else "FAIL") if given else "-"
        lines.append(f"{r.name:<10}{'yes' if r.ref.fused else 'no':>6}{r.params_m:>11.6f}"
                     f"{_ref(r.ref.params_m, 11)}{_diff(r.d_params, 8)}"
                     f"{r.gflops:>9.2f}{_ref(r.ref.gflops, 11)}{_diff(r.d_gflops, 8)}  "
                     f"{result:<6}{r.seconds:>9.1f}")
    return "\n".join(lines), all_ok


def model_names(spec: str) -> list[str]:
    """--models entries: a bare size letter means that YOLOv5 v6 model (the original flag's meaning)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    return [f"yolov5{s}" if f"yolov5{s}" in PUBLISHED_V5 else s for s in names]


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's (import here: see __main__)."""
    from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--imgsz", type=IMGSZ, default=640, help="image side for GFLOPs")
    ap.add_argument("--nc", type=Range(int, min=1), default=80, help="number of classes (the references use 80)")
    ap.add_argument("--tol", type=Range(float, min=0), default=2.0, help="allowed relative difference, percent")
    ap.add_argument("--models", default=",".join(REFERENCES),
                    help="comma-separated model names (a bare n/s/m/l/x means yolov5n...); default: all")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse flags, measure each model, print the table; 0 if all pass, else 1."""
    ap = build_parser()
    args = ap.parse_args(argv)
    names = model_names(args.models)
    unknown = [s for s in names if s not in REFERENCES]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(REFERENCES)}")
    print(f"nc={args.nc}, {args.imgsz}x{args.imgsz}; tolerance {args.tol:g}% against the references "
          "(YOLOv5: published table, fused; anchor-free: Ultralytics 8.4.190, unfused)")
    table, ok = format_table([measure(s, args.nc, args.imgsz) for s in names], args.tol)
    print(table)
    print("all within tolerance" if ok else "SOME MODELS OUTSIDE TOLERANCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
    sys.exit(main())
