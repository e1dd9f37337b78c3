#!/usr/bin/env python
"""GPU training throughput, side by side with Ultralytics 8.4.190: train and validation images/s,
the loader's share of a step, peak GPU memory and model-FLOP utilisation, for each model, at one or
more loader worker counts, for one or more configurations of ours.

    U=/work/ultra-venv/bin/python
    python bench/gpu_train.py --ultralytics-python $U                       # yolov5n yolov8n yolo11n, 640, batch 64
    python bench/gpu_train.py --ultralytics-python $U --models yolov8n yolo26n --epochs 3 --steps 60
    python bench/gpu_train.py --ultralytics-python $U --models yolov8n --workers 2 4 8 --cache ram \\
        --ours-variant cpu-aug="--augment-on workers" --ours-variant gpu-aug="--augment-on device"
    python bench/gpu_train.py --only ours --device cpu --models yolov8n --imgsz 64 --batch-size 4 \\
        --steps 4 --warmup 1 --n-val 8 --workers 0 1                        # CPU smoke run: not GPU figures

Without CUDA it refuses (one line, exit 2) unless --device cpu is given; a CPU run says that its
figures are not GPU figures.

What runs. For each model and each --workers count, every contender trains once, in this order:
each ours variant, then Ultralytics. A variant (--ours-variant NAME=FLAGS, repeatable) is one ours
configuration: FLAGS (shell-split) are appended to train.py's arguments and NAME labels its column;
with none given there is one variant, "ours", with no extra flags. FLAGS are checked against
train.py's parser before anything runs, and may not set what this script sets for both tools
(--cfg, --data, --imgsz, --batch-size, --val-batch-size, --epochs, --device, --workers, --seed and
the run folder): those would break the comparison or the figures.
--models: yolov5<size>[u], yolov8<size>, yolo11<size>, yolo26<size> (size n s m l x) and
yolov10<size> (n s m b l x); ours trains models/<name>.yaml through train.py's --cfg lookup (a
family file at that scale, e.g. yolo26.yaml at n, or yolov10n.yaml itself), Ultralytics its
built-in <name>.yaml.
--cache ram|disk caches decoded images in both tools (ours --cache, Ultralytics cache=); a variant
may pass its own --cache, which then wins for that variant.

How each tool runs. Both train the same images (each run its own copy: both write label caches),
from scratch, at the same image size, batch, epochs, seed and loader workers, validating after
every epoch at 2 x batch (Ultralytics' validation batch in training), with mosaic in every epoch
(ours: the sampler's mosaic_off_from_epoch cleared after build_training, as bench/train_speed.py
does; Ultralytics: close_mosaic=0; --no-mosaic leaves each tool's close_mosaic, which for runs this
short turns mosaic off from the start in both). Everything else is each tool's default (optimizer,
LR, Ultralytics' deterministic=True). Each tool runs its own entry point unchanged inside a small
timing shim (its own interpreter, a subprocess):
  ours         train.py's ``train.cli`` (so train.py's engine: build_training, run_epochs, AMP + GradScaler);
               the shim wraps the loop's module-level ``yolotrain.utils.engine.loop.fetch_batches`` (every batch:
               when the loop asked for it, when it got it) and ``yolotrain.utils.engine.loop.evaluate_model``
               (each validation), and ``train.build_training`` (FLOPs, precision).
  ultralytics  ``ultralytics.cfg.entrypoint`` (the ``yolo`` command) with device=0, in its own venv;
               callbacks on_train_epoch_start / on_train_batch_start / on_train_batch_end /
               on_train_epoch_end give the same per-batch stamps, BaseValidator.__call__ each
               validation (and the precision the validator recorded: ``args.quantize`` in 8.4,
               ``args.half`` before it). Its check_amp is replaced by "AMP as requested": the real
               check downloads yolo11n.pt, and the GPU machine is offline.
yolov5n: ours is the anchor-based YOLOv5 head; Ultralytics' yolov5n.yaml is its anchor-free "u" form
(--models yolov5nu trains that form on both sides). Every other name is the same architecture.

Figures (per model, worker count and contender):
  train img/s      steady state: images of the timed steps / their summed step times. A step's time
                   runs from the loop asking for its batch to the loop asking for the next one, so it
                   holds the loader wait, forward, loss, backward, optimizer step, EMA and logging.
                   Not timed: the first --warmup steps of every epoch (loader start-up, cuDNN autotune,
                   allocator) and each epoch's last step (a partial batch, the epoch's closing work).
  val img/s        validation images / seconds of the validation pass in training (the EMA model over
                   the val split, metrics included), mean over epochs 2.. (epoch 1's only with one
                   epoch). Its precision is printed: under AMP on CUDA ours runs fp16 weights,
                   Ultralytics 8.4 fp16 autocast over fp32 weights (older versions: fp16 weights).
  val ... ms/img   where a validation's time goes: each tool's own pre-process, inference and NMS
                   figures per image (ours: EvalResult.speed_ms; Ultralytics: its validator's speed),
                   and the rest of the pass from its wall time (loader waits, matching, metrics).
  data wait        time the training loop was blocked waiting for the loader / step time, over the
                   timed steps (host time: CUDA kernels queued before the wait still run during it).
                   Ours: of which the training process's own queuing of the next batch's copy to
                   the device and (--augment-on device) its drawing, inside the wait.
  fetched inside   ours: the share of the step time spent fetching the next batch and queuing its copy
                   and drawing from inside the step (DeviceFeed.ahead, while the device runs the step's
                   forward and backward): host time that the device's work can hide, not a wait.
  peak GPU MiB     torch.cuda.max_memory_allocated of the tool's process, read after every training
                   epoch and validation; the largest (tensors only, not the allocator's cache).
  peak RSS MiB     largest resident set of the tool's process or any loader worker it reaped (os.wait4).
  GFLOP/img        training FLOPs per image: 3 x the forward FLOPs thop counts at the trained size
                   (ours: Model.info's, as bench/train_speed.py; Ultralytics: its get_flops).
  MFU vendor       GFLOP/img x train img/s / the device's peak dense fp16/bf16 tensor throughput from
                   its vendor's datasheet (PEAK_TFLOPS, matched on torch.cuda.get_device_name; "-"
                   for a device not listed).
  MFU matmul       the same over the throughput of a large fp16 matmul (8192^3) timed in this run
                   before the models (CPU: fp32 2048^3): what the device delivers to a best case.
  ratio            variant / Ultralytics at the same worker count (img/s and MFU: > 1 ours faster;
                   data wait and memory: < 1 ours less).

The report, per model: the worker curve (one row per --workers count: each contender's train img/s
and data-wait share, and each variant's img/s ratio to Ultralytics; a line names any run whose
loader used another worker count than asked, e.g. Ultralytics on CPU, which forces 0), then the
full table of every figure at the largest worker count, with each contender's train and validation
precision. --json writes every figure of every run.

On a lent GPU machine (no internet there; the ``run`` tool copies this working tree, plus up to 8
ignored paths named in its carry list, 64 MiB in all):
  * Ultralytics' venv cannot be installed there from PyPI, and a CUDA torch wheel is far over 64 MiB.
    Use the machine's own torch: on this side ``pip download --no-deps ultralytics==8.4.190
    ultralytics-thop==2.2.3 -d wheels/`` (a few MiB; also any of its pure-Python requirements the GPU
    machine's python lacks: opencv-python-headless, pyyaml, matplotlib, pandas, polars, psutil, py-cpuinfo,
    requests, scipy), keep wheels/ ignored by git and carry it; there:
        python -m venv --system-site-packages /tmp/uv
        /tmp/uv/bin/pip install --no-index --find-links wheels ultralytics==8.4.190 ultralytics-thop==2.2.3
    then ``--ultralytics-python /tmp/uv/bin/python`` (system site packages give it the machine's torch).
  * The dataset: the built-in shapes generator needs nothing. bench/photo_dataset.py (real photos) is
    used when its package cache (--photo-cache, its .deb files) is here: carry that folder (it is
    tens of MiB), or carry a built dataset and pass --data.
  * ours needs only this repository and the machine's torch (+ this repo's requirements).
A run alone on the machine: the default (3 models, 2 epochs of 40 steps at batch 64, 640 px, one
worker count) takes a few minutes per model and contender; each extra worker count or variant
adds as many runs again.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.compare_ultralytics import copy_dataset, source_dataset, ultralytics_env, ultralytics_settings  # noqa: E402
from bench.compare_yolov5 import base_env, write_yaml  # noqa: E402
from bench.train_speed import _timed_rate  # noqa: E402
from yolotrain.utils.core.cli import IMGSZ, SEED, ArgumentParser, Range  # noqa: E402
from yolotrain.utils.core.errors import UserError  # noqa: E402

EXIT_NO_CUDA = 2
MODELS = re.compile(r"(yolov8|yolo11|yolo26)[nslmx]|yolov5[nslmx]u?|yolov10[nsmblx]")
ULTRALYTICS = "ultralytics"
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # also a folder name
# train.py destinations this script sets for both tools: a variant may not change them.
BENCH_SETS = ("cfg", "data", "imgsz", "batch_size", "val_batch_size", "epochs", "device", "workers", "seed",
              "project", "name", "exist_ok")
PHOTO_PACKAGES = ("tuxpaint-stamps-default", "tuxpaint-data", "mate-backgrounds", "plasma-workspace-wallpapers")

# Peak dense (no structured sparsity) fp16/bf16 tensor-core TFLOPS with fp32 accumulation, from the
# vendor's datasheets (the sparse figures there are twice these). First match on the device name wins.
PEAK_TFLOPS: list[tuple[str, float, str]] = [
    (r"H200 NVL", 835.5, "H200 NVL"),
    (r"H200", 989.5, "H200 SXM"),
    (r"H100 NVL", 835.5, "H100 NVL"),
    (r"H100 PCIe", 756.5, "H100 PCIe"),
    (r"H100", 989.5, "H100 SXM"),  # 'NVIDIA H100 80GB HBM3'
    (r"A100", 312.0, "A100 (SXM and PCIe)"),
    (r"\bL4\b", 121.0, "L4"),
    (r"\bT4\b", 65.0, "T4 (fp16 only)"),
    (r"RTX 4090(?! D)", 165.2, "GeForce RTX 4090 (330.3 with fp16 accumulation)"),
]

# Run by either interpreter: sys.argv = [shim, mode, out.json, ROOT, *tool arguments]. Writes per-epoch
# batch stamps (asked, got, end), validations (start, end, images) and facts as JSON.
SHIM = r'''
import json, sys, time
mode, out_path, root, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
epochs, vals, facts, feeds, aheads = [], [], {"peak_mem": 0}, [], []
now = time.perf_counter

def peak():
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        facts["peak_mem"] = max(facts["peak_mem"], torch.cuda.max_memory_allocated())

def save():
    peak()
    with open(out_path, "w") as f:
        json.dump({"epochs": epochs, "vals": vals, "facts": facts, "feeds": feeds, "aheads": aheads}, f)

if mode == "ours":
    sys.path.insert(0, root)
    mosaic, argv = argv[0] == "mosaic", argv[1:]
    sys.argv = ["train.py", *argv]
    from yolotrain.app import train
    from yolotrain.utils.data import device_feed
    from yolotrain.utils.engine import loop
    inner_build, inner_fetch, inner_eval = train.build_training, loop.fetch_batches, loop.evaluate_model
    inner_images = device_feed.batch_images
    def batch_images(*a, **k):  # the training process's own part of a wait: queuing a batch's copy and drawing
        t0 = now()
        out = inner_images(*a, **k)
        feeds.append((t0, now()))
        return out
    device_feed.batch_images = batch_images
    inner_ahead = device_feed.DeviceFeed.ahead
    def ahead(self):  # the next batch fetched and queued: inside the step when the loop asks, else in the wait
        t0 = now()
        inner_ahead(self)
        aheads.append((t0, now()))
    device_feed.DeviceFeed.ahead = ahead
    def build_training(*a, **k):
        t = inner_build(*a, **k)
        if mosaic:
            t.train_loader.sampler.load_state_dict({"mosaic_off_from_epoch": None})
        val_precision = ("fp16 weights" if t.device.type == "cuda" else "bf16 autocast") if t.val_half else "fp32"
        facts.update(gflops=t.model_info.gflops * (t.imgsz / t.cfg.imgsz) ** 2, amp=bool(t.amp),
                     val_precision=val_precision, workers=t.train_loader.num_workers, device=str(t.device))
        return t
    def fetch_batches(*a, **k):
        ep = {"asks": [], "gots": [], "end": None}
        epochs.append(ep)
        it = inner_fetch(*a, **k)
        while True:
            t0 = now()
            try:
                item = next(it)
            except StopIteration:
                ep["end"] = t0
                peak()
                return
            ep["asks"].append(t0)
            ep["gots"].append(now())
            yield item
    def evaluate_model(model, loader, *a, **k):
        t0 = now()
        out = inner_eval(model, loader, *a, **k)
        pre, inference, post = out.speed_ms
        vals.append({"start": t0, "end": now(), "n": len(loader.dataset),
                     "parts": {"pre": pre, "inference": inference, "post": post}})
        peak()
        return out
    train.build_training, loop.fetch_batches, loop.evaluate_model = build_training, fetch_batches, evaluate_model
    rc = train.cli(argv)
    save()
    sys.exit(rc)
elif mode == "ultralytics":
    amp, argv = argv[0] == "amp", argv[1:]
    sys.argv = ["yolo", *argv]  # before the import: ultralytics.utils keeps it as ARGV
    import ultralytics.engine.trainer as trainer_module
    trainer_module.check_amp = lambda model: amp  # the real check downloads yolo11n.pt
    from ultralytics.cfg import entrypoint
    from ultralytics.engine.validator import BaseValidator
    from ultralytics.utils.callbacks import base as callbacks
    from ultralytics.utils.torch_utils import get_flops
    inner_val = BaseValidator.__call__
    def precision_args(args):  # 8.4 records args.quantize, older versions args.half: whichever it has
        return {k: getattr(args, k) for k in ("quantize", "half") if hasattr(args, k)}
    def timed_val(self, *a, **k):
        t0 = now()
        out = inner_val(self, *a, **k)
        sp = getattr(self, "speed", {}) or {}
        vals.append({"start": t0, "end": now(), "n": len(self.dataloader.dataset),
                     "precision": precision_args(self.args),
                     "parts": {"pre": sp.get("preprocess", 0.0), "inference": sp.get("inference", 0.0),
                               "post": sp.get("postprocess", 0.0)}})
        peak()
        return out
    BaseValidator.__call__ = timed_val
    def epoch_start(tr):
        epochs.append({"asks": [now()], "gots": [], "end": None})
    def batch_start(tr):
        epochs[-1]["gots"].append(now())
    def batch_end(tr):
        epochs[-1]["asks"].append(now())
    def epoch_end(tr):
        ep = epochs[-1]
        ep["end"] = ep["asks"].pop()  # the last batch's end asks for nothing
        peak()
    def train_start(tr):
        facts.update(gflops=get_flops(tr.model, tr.args.imgsz), amp=bool(tr.amp), workers=tr.train_loader.num_workers,
                     device=str(tr.device))
    for event, fn in {"on_train_start": train_start, "on_train_epoch_start": epoch_start,
                      "on_train_batch_start": batch_start, "on_train_batch_end": batch_end,
                      "on_train_epoch_end": epoch_end}.items():
        callbacks.default_callbacks[event].append(fn)  # every trainer copies the defaults
    entrypoint()
    save()
else:
    raise SystemExit(f"unknown mode {mode}")
'''


class Contender(NamedTuple):
    """One column of the report: an ours variant (train.py plus its extra flags) or Ultralytics."""

    label: str
    tool: str  # the shim's mode: "ours" or "ultralytics"
    flags: tuple[str, ...] = ()


def model_name(text: str) -> str:
    """--models entry: a name both tools build (module docstring)."""
    if not MODELS.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected yolov5<size>, yolov5<size>u, yolov8<size>, yolo11<size>, "
                                         "yolo26<size> (size one of n s m l x) or yolov10<size> (n s m b l x)")
    return text


def ours_variant(text: str) -> Contender:
    """--ours-variant NAME=FLAGS: FLAGS shell-split, so quoted values survive; they may be empty."""
    name, sep, flags = text.partition("=")
    if not sep or not VARIANT_NAME.fullmatch(name) or name == ULTRALYTICS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=FLAGS, NAME of letters, digits, '_.+-' and not "
                                         f"{ULTRALYTICS!r}")
    try:
        return Contender(name, "ours", tuple(shlex.split(flags)))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", type=model_name, default=["yolov5n", "yolov8n", "yolo11n"])
    p.add_argument("--imgsz", type=IMGSZ, default=640)
    p.add_argument("--batch-size", type=Range(int, min=1), default=64, help="training batch (validation: 2x)")
    p.add_argument("--epochs", type=Range(int, min=1), default=2, help="training epochs of each tool")
    p.add_argument("--steps", type=Range(int, min=0), default=40,
                   help="steps per epoch: the training set is the first steps x batch images (0: all of --data)")
    p.add_argument("--warmup", type=Range(int, min=0), default=5, help="untimed steps at the start of every epoch")
    p.add_argument("--n-val", type=Range(int, min=0), default=500, help="validation images (0: all of --data)")
    p.add_argument("--data", default=None, help="dataset yaml (default: bench/photo_dataset.py when its package "
                   "cache is here, else the built-in shapes generator, at --imgsz)")
    p.add_argument("--photo-cache", default=str(Path(tempfile.gettempdir()) / "photo_dataset_cache"),
                   help="bench/photo_dataset.py's --cache (its .deb files)")
    p.add_argument("--ultralytics-python", default=None, help="python of the venv with ultralytics 8.4.190")
    p.add_argument("--only", choices=("ours", ULTRALYTICS), default=None, help="run one tool only")
    p.add_argument("--ours-variant", action="append", type=ours_variant, default=None, metavar="NAME=FLAGS",
                   help="an ours run labelled NAME with FLAGS appended to train.py's arguments; repeatable; "
                        "none given: one variant 'ours' with no extra flags")
    p.add_argument("--device", default="0", help="CUDA device index, or cpu for a smoke run (not GPU figures)")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="mixed precision for both (default: train.py's for the device: on with CUDA)")
    p.add_argument("--mosaic", action=argparse.BooleanOptionalAction, default=True,
                   help="mosaic in every epoch for both (--no-mosaic: each tool's close_mosaic)")
    p.add_argument("--workers", nargs="+", type=Range(int, min=0), default=[8],
                   help="loader worker counts: every contender trains once per count")
    p.add_argument("--cache", choices=("ram", "disk"), default=None,
                   help="cache decoded images in both tools (ours --cache, Ultralytics cache=)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--ref-seconds", type=Range(float, min=0.1), default=2.0, help="time spent timing the matmul")
    p.add_argument("--workdir", default=None, help="datasets, runs and logs (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the default temp work dir")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


def variant_problem(flags: tuple[str, ...]) -> str | None:
    """Why a variant's flags cannot run: train.py refuses them, or they set what this script sets for
    both tools; None when they are fine. Checked up front: a bad flag would otherwise fail mid-run."""
    from yolotrain.app import train

    p = train.build_parser()
    p.raise_errors = True
    unset = object()  # argparse only fills defaults that the namespace lacks: what stays unset, FLAGS left alone
    try:
        ns = p.parse_args(list(flags), namespace=argparse.Namespace(**dict.fromkeys(BENCH_SETS, unset)))
    except UserError as e:
        return f"train.py refuses them: {e}"
    flag = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}
    taken = [flag.get(d, d) for d in BENCH_SETS if getattr(ns, d) is not unset]
    if taken:
        return f"they set {', '.join(taken)}, which gpu_train.py sets for both tools"
    return None


def contenders(opt: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Contender]:
    """The report's columns in run order: the ours variants, then Ultralytics (as --only allows)."""
    variants = opt.ours_variant or [Contender("ours", "ours")]
    names = [v.label for v in variants]
    if len(set(names)) != len(names):
        parser.error(f"argument --ours-variant: names must differ, got {' '.join(names)}")
    for v in variants:
        problem = variant_problem(v.flags)
        if problem:
            parser.error(f"argument --ours-variant: {v.label}={shlex.join(v.flags)}: {problem}")
    ours = variants if opt.only in (None, "ours") else []
    return ours + ([Contender(ULTRALYTICS, ULTRALYTICS)] if opt.only in (None, ULTRALYTICS) else [])


