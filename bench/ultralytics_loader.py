#!/usr/bin/env python
"""Ultralytics' own training data loader, measured the way its DetectionTrainer builds it, so that
bench/loader_speed.py's figures for ours can be printed next to it.

    U=/work/ultra-venv/bin/python          # the venv holding ultralytics (8.4.190); never this repo's
    $U bench/ultralytics_loader.py --data /work/photo640/data.yaml --imgsz 640 --batch 16 \
        --workers 0 1 2 --batches 10 --warmup 2 --seed 0 --json out.json

Run by the Ultralytics venv's interpreter: it imports ultralytics, never yolotrain (its module level
imports only the standard library, so this repo's tests can load build_parser()). Unless already
set, it points YOLO_CONFIG_DIR / MPLCONFIGDIR at scratch dirs and sets YOLO_OFFLINE=1 and
YOLO_AUTOINSTALL=false (shared/notes/running-ultralytics-offline.md).

What it builds, as DetectionTrainer.get_dataloader(mode='train') does: the train split through
build_yolo_dataset(cfg, path, batch, data, mode='train', rect=False, stride=32) with cfg = its
default.yaml plus --imgsz/--batch/--hyp, then build_dataloader(dataset, batch, workers,
shuffle=True, rank=-1, drop_last=False, device=--device). Seeds as its trainer: init_seeds(seed,
deterministic=True); torch threads as its select_device on CPU (its NUM_THREADS) unless --threads.
Its trainer forces workers=0 on CPU; calling build_dataloader directly bypasses that, and its own
cap min(cpu_count // GPUs, workers, batches per epoch) is reported, not patched: 'effective' is
the loader's num_workers. Ultralytics writes labels/*.cache next to the labels, so the split is
mirrored into a scratch dir (images symlinked, labels copied) unless --inplace.

Measurements, all inside epoch 0 (fresh dataset, empty mosaic buffer; --batches is cut to fit):
  rates     per worker count: images/s over --batches batches after --warmup batches (the first
            batch includes worker start-up; its time is reported apart). The warm-up is raised to
            the effective worker count: W workers deliver their first batches at about the same time.
  stages    workers 0, in-process: every transform of dataset.transforms (Mosaic, CopyPaste,
            RandomPerspective, MixUp, CutMix, Albumentations, RandomHSV, RandomFlip x2, Format) is
            wrapped with a timer, as are get_image_and_label, load_image, its imread and the
            collate_fn; plus the trainer's preprocess_batch (to device, float()/255). Times nest
            (Mosaic includes its partners' get_image_and_label), so both totals and exclusive
            parts are reported, in ms per sample.
  decodes   imread calls per sample in the timed in-process window, and (cheap, imread faked)
            per epoch over --sim-epochs epochs for each worker count, since its buffer of recent
            images also serves the sample's own image in later epochs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from ultralytics.data.build import InfiniteDataLoader
    from ultralytics.data.dataset import YOLODataset

FLIP_NAMES = {"vertical": "RandomFlip(vertical)", "horizontal": "RandomFlip(horizontal)"}
# Ultralytics stage -> our stage names (bench/loader_speed.py), with what each bundles.
STAGE_MAP = {
    "imread": "read/decode (np.fromfile + cv2.imdecode)",
    "load_image-imread": "read/decode: resize long side to imgsz (skipped if equal) + .npy stat + buffer",
    "labels": "labels: deepcopy of the label dict + Instances (own image)",
    "Mosaic.partners": "labels (+ read/decode on a buffer miss): the 3 partners' get_image_and_label",
    "Mosaic.placement": "mosaic placement: 2S x 2S canvas fill + label concat/clip",
    "RandomPerspective": "warp (+ labels): warpAffine 2S->S, box transform, candidate filter",
    "RandomHSV": "hsv",
    "RandomFlip": "flip (+ box flip); vertical p=flipud, horizontal p=fliplr",
    "Format": "labels + to-tensor: xyxy->xywh normalise, HWC->CHW, BGR->RGB, contiguous copy, from_numpy",
    "collate": "collate: torch.stack of uint8 images, cat of boxes/cls, batch_idx",
    "preprocess_batch": "transfer: trainer side, main process (.to(device) + float()/255), not in the loader",
}


# ------------------------------------------------------------------------------------- arguments
def _int_min(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got '{text}'") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got '{text}'")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="data.yaml (its train split is measured)")
    p.add_argument("--imgsz", type=_int_min(32), default=640)
    p.add_argument("--batch", type=_int_min(1), default=16)
    p.add_argument("--workers", type=_int_min(0), nargs="+", default=[0], help="worker counts to time")
    p.add_argument("--batches", type=_int_min(1), default=10, help="timed batches per worker count")
    p.add_argument("--warmup", type=_int_min(1), default=2, help="untimed batches first (1st = start-up)")
    p.add_argument("--rounds", type=_int_min(1), default=1, help="passes over --workers; best kept")
    p.add_argument("--seed", type=_int_min(0), default=0)
    p.add_argument("--hyp", nargs="*", default=[],
                   help="overrides of Ultralytics' default.yaml (default: none, i.e. mosaic 1.0 and its "
                        "default augmentation): KEY=VALUE items and/or YAML files; unknown keys are ignored")
    p.add_argument("--device", default="cpu", help="what the loader feeds (cpu, cuda:0): sets pin_memory, transfer")
    p.add_argument("--threads", type=_int_min(1), default=None,
                   help="torch threads in this process (default: Ultralytics' NUM_THREADS, as select_device)")
    p.add_argument("--sim-epochs", type=_int_min(0), default=3, help="epochs of the decode-count simulation")
    p.add_argument("--workdir", default=None, help="scratch dir for the mirrored split (default: a temp dir)")
    p.add_argument("--inplace", action="store_true", help="use the split where it is (writes labels/*.cache)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def offline_env(scratch: Path) -> None:
    """The environment Ultralytics needs offline; values already set are kept."""
    for key, sub in (("YOLO_CONFIG_DIR", "ultra_cfg"), ("MPLCONFIGDIR", "mpl")):
        if not os.environ.get(key):
            (scratch / sub).mkdir(parents=True, exist_ok=True)
            os.environ[key] = str(scratch / sub)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    os.environ.setdefault("YOLO_AUTOINSTALL", "false")


# ------------------------------------------------------------------------------ build like its trainer
def hyp_overrides(items: list[str]) -> tuple[dict[str, Any], list[str]]:
    """KEY=VALUE items and YAML files -> (overrides default.yaml knows, ignored keys)."""
    import yaml
    from ultralytics.cfg import DEFAULT_CFG_DICT

    raw: dict[str, Any] = {}
    for item in items:
        if "=" in item:
            key, value = item.split("=", 1)
            raw[key] = yaml.safe_load(value)
        else:
            raw.update(yaml.safe_load(Path(item).read_text()) or {})
    known = {k: v for k, v in raw.items() if k in DEFAULT_CFG_DICT}
    return known, sorted(set(raw) - set(known))


def make_cfg(opt: argparse.Namespace, overrides: dict[str, Any]) -> Any:
    from ultralytics.cfg import DEFAULT_CFG, get_cfg

    args = {**overrides, "task": "detect", "mode": "train", "data": opt.data, "imgsz": opt.imgsz,
            "batch": opt.batch, "seed": opt.seed, "workers": max(opt.workers)}
    return get_cfg(DEFAULT_CFG, args)


def mirror_split(src: Path, work: Path) -> Path:
    """work/images/<split> with the images symlinked and labels copied, so its label cache lands in work."""
    from ultralytics.data.utils import img2label_paths

    dst = work / "images" / src.name
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        d = dst / f.relative_to(src)
        d.parent.mkdir(parents=True, exist_ok=True)
        if not d.exists():
            d.symlink_to(f.resolve())
        src_label, dst_label = (Path(x) for x in img2label_paths([str(f), str(d)]))
        if src_label.is_file() and not dst_label.exists():
            dst_label.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src_label, dst_label)
    return dst


def train_path(data: dict[str, Any], work: Path, inplace: bool) -> str:
    src = data["train"]
    if inplace or not isinstance(src, str) or not Path(src).is_dir() or "images" not in Path(src).parts:
        if not inplace:
            print(f"note: train split {src!r} is not an images/ dir; used in place (labels cache written there)")
        return src
    return str(mirror_split(Path(src), work))


def build_dataset(cfg: Any, img_path: str, batch: int, data: dict[str, Any]) -> YOLODataset:
    """DetectionTrainer.build_dataset(img_path, 'train', batch) with a model stride of 32."""
    from copy import copy

    from ultralytics.data import build_yolo_dataset

    return build_yolo_dataset(copy(cfg), img_path, batch, data, mode="train", rect=False, stride=32)


def build_loader(dataset: YOLODataset, batch: int, workers: int, device: torch.device) -> InfiniteDataLoader:
    """DetectionTrainer.get_dataloader(..., rank=LOCAL_RANK=-1, mode='train'), compile off."""
    from ultralytics.data import build_dataloader

    return build_dataloader(dataset, batch=batch, workers=workers, shuffle=True, rank=-1,
                            drop_last=False, device=device)


def seed_all(seed: int) -> None:
    """Its trainer: init_seeds(args.seed + 1 + RANK) with RANK -1 and deterministic=True (default)."""
    from ultralytics.utils.torch_utils import init_seeds

    init_seeds(seed, deterministic=True)


def worker_cap(batch_count: int, device: torch.device) -> dict[str, int]:
    """The terms of build_dataloader's nw = min(cpu_count // max(nd, 1), workers, batches)."""
    from ultralytics.utils.torch_utils import get_torch_device_backend

    nd = get_torch_device_backend(device).device_count() if device.type not in {"cpu", "mps"} else 0
    return {"cpu_count": os.cpu_count() or 1, "device_count": nd, "batches_per_epoch": batch_count}


