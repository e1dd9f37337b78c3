#!/usr/bin/env python
"""Two trainings on one machine: each one's wall time beside the other, against one run alone.

    python bench/shared_cores.py                                   # 3 epochs of the built-in set at 256 px
    python bench/shared_cores.py --data my.yaml --imgsz 320 --epochs 2 --stagger 10

Runs train.py as a user does (its own process), the second run started --stagger seconds after
the first, each printed as it ends:

  alone    one run, default threads
  whole    two runs, each with --threads <usable cores>: every job sizes its thread pool for the
           whole machine (what two jobs that do not know of each other do)
  default  two runs with the default threads: the second takes the cores the first leaves
           (utils/core/cores.py), at least one
  even     two runs with --threads <cores / 2> each, as docs/training.md advises

Two runs sharing two cores fairly take about twice as long each; far beyond that is the cores
fighting.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from yolotrain.utils.core.cpu import usable_cpus  # noqa: E402


MODES = ("alone", "whole", "default", "even")


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"), help="dataset yaml")
    p.add_argument("--cfg", default="yolov8n.yaml", help="model yaml")
    p.add_argument("--imgsz", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--stagger", type=float, default=5.0, help="seconds between the two starts")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train.py flags, last")
    return p.parse_args(argv)


def command(opt: argparse.Namespace, project: Path, name: str, threads: int = 0) -> list[str]:
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", opt.data, "--cfg", opt.cfg, "--imgsz", str(opt.imgsz),
           "--epochs", str(opt.epochs), "--batch-size", str(opt.batch_size), "--noplots", "--project", str(project),
           "--name", name, "--seed", "0", *opt.extra]
    return cmd + (["--threads", str(threads)] if threads else [])


def run_together(cmds: list[list[str]], stagger: float) -> list[float]:
    """Start each command ``stagger`` s after the previous; each one's wall time from its own start."""
    procs, starts, ends = [], [], {}
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each mode sets the threads it means
    for k, cmd in enumerate(cmds):
        if k:
            time.sleep(stagger)
        starts.append(time.perf_counter())
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env=env))
    while len(ends) < len(procs):
        for k, p in enumerate(procs):
            if k not in ends and p.poll() is not None:
                ends[k] = time.perf_counter()
                if p.returncode:
                    raise SystemExit(f"train.py failed ({p.returncode}): {' '.join(cmds[k])}\n{p.stderr.read()[-2000:]}")
        time.sleep(0.05)
    return [ends[k] - starts[k] for k in range(len(procs))]


def main(opt: argparse.Namespace) -> None:
    cores = usable_cpus()
    print(f"{cores} usable cores; train.py --imgsz {opt.imgsz} --epochs {opt.epochs} --batch-size {opt.batch_size} "
          f"on {opt.data}; second run {opt.stagger:g} s after the first", flush=True)
    alone = None
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        for mode in opt.modes:
            if mode == "alone":
                (alone,) = run_together([command(opt, project, "alone")], 0)
                print(f"alone   {alone:7.1f} s", flush=True)
                continue
            threads = {"whole": cores, "default": 0, "even": max(1, cores // 2)}[mode]
            walls = run_together([command(opt, project, f"{mode}{k}", threads) for k in (1, 2)], opt.stagger)
            ratios = "" if alone is None else "  (" + ", ".join(f"{w / alone:.2f}x" for w in walls) + " alone)"
            print(f"{mode:7s} {walls[0]:7.1f} s first, {walls[1]:7.1f} s second{ratios}", flush=True)


if __name__ == "__main__":
    main(parse_opt())