def check_device(opt: argparse.Namespace) -> torch.device:
    """The device, or one line and exit 2 when CUDA is missing (a CPU run must be asked for)."""
    if opt.device == "cpu":
        return torch.device("cpu")
    if not opt.device.isdigit():
        print(f"gpu_train.py: --device {opt.device!r}: expected a CUDA index such as 0, or cpu", file=sys.stderr)
        raise SystemExit(EXIT_NO_CUDA)
    if not torch.cuda.is_available() or int(opt.device) >= torch.cuda.device_count():
        print(f"gpu_train.py: CUDA device {opt.device} is not available here (no GPU or no CUDA torch); "
              "--device cpu runs a smoke test whose figures are not GPU figures", file=sys.stderr)
        raise SystemExit(EXIT_NO_CUDA)
    return torch.device(f"cuda:{opt.device}")


# ---------------------------------------------------------------------------------------------- device peak


def vendor_peak(name: str) -> tuple[float, str] | None:
    """(TFLOPS, which card) from PEAK_TFLOPS for a torch.cuda.get_device_name, or None if not listed."""
    for pattern, tflops, label in PEAK_TFLOPS:
        if re.search(pattern, name):
            return tflops, label
    return None


def _matmul(n: int, dtype: torch.dtype, device: torch.device):
    """A function that multiplies two random n x n matrices (freed with the function)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return lambda: a @ b


@torch.no_grad()
def matmul_peak(device: torch.device, seconds: float) -> tuple[float, str]:
    """FLOP/s of a large matmul on ``device`` (CUDA: fp16 8192^3; CPU: fp32 2048^3), best window."""
    cuda = device.type == "cuda"
    n, dtype = (8192, torch.float16) if cuda else (2048, torch.float32)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    rate = _timed_rate(_matmul(n, dtype, device), 2.0 * n ** 3, seconds, sync)
    if cuda:
        torch.cuda.empty_cache()  # the tools run in their own processes; give the memory back
    return rate, f"{'fp16' if cuda else 'fp32'} {n}^3 matmul"


# ---------------------------------------------------------------------------------------------- data


def photo_cache_ready(cache: Path) -> bool:
    """bench/photo_dataset.py can build offline: every package's .deb is in its cache."""
    return all(any((cache / "debs").glob(f"{p}_*.deb")) for p in PHOTO_PACKAGES)