# ------------------------------------------------------------------------------------------ timing
def run_batches(loader: InfiniteDataLoader, warmup: int, n: int,
                on_warm: Callable[[], None] | None = None,
                on_batch: Callable[[dict], None] | None = None) -> dict[str, float]:
    """Pull warmup + n batches of one epoch; images/s over the last n, first batch time apart."""
    times: list[tuple[float, int]] = []
    t = time.perf_counter()
    for i, batch in enumerate(islice(iter(loader), warmup + n)):
        times.append((time.perf_counter() - t, len(batch["img"])))
        if on_batch is not None and i >= warmup:
            on_batch(batch)  # outside the loader's time
        if i == warmup - 1 and on_warm is not None:
            on_warm()
        t = time.perf_counter()
    steady = times[warmup:]
    return {"img_s": sum(b for _, b in steady) / sum(dt for dt, _ in steady),
            "first_batch_s": times[0][0], "images": sum(b for _, b in steady), "batches": len(steady)}


def fit_window(batches_per_epoch: int, warmup: int, n: int) -> int:
    """Timed batches that fit in epoch 0 after the warm-up."""
    if warmup >= batches_per_epoch:
        raise SystemExit(f"--warmup {warmup} leaves no batch of the {batches_per_epoch} in epoch 0")
    if warmup + n > batches_per_epoch:
        print(f"note: --batches {n} cut to {batches_per_epoch - warmup} to stay in epoch 0")
    return min(n, batches_per_epoch - warmup)


