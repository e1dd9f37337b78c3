#!/usr/bin/env python
"""Bit-identity of training across two checkouts: a refactoring must not change what a run computes.

    python bench/identity.py --out /tmp/after.json                         # this checkout
    python bench/identity.py --repo /path/to/old/checkout --out /tmp/before.json
    python bench/identity.py --compare /tmp/before.json /tmp/after.json

Each checkout trains the same explicit-flag runs on a tiny generated shapes set (16 train / 8 val
images at 96 px, --imgsz 64, batch 4, 3 epochs, seed 5, one loader worker):

  v5n-sgd      yolov5n with --optimizer SGD (anchor head, YOLOv5's recipe)
  v8n-adamw    yolov8n with --optimizer auto (the short-run AdamW recipe, a step every 16 images)
  v8n-ddp2     yolov8n under torchrun, 2 processes (gloo)
  v8n-resume   yolov8n with --save-interval 1e-9, rank 0 killed (os._exit) right after the mid-epoch
               last.pt of epoch 2 batch 2 (tests/scripts/die_after_save.py), then --resume of it
  v8n-time     yolov8n with --time 1e-5 hours: the budget ends the run after its first epoch, with
               the LR schedule and close_mosaic refitted
  v8n-nan      yolov8n with --nan-recover 2 and a NaN gradient injected at backward calls 3 and 7
               (tests/scripts/nan_grad.py): two rollbacks
  v8n-micro64  yolov8n at --batch-size 64 on a 128-image set (2 batches an epoch): the short-run AdamW's
               micro-steps, four optimizer steps of 16 images per batch
  v8n-gpu64    v8n-micro64 with --micro-steps off --augment-on device: the path a GPU user's default takes
               (one AdamW step per batch of 64, the augmented pixels drawn by the training device), on a CPU;
               both flags exist since e10adea (2026-11-27), so a --repo from then on runs it

and records, for last.pt and best.pt, a SHA-256 of every tensor under model, ema and optimizer,
the epoch, the metrics dict, and results.csv's text. --compare prints each difference and exits 1
if there is any.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
ARGS = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "1", "--seed", "5",
        "--epochs", "3", "--noplots"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
DATA = ("path: shapes\ntrain: images/train\nval: images/val\n"
        "names: {0: circle, 1: square, 2: triangle, 3: star, 4: cross, 5: ring}\n"
        "generate: shapes\ngenerate_args: {seed: 1, n_train: 16, n_val: 8, img_size: 96}\n")
LARGE = DATA.replace("n_train: 16", "n_train: 128").replace("path: shapes", "path: shapes128")  # {large}


def runs(v5n: str, v8n: str) -> dict[str, list[tuple[list[str], list[str], bool]]]:
    """Run name -> the commands it takes: (launcher + script, arguments, may exit non-zero)."""
    py, die, nan = [sys.executable], "tests/scripts/die_after_save.py", "tests/scripts/nan_grad.py"
    return {
        "v5n-sgd": [([*py, "train.py"], ["--cfg", v5n, "--optimizer", "SGD"], False)],
        "v8n-adamw": [([*py, "train.py"], ["--cfg", v8n], False)],
        "v8n-ddp2": [([*TORCHRUN, "train.py"], ["--cfg", v8n], False)],
        "v8n-resume": [([*py, die, "--die-at", "2:2"], ["--cfg", v8n, "--save-interval", "1e-9"], True),
                       ([*py, "train.py"], ["--resume", "{last}"], False)],
        "v8n-time": [([*py, "train.py"], ["--cfg", v8n, "--time", "1e-5"], False)],
        "v8n-nan": [([*py, nan, "3,7"], ["--cfg", v8n, "--nan-recover", "2"], False)],
        "v8n-micro64": [([*py, "train.py"], ["--cfg", v8n, "--data", "{large}", "--batch-size", "64",
                                              "--val-batch-size", "16"], False)],
        "v8n-gpu64": [([*py, "train.py"], ["--cfg", v8n, "--data", "{large}", "--batch-size", "64",
                                            "--val-batch-size", "16", "--micro-steps", "off",
                                            "--augment-on", "device"], False)],
    }


def env(repo: Path) -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(k, None)
    return e


def tensor_digest(obj, prefix: str = "") -> dict[str, str]:
    """Name -> SHA-256 of the bytes of every tensor in a nested dict/list."""
    out: dict[str, str] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        out[prefix] = hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensor_digest(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensor_digest(v, f"{prefix}/{i}"))
    return out


def digest_run(folder: Path) -> dict:
    out: dict = {"results.csv": (folder / "results.csv").read_text()}
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(folder / "weights" / name, weights_only=True)
        out[name] = {"epoch": ckpt["epoch"], "metrics": ckpt.get("metrics"),
                     "tensors": tensor_digest({k: ckpt.get(k) for k in ("model", "ema", "optimizer")})}
    return out


def measure(repo: Path, work: Path, only: list[str] | None) -> dict:
    data, large = work / "tiny.yaml", work / "large.yaml"
    data.write_text(DATA)
    large.write_text(LARGE)
    results = {}
    for name, steps in runs(str(repo / "models" / "yolov5n.yaml"), str(repo / "models" / "yolov8n.yaml")).items():
        if only and name not in only:
            continue
        folder = work / "runs" / name
        for launcher, args, may_fail in steps:
            args = [a.replace("{last}", str(folder / "weights" / "last.pt")).replace("{large}", str(large))
                    for a in args]
            cmd = [*launcher, "--data", str(data), "--project", str(work / "runs"), "--name", name, "--exist-ok",
                   *ARGS, *args]
            p = subprocess.run(cmd, cwd=repo, env=env(repo), capture_output=True, text=True, timeout=900)
            if p.returncode and not may_fail:
                sys.exit(f"{name}: {' '.join(cmd)} exited {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
        results[name] = digest_run(folder)
        print(f"{name}: done", flush=True)
    return results


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for run in sorted(set(a) | set(b)):
        if run not in a or run not in b:
            diffs.append(f"{run}: only in {'the first' if run in a else 'the second'}")
            continue
        ra, rb = a[run], b[run]
        if ra["results.csv"] != rb["results.csv"]:
            diffs.append(f"{run}: results.csv differs")
        for f in ("last.pt", "best.pt"):
            for key in ("epoch", "metrics"):
                if ra[f][key] != rb[f][key]:
                    diffs.append(f"{run} {f}: {key} {ra[f][key]} != {rb[f][key]}")
            ta, tb = ra[f]["tensors"], rb[f]["tensors"]
            differing = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
            if differing:
                diffs.append(f"{run} {f}: {len(differing)} of {len(ta)} tensors differ, e.g. {differing[:3]}")
    return diffs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--repo", default=str(HERE), help="the checkout to train with")
    p.add_argument("--out", help="write the digests here (json)")
    p.add_argument("--only", nargs="+", help="run only these (names above)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files")
    opt = p.parse_args()
    if opt.compare:
        a, b = (json.loads(Path(f).read_text()) for f in opt.compare)
        diffs = compare(a, b)
        print("\n".join(diffs) if diffs else f"identical: {', '.join(sorted(set(a) & set(b)))} "
              f"(last.pt and best.pt tensors, epoch, metrics; results.csv)")
        sys.exit(1 if diffs else 0)
    with tempfile.TemporaryDirectory(prefix="identity-") as tmp:
        unknown = sorted(set(opt.only or ()) - set(runs("", "")))
        if unknown:
            raise SystemExit(f"identity.py: --only {' '.join(unknown)}: no such run (the runs: "
                             f"{', '.join(runs('', ''))})")
        results = measure(Path(opt.repo).resolve(), Path(tmp), opt.only)
    text = json.dumps(results, indent=1, sort_keys=True)
    if opt.out:
        Path(opt.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