def source_yaml(opt: argparse.Namespace, work: Path) -> tuple[Path, str]:
    """The dataset both tools copy from, and its description: --data, else a photo or shapes set at --imgsz."""
    n_train = opt.steps * opt.batch_size or 1000
    n_val = opt.n_val or 200
    if opt.data:
        return Path(opt.data), opt.data
    cache = Path(opt.photo_cache)
    if (ROOT / "bench" / "photo_dataset.py").is_file() and photo_cache_ready(cache):
        out = work / "source" / "photo"
        cmd = [sys.executable, str(ROOT / "bench" / "photo_dataset.py"), "--out", str(out), "--n-train", str(n_train),
               "--n-val", str(n_val), "--imgsz", str(opt.imgsz), "--seed", str(opt.seed), "--cache", str(cache)]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return out / "data.yaml", f"photo_dataset.py, {n_train} train / {n_val} val"
    names = ["circle", "square", "triangle", "star", "cross", "ring"]
    yaml_file = write_yaml(work / "source" / "shapes.yaml", {
        "path": str(work / "source" / "shapes"), "train": "images/train", "val": "images/val",
        "names": dict(enumerate(names)), "generate": "shapes",
        "generate_args": {"seed": opt.seed, "n_train": n_train, "n_val": n_val, "img_size": opt.imgsz}})
    return yaml_file, f"built-in shapes, {n_train} train / {n_val} val"