def loader_facts(loader: InfiniteDataLoader) -> dict[str, Any]:
    return {"num_workers": loader.num_workers, "pin_memory": loader.pin_memory,
            "prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers,
            "drop_last": loader.drop_last, "batch_size": loader.batch_size,
            "sampler": type(loader.batch_sampler.sampler.sampler).__name__,
            "collate_fn": getattr(loader.collate_fn, "__qualname__", str(loader.collate_fn))}


def time_rate(opt: argparse.Namespace, cfg: Any, img_path: str, data: dict[str, Any],
              device: torch.device, workers: int) -> dict[str, Any]:
    """A fresh dataset and loader (epoch 0) with this many workers: steady images/s."""
    seed_all(opt.seed)
    loader = build_loader(build_dataset(cfg, img_path, opt.batch, data), opt.batch, workers, device)
    warmup = max(opt.warmup, loader.num_workers)  # W workers finish their first batches together
    if warmup > opt.warmup:
        print(f"note: warm-up raised to {warmup} batches for {loader.num_workers} workers")
    n = fit_window(len(loader), warmup, opt.batches)
    try:
        res = run_batches(loader, warmup, n)
    finally:
        loader.close()
    print(f"workers {workers} (effective {loader.num_workers}): {res['img_s']:.1f} img/s over {n} batches, "
          f"first batch {res['first_batch_s']:.2f} s")
    return {**res, "requested": workers, "warmup": warmup, "batches_per_epoch": len(loader),
            "effective": loader.num_workers, "loader": loader_facts(loader)}