# ---------------------------------------------------------------------------------------------- running


def ultralytics_args(model: str, opt: argparse.Namespace, workers: int, dev: str, data: Path,
                     project: Path) -> list[str]:
    """Ultralytics' shim mode flag (AMP as requested) and its ``yolo`` arguments."""
    amp = opt.amp if opt.amp is not None else dev != "cpu"
    yaml_name = model[:-1] if model.startswith("yolov5") and model.endswith("u") else model  # its v5 is 'u'
    return ["amp" if amp else "no-amp", "detect", "train", f"model={yaml_name}.yaml", "pretrained=False",
            f"data={data}", f"imgsz={opt.imgsz}", f"batch={opt.batch_size}", f"epochs={opt.epochs}",
            f"device={dev}", f"workers={workers}", f"seed={opt.seed}", f"amp={amp}", "plots=False",
            "exist_ok=True", f"project={project}", "name=train", *(["close_mosaic=0"] if opt.mosaic else []),
            *([f"cache={opt.cache}"] if opt.cache else [])]


def ours_args(model: str, opt: argparse.Namespace, workers: int, dev: str, data: Path, project: Path,
              flags: tuple[str, ...]) -> list[str]:
    """Our shim mode flag (mosaic or not) and train.py's arguments, the variant's flags last so they win."""
    return ["mosaic" if opt.mosaic else "no-mosaic", "--cfg", str(ROOT / "models" / f"{model}.yaml"),
            "--data", str(data), "--imgsz", str(opt.imgsz), "--batch-size", str(opt.batch_size),
            "--val-batch-size", str(2 * opt.batch_size), "--epochs", str(opt.epochs), "--device", dev,
            "--workers", str(workers), "--seed", str(opt.seed), "--noplots", "--project", str(project),
            "--name", "train", "--exist-ok", *([] if opt.amp is None else ["--amp" if opt.amp else "--no-amp"]),
            *(["--cache", opt.cache] if opt.cache else []), *flags]