def time_rates(opt: argparse.Namespace, cfg: Any, img_path: str, data: dict[str, Any],
               device: torch.device) -> dict[int, dict[str, Any]]:
    """--rounds passes over the worker counts; per count the best round (a busy machine only adds time)."""
    out: dict[int, dict[str, Any]] = {}
    for _ in range(opt.rounds):
        for w in opt.workers:
            res = time_rate(opt, cfg, img_path, data, device, w)
            best = out.get(w, res)
            out[w] = {**(res if res["img_s"] >= best["img_s"] else best),
                      "all_img_s": best.get("all_img_s", []) + [res["img_s"]]}
    return out


class StageClock:
    """Wraps callables; times each call under its nesting path (e.g. 'Mosaic>get_image_and_label')."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []
        self.on = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(name)
            key = ">".join(self.stack)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.stack.pop()
                if self.on:
                    self.total[key] += dt
                    self.calls[key] += 1
        return timed

    def sum(self, suffix: str) -> tuple[float, int]:
        """Seconds and calls over every path that ends in suffix."""
        keys = [k for k in self.total if k == suffix or k.endswith(">" + suffix)]
        return sum(self.total[k] for k in keys), sum(self.calls[k] for k in keys)


class Timed:
    """A transform stand-in that times the original's __call__ and forwards everything else."""

    def __init__(self, inner: Any, clock: StageClock, name: str) -> None:
        self.inner, self.call = inner, clock.wrap(name, inner.__call__)

    def __call__(self, labels: dict) -> dict:
        return self.call(labels)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


def transform_name(t: Any) -> str:
    name = type(t).__name__
    return FLIP_NAMES.get(getattr(t, "direction", ""), name) if name == "RandomFlip" else name


def wrap_transforms(compose: Any, clock: StageClock) -> list[str]:
    """Replace every leaf of a (nested) Compose by a Timed one, in place; the leaf names in order."""
    from ultralytics.data.augment import Compose

    names: list[str] = []
    for i, t in enumerate(compose.transforms):
        if isinstance(t, Compose):
            names += wrap_transforms(t, clock)
        elif not isinstance(t, Timed):
            compose.transforms[i] = Timed(t, clock, transform_name(t))
            names.append(transform_name(t))
    return names


def instrument(dataset: YOLODataset, clock: StageClock) -> tuple[list[str], Callable[[], None]]:
    """Timers on the dataset's transforms, get_image_and_label, load_image, imread and collate_fn.

    Returns the transform names and a function that undoes the module-level imread patch."""
    import ultralytics.data.base as base

    names = wrap_transforms(dataset.transforms, clock)
    for attr in ("get_image_and_label", "load_image"):
        setattr(dataset, attr, clock.wrap(attr, getattr(dataset, attr)))
    dataset.collate_fn = clock.wrap("collate", type(dataset).collate_fn)  # build_dataloader reads it
    original = base.imread
    base.imread = clock.wrap("imread", original)
    return names, lambda: setattr(base, "imread", original)


def preprocess_batch(device: torch.device) -> Callable[[dict], dict]:
    """DetectionTrainer.preprocess_batch without multi_scale (default 0): to device, float()/255."""
    import torch

    def run(batch: dict) -> dict:
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                batch[k] = v.to(device, non_blocking=device.type not in {"cpu", "mps"})
        batch["img"] = batch["img"].float() / 255
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return batch
    return run


def stage_table(clock: StageClock, names: list[str], samples: int) -> dict[str, float]:
    """ms per sample: exclusive parts first, then the inclusive totals they come from."""
    def ms(key: str) -> float:
        return 1000 * clock.total.get(key, 0.0) / samples

    g, m = "get_image_and_label", "Mosaic>get_image_and_label"
    out = {"imread": ms(f"{g}>load_image>imread"),
           "load_image-imread": ms(f"{g}>load_image") - ms(f"{g}>load_image>imread"),
           "labels": ms(g) - ms(f"{g}>load_image"),
           "Mosaic.partners": ms(m), "Mosaic.partners.imread": ms(f"{m}>load_image>imread"),
           "Mosaic.placement": ms("Mosaic") - ms(m)}
    for name in names:
        if name != "Mosaic":
            out[name] = ms(name)
    out["collate"] = ms("collate")
    out["preprocess_batch"] = ms("preprocess_batch")
    out["total.load_image(all calls)"] = 1000 * clock.sum("load_image")[0] / samples
    out["total.imread(all calls)"] = 1000 * clock.sum("imread")[0] / samples
    out["total.Mosaic"] = ms("Mosaic")
    out["total.sample(get_image_and_label+transforms)"] = ms(g) + sum(ms(x) for x in names)
    out["total.loader(sample+collate)"] = out["total.sample(get_image_and_label+transforms)"] + ms("collate")
    return out


def time_stages(opt: argparse.Namespace, cfg: Any, img_path: str, data: dict[str, Any],
                device: torch.device) -> dict[str, Any]:
    """Workers 0, in-process, every stage wrapped; counts from the timed window only."""
    seed_all(opt.seed)
    clock = StageClock()
    dataset = build_dataset(cfg, img_path, opt.batch, data)
    names, restore = instrument(dataset, clock)
    loader = build_loader(dataset, opt.batch, 0, device)
    n = fit_window(len(loader), opt.warmup, opt.batches)
    prep = clock.wrap("preprocess_batch", preprocess_batch(device))
    try:
        res = run_batches(loader, opt.warmup, n, on_warm=lambda: setattr(clock, "on", True), on_batch=prep)
    finally:
        restore()
        loader.close()
    samples = res["images"]
    calls = {k: v / samples for k, v in sorted(clock.calls.items())}
    return {"stages_ms": stage_table(clock, names, samples), "calls_per_sample": calls,
            "decodes_per_sample": clock.sum("imread")[1] / samples,
            "instrumented_img_s": res["img_s"], "samples": samples, "transforms": names,
            "max_buffer_length": dataset.max_buffer_length}


# -------------------------------------------------------------------------------- decode simulation
def simulate_decodes(opt: argparse.Namespace, cfg: Any, img_path: str, data: dict[str, Any],
                     device: torch.device, workers: int) -> list[float]:
    """imread calls per sample in each of --sim-epochs epochs, with imread faked (no decode).

    Only the sample's own load_image can decode: Mosaic partners come from the buffer, which holds
    exactly the images still cached. The loader's own sampler gives the order; with W workers each
    index batch goes to worker (batch number mod W), each with its own dataset copy and buffer."""
    import numpy as np
    import ultralytics.data.base as base

    seed_all(opt.seed)
    first = build_dataset(cfg, img_path, opt.batch, data)
    loader = build_loader(first, opt.batch, workers, device)  # never iterated: no workers start
    copies = [first] + [build_dataset(cfg, img_path, opt.batch, data) for _ in range(loader.num_workers - 1)]
    fake, count = np.zeros((opt.imgsz, opt.imgsz, 3), np.uint8), [0]
    original = base.imread

    def imread(*_: Any, **__: Any) -> np.ndarray:
        count[0] += 1
        return fake

    base.imread = imread
    out: list[float] = []
    try:
        index_batches: Iterator[list[int]] = iter(loader.batch_sampler)  # endless, as its workers see it
        j = 0
        for _ in range(opt.sim_epochs):
            count[0], samples = 0, 0
            for idx in islice(index_batches, len(loader)):
                ds, j = copies[j % len(copies)], j + 1  # torch hands index batches to workers round robin
                for i in idx:
                    ds.load_image(i)
                samples += len(idx)
            out.append(count[0] / samples)
    finally:
        base.imread = original
    return out