def run_shim(python: str, mode: str, args: list[str], env: dict[str, str], folder: Path) -> dict:
    """Run one tool under the shim in ``folder``; its stamps and facts plus peak RSS, or exit with its log."""
    folder.mkdir(parents=True, exist_ok=True)
    shim, out, log = folder / "gpu_shim.py", folder / f"{mode}.json", folder / f"{mode}.log"
    shim.write_text(SHIM)
    cmd = [python, str(shim), mode, str(out), str(ROOT), *args]
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=folder, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    if rc or not out.exists():
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"{mode} failed (exit {rc}); log: {log}")
    run = json.loads(out.read_text())
    run["peak_rss_mib"] = usage.ru_maxrss / 1024  # Linux: KiB
    return run


def step_figures(epochs: list[dict], warmup: int, batch: int, feeds: list | None = None,
                 aheads: list | None = None) -> dict[str, float | None]:
    """Steady train img/s and data-wait share over the timed steps (docstring: "train img/s"), the share
    of the waits spent queuing the next batch's copy and drawing (``feeds``: ours' (start, end) of each),
    and the share of the steps' own time spent fetching the next batch (``aheads``: DeviceFeed.ahead's)."""
    images, seconds, wait, steps, windows, inside = 0, 0.0, 0.0, 0, [], []
    for ep in epochs:
        asks, gots = ep["asks"], ep["gots"]
        if ep["end"] is None or len(asks) != len(gots):
            continue  # an epoch cut short: no end stamp
        ends = asks[1:] + [ep["end"]]
        for k in range(warmup, len(asks) - 1):  # not the epoch's last step
            seconds += ends[k] - asks[k]
            wait += gots[k] - asks[k]
            windows.append((asks[k], gots[k]))
            inside.append((gots[k], ends[k]))
            images, steps = images + batch, steps + 1
    if not steps:
        raise SystemExit(f"no timed steps: each epoch needs more than --warmup {warmup} + 1 steps (raise --steps)")
    feed, ahead = overlap(feeds, windows), overlap(aheads, inside)
    return {"train_img_s": images / seconds, "data_wait": wait / seconds, "timed_steps": steps,
            "feed_wait": feed / seconds if feeds else None, "ahead_share": ahead / seconds if aheads else None}