# ------------------------------------------------------------------------------------------ output
def print_report(res: dict[str, Any]) -> None:
    print(f"\nUltralytics {res['version']} training loader: imgsz {res['imgsz']}, batch {res['batch']}, "
          f"device {res['device']}, torch threads {res['threads']}, mosaic {res['hyp']['mosaic']}")
    print(f"{'workers':>8} {'effective':>9} {'img/s':>8} {'first batch s':>14}  pin_memory prefetch")
    for w, r in res["per_workers"].items():
        lf = r["loader"]
        print(f"{w:>8} {r['effective']:>9} {r['img_s']:>8.1f} {r['first_batch_s']:>14.2f}  "
              f"{lf['pin_memory']!s:>10} {lf['prefetch_factor']!s:>8}")
    cap = res["worker_cap"]
    if any(r["effective"] < int(w) for w, r in res["per_workers"].items()):
        print(f"note: build_dataloader caps workers at min(cpu_count // max(GPUs, 1) = "
              f"{cap['cpu_count'] // max(cap['device_count'], 1)}, workers, batches per epoch = "
              f"{cap['batches_per_epoch']}); 'effective' is what ran")
    print(f"\nper-sample stages, workers 0 in-process ({res['stage_samples']} samples, "
          f"{res['instrumented_img_s']:.1f} img/s instrumented):")
    for k, v in res["stages_ms"].items():
        print(f"  {k:<46} {v:8.2f} ms   {STAGE_MAP.get(k.split('(')[0], '')}")
    sim = ", ".join(f"W={w}: " + "/".join(f"{x:.2f}" for x in v) for w, v in res["decodes_sim"].items())
    print(f"\ndecodes per sample (imread calls, timed window, epoch 0): {res['decodes_per_sample']:.3f}; "
          f"buffer length max {res['max_buffer_length']}")
    print(f"simulated decodes per sample, epochs 1..{len(next(iter(res['decodes_sim'].values()), []))}: {sim}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    opt = build_parser().parse_args(argv)
    scratch = Path(opt.workdir) if opt.workdir else Path(tempfile.mkdtemp(prefix="ul_loader_"))
    scratch.mkdir(parents=True, exist_ok=True)
    offline_env(scratch)
    try:
        return measure(opt, scratch)
    finally:
        if not opt.workdir:
            shutil.rmtree(scratch, ignore_errors=True)


def measure(opt: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    import torch
    import ultralytics
    from ultralytics.data.utils import check_det_dataset
    from ultralytics.utils.torch_utils import NUM_THREADS

    device = torch.device(f"cuda:{opt.device}" if opt.device.isdigit() else opt.device)
    torch.set_num_threads(opt.threads or NUM_THREADS)
    overrides, ignored = hyp_overrides(opt.hyp)
    if ignored:
        print(f"note: --hyp keys unknown to Ultralytics ignored: {', '.join(ignored)}")
    cfg = make_cfg(opt, overrides)
    data = check_det_dataset(opt.data)
    img_path = train_path(data, scratch / "data", opt.inplace)
    rates = time_rates(opt, cfg, img_path, data, device)
    stages = time_stages(opt, cfg, img_path, data, device)
    sim = {w: simulate_decodes(opt, cfg, img_path, data, device, w) for w in opt.workers}
    hyp_keys = ("mosaic", "mixup", "cutmix", "copy_paste", "degrees", "translate", "scale", "shear",
                "perspective", "hsv_h", "hsv_s", "hsv_v", "flipud", "fliplr", "bgr", "cache", "fraction")
    res = {"version": ultralytics.__version__, "imgsz": opt.imgsz, "batch": opt.batch,
           "rates": {str(w): r["img_s"] for w, r in rates.items()},
           "effective_workers": {str(w): r["effective"] for w, r in rates.items()},
           "stages_ms": stages["stages_ms"], "decodes_per_sample": stages["decodes_per_sample"],
           "device": str(device), "threads": torch.get_num_threads(), "seed": opt.seed,
           "warmup": {str(w): r["warmup"] for w, r in rates.items()}, "batches_timed": {str(w): r["batches"] for w, r in rates.items()},
           "first_batch_s": {str(w): r["first_batch_s"] for w, r in rates.items()},
           "rates_all_rounds": {str(w): r["all_img_s"] for w, r in rates.items()},
           "per_workers": {str(w): {k: r[k] for k in ("img_s", "effective", "first_batch_s", "loader")}
                           for w, r in rates.items()},
           "worker_cap": worker_cap(next(iter(rates.values()))["batches_per_epoch"], device),
           "stage_map": STAGE_MAP, "stage_calls_per_sample": stages["calls_per_sample"],
           "stage_samples": stages["samples"], "instrumented_img_s": stages["instrumented_img_s"],
           "transforms": stages["transforms"], "max_buffer_length": stages["max_buffer_length"],
           "decodes_sim": {str(w): v for w, v in sim.items()},
           "hyp": {k: getattr(cfg, k) for k in hyp_keys}, "hyp_overrides": overrides}
    print_report(res)
    if opt.json:
        Path(opt.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    return res


if __name__ == "__main__":
    main()