def overlap(spans: list | None, windows: list[tuple[float, float]]) -> float:
    """Seconds of ``spans`` ((start, end) pairs) that fall inside ``windows``."""
    return sum(min(b, e) - max(a, s) for s, e in spans or () for a, b in windows if s < b and a < e)


def training_vals(vals: list[dict], epochs: list[dict]) -> list[dict]:
    """The validation that follows each finished epoch; epochs 2.. when there are several (epoch 1's
    holds start-up). Ultralytics' final validation of best.pt comes after the last one: left out."""
    ends = [ep["end"] for ep in epochs if ep["end"] is not None]
    per_epoch = []
    for k, end in enumerate(ends):
        nxt = ends[k + 1] if k + 1 < len(ends) else float("inf")
        match = [v for v in vals if end <= v["start"] < nxt]
        if match:
            per_epoch.append(match[0])
    return per_epoch[1:] if len(per_epoch) > 1 else per_epoch


def val_figures(vals: list[dict], epochs: list[dict]) -> float:
    """Validation img/s in training over training_vals (NaN when there was none)."""
    use = training_vals(vals, epochs)
    return sum(v["n"] for v in use) / sum(v["end"] - v["start"] for v in use) if use else float("nan")


def val_parts(vals: list[dict], epochs: list[dict]) -> dict[str, float]:
    """Where a validation's time goes, ms per image, over training_vals: each tool's own pre-process,
    inference and post-process (NMS) figures, and the rest of the pass (loader waits, matching,
    metrics, set-up) from its wall time. Empty when the tool recorded none."""
    use = [v for v in training_vals(vals, epochs) if v.get("parts")]
    if not use:
        return {}
    out = {k: sum(v["parts"][k] for v in use) / len(use) for k in ("pre", "inference", "post")}
    wall = sum(1e3 * (v["end"] - v["start"]) / max(v["n"], 1) for v in use) / len(use)
    out["other"] = wall - sum(out.values())
    return out


def ultralytics_val_precision(recorded: dict[str, Any]) -> str:
    """Ultralytics' validation precision from what its validator recorded: 8.4's ``quantize`` (16 in
    training: fp16 autocast over fp32 weights), else older versions' ``half`` (fp16 weights)."""
    if "quantize" in recorded:
        q = recorded["quantize"]
        return "fp32" if q in (None, 32) else "fp16 autocast" if q == 16 else f"quantize={q}"
    return "fp16 weights" if recorded.get("half") else "fp32"


def val_precision(tool: str, run: dict) -> str:
    """The precision of the validations val img/s counts ("-" when none ran)."""
    if tool == "ours":
        return run["facts"].get("val_precision", "-")
    used = training_vals(run["vals"], run["epochs"])
    return ", ".join(sorted({ultralytics_val_precision(v.get("precision", {})) for v in used})) or "-"


def run_tool(c: Contender, model: str, workers: int, opt: argparse.Namespace, device: torch.device, work: Path,
             source: tuple[dict, list[str]]) -> dict[str, Any]:
    """Train one model with one contender at one worker count, on a fresh dataset copy; its figures (before MFU)."""
    base = work / model / f"workers{workers}" / c.label
    splits, names = source
    data = copy_dataset(splits, names, base / "data", {"train": opt.steps * opt.batch_size, "val": opt.n_val})
    dev = "cpu" if device.type == "cpu" else str(device.index)
    if c.tool == ULTRALYTICS:
        python, env = opt.ultralytics_python, ultralytics_env(work)
        args = ultralytics_args(model, opt, workers, dev, data, base / "runs")
    else:
        python, env = sys.executable, base_env()
        args = ours_args(model, opt, workers, dev, data, base / "runs", c.flags)
    run = run_shim(python, c.tool, args, env, base)
    facts = run["facts"]
    out = step_figures(run["epochs"], opt.warmup, opt.batch_size, run.get("feeds"), run.get("aheads"))
    gpu_mib = facts["peak_mem"] / 2 ** 20 if device.type == "cuda" else None
    parts = val_parts(run["vals"], run["epochs"])
    out.update({f"val_{k}_ms": v for k, v in parts.items()})
    out.update(val_img_s=val_figures(run["vals"], run["epochs"]), peak_gpu_mib=gpu_mib,
               peak_rss_mib=run["peak_rss_mib"], train_gflops_per_img=3 * facts.get("gflops", 0.0),
               amp=facts.get("amp"), workers=facts.get("workers"), ran_on=facts.get("device"),
               val_precision=val_precision(c.tool, run), tool=c.tool, flags=list(c.flags))
    return out


# ---------------------------------------------------------------------------------------------- report


def add_mfu(r: dict[str, Any], vendor_tflops: float | None, matmul_flops: float) -> None:
    """MFU against the vendor peak (when the device is listed) and against the measured matmul."""
    achieved = r["train_gflops_per_img"] * 1e9 * r["train_img_s"]
    r["achieved_tflops"] = achieved / 1e12
    r["mfu_vendor"] = achieved / (vendor_tflops * 1e12) if vendor_tflops else None
    r["mfu_matmul"] = achieved / matmul_flops if matmul_flops else None


ROWS = [  # (label, key, format, ratio shown)
    ("train img/s (steady)", "train_img_s", "{:.1f}", True),
    ("val img/s (in training)", "val_img_s", "{:.1f}", True),
    ("  val pre-process ms/img", "val_pre_ms", "{:.2f}", True),
    ("  val inference ms/img", "val_inference_ms", "{:.2f}", True),
    ("  val NMS ms/img", "val_post_ms", "{:.2f}", True),
    ("  val rest ms/img", "val_other_ms", "{:.2f}", True),
    ("data wait, share of step", "data_wait", "{:.1%}", True),
    ("  of which: queuing copy + drawing", "feed_wait", "{:.1%}", False),
    ("next batch fetched inside the step", "ahead_share", "{:.1%}", False),
    ("peak GPU MiB (allocated)", "peak_gpu_mib", "{:.0f}", True),
    ("peak RSS MiB (host)", "peak_rss_mib", "{:.0f}", True),
    ("train GFLOP/img (3 x fwd)", "train_gflops_per_img", "{:.2f}", False),
    ("achieved TFLOP/s", "achieved_tflops", "{:.3g}", True),
    ("MFU vs vendor peak", "mfu_vendor", "{:.1%}", True),
    ("MFU vs measured matmul", "mfu_matmul", "{:.1%}", True),
    ("timed steps", "timed_steps", "{}", False),
]


def cell(v: Any, fmt: str) -> str:
    """A figure as printed: "-" for none or NaN."""
    return "-" if v is None or v != v else fmt.format(v)  # v != v: NaN


def ratio(a: Any, b: Any) -> str:
    """a / b as "1.23x", "" when either is missing, NaN or b is zero."""
    return f"{a / b:.2f}x" if a is not None and b and a == a and b == b else ""


def curve(res: dict[int, dict[str, dict]]) -> list[str]:
    """The worker curve: per worker count, each contender's train img/s (data wait) and each variant's
    img/s over Ultralytics'; then which runs' loaders used another worker count than asked."""
    labels = list(next(iter(res.values())))
    ultra = ULTRALYTICS in labels
    widths = {k: max(16, len(k)) + (7 if ultra and k != ULTRALYTICS else 0) + 2 for k in labels}
    lines = ["  " + f"{'workers':>7}" + "".join(f"{k:>{widths[k]}}" for k in labels)]
    for w, row in res.items():
        cells = []
        for k in labels:
            r = row[k]
            text = f"{cell(r['train_img_s'], '{:.1f}')} ({cell(r['data_wait'], '{:.1%}')})"
            if ultra and k != ULTRALYTICS:
                text += f"{ratio(r['train_img_s'], row[ULTRALYTICS]['train_img_s']):>7}"
            cells.append(f"{text:>{widths[k]}}")
        lines.append(f"  {w:>7}" + "".join(cells))
    for k in labels:
        off = [f"{row[k]['workers']} for {w}" for w, row in res.items() if row[k]["workers"] not in (None, w)]
        if off:
            lines.append(f"  {k} used other loader worker counts than asked: {', '.join(off)}")
    return lines


def table(res: dict[str, dict], device: torch.device) -> list[str]:
    """Every figure of one worker count: the contenders side by side, then each variant / Ultralytics."""
    labels = list(res)
    variants = [k for k in labels if k != ULTRALYTICS] if ULTRALYTICS in labels else []
    heads = labels + [f"{k}/ultra" for k in variants]
    widths = [max(12, len(h) + 2) for h in heads]
    lines = ["  " + f"{'':<28}" + "".join(f"{h:>{n}}" for h, n in zip(heads, widths))]
    for name, key, fmt, shows_ratio in ROWS:
        values = [res[k].get(key) for k in labels]
        ratios = [ratio(res[k].get(key), res[ULTRALYTICS].get(key)) if shows_ratio else "" for k in variants]
        cells = [cell(v, fmt) for v in values] + ratios
        lines.append(f"  {name:<28}" + "".join(f"{c:>{n}}" for c, n in zip(cells, widths)))
    for k, r in res.items():
        prec = "fp16 AMP" if r["amp"] and device.type == "cuda" else ("bf16 autocast" if r["amp"] else "fp32")
        flags = f", flags {shlex.join(r['flags'])}" if r.get("flags") else ""
        lines.append(f"  {k}: train {prec}, validation {r['val_precision']}, {r['workers']} loader workers, "
                     f"on {r['ran_on']}{flags}")
    return lines


def report(model: str, res: dict[int, dict[str, dict]], device: torch.device) -> str:
    """One model: the worker curve, then every figure at the largest worker count."""
    top = max(res)
    ultra = ULTRALYTICS in res[top]
    lines = [f"{model}: train img/s (data wait) per loader worker count"
             + (", x: variant / Ultralytics img/s" if ultra else ""), *curve(res),
             f"{model}, every figure at --workers {top}:", *table(res[top], device)]
    if model.startswith("yolov5") and not model.endswith("u") and ultra:
        lines.append(f"  {model}: ours anchor-based, Ultralytics' {model}.yaml anchor-free ('u'): not the same network")
    return "\n".join(lines)


def device_header(device: torch.device, opt: argparse.Namespace) -> tuple[float | None, float, list[str]]:
    """Vendor peak (TFLOPS or None), measured matmul FLOP/s, and the lines that describe the device."""
    mm, what = matmul_peak(device, opt.ref_seconds)
    if device.type == "cpu":
        return None, mm, ["CPU RUN (--device cpu): smoke figures, NOT GPU figures; no vendor peak, no GPU memory.",
                          f"measured {what}: {mm / 1e9:.1f} GFLOP/s"]
    name = torch.cuda.get_device_name(device)
    peak = vendor_peak(name)
    vendor = (f"vendor peak {peak[0]:g} TFLOPS dense fp16/bf16 ({peak[1]})" if peak
              else "not in PEAK_TFLOPS: no vendor MFU")
    return (peak[0] if peak else None), mm, [f"device {name}: {vendor}; measured {what}: {mm / 1e12:.1f} TFLOPS"]


def run_all(opt: argparse.Namespace, runs: list[Contender], device: torch.device, work: Path,
            source: tuple[dict, list[str]], vendor: float | None, mm: float,
            header: list[str]) -> dict[str, dict[int, dict[str, dict]]]:
    """Every model x worker count x contender, in that nesting: results[model][workers][label]. Each run's
    main figures are printed, and --json rewritten, as soon as it ends: a run cut short by a time limit
    (a lent GPU's) still leaves the runs before it."""
    results: dict[str, dict[int, dict[str, dict]]] = {}
    for model in opt.models:
        for workers in opt.workers:
            row = results.setdefault(model, {}).setdefault(workers, {})
            for c in runs:
                row[c.label] = r = run_tool(c, model, workers, opt, device, work, source)
                add_mfu(r, vendor, mm)
                print(f"done: {model} {c.label} workers {workers}: train {r['train_img_s']:.1f} img/s, data wait "
                      f"{r['data_wait']:.1%}, val {r['val_img_s']:.1f} img/s", flush=True)
                if opt.json:
                    Path(opt.json).write_text(json.dumps({"device": header, "results": results}, indent=1))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    opt = parser.parse_args(argv)
    opt.workers = list(dict.fromkeys(opt.workers))  # a count given twice runs once
    runs = contenders(opt, parser)
    device = check_device(opt)
    if opt.only != "ours" and not (opt.ultralytics_python and Path(opt.ultralytics_python).is_file()):
        raise SystemExit("--ultralytics-python: the Ultralytics venv's python is needed (or --only ours); "
                         "see this script's docstring")
    work = Path(opt.workdir) if opt.workdir else Path(tempfile.mkdtemp(prefix="gpu_train_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        vendor, mm, header = device_header(device, opt)
        if opt.only != "ours":
            ultralytics_settings(opt.ultralytics_python, work)
        data, described = source_yaml(opt, work)
        results = run_all(opt, runs, device, work, source_dataset(str(data)), vendor, mm, header)
        print(f"\n{time.strftime('%Y-%m-%d')}, {described}, {opt.imgsz}px, batch {opt.batch_size}, {opt.epochs} "
              f"epoch(s) of {opt.steps or 'all'} steps, {opt.warmup} warm-up steps per epoch untimed, mosaic "
              f"{'every epoch' if opt.mosaic else 'per close_mosaic'}, cache {opt.cache or 'off'}, seed {opt.seed}")
        print("\n".join(header))
        for model, res in results.items():
            print(report(model, res, device))
        if opt.only is None:
            print("ratio, x: variant / Ultralytics at the same worker count (img/s, TFLOP/s, MFU: > 1 ours faster; "
                  "wait and memory: < 1 ours less)")
        if opt.json:
            Path(opt.json).write_text(json.dumps({"device": header, "results": results}, indent=1))
    finally:
        if opt.workdir is None and not opt.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
