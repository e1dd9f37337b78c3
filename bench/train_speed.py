#!/usr/bin/env python
"""Training throughput: steady-state images/s, a per-step time breakdown and model-FLOP utilisation.

    python bench/train_speed.py                                # yolov5n and s at 320 and 640, batch 16
    python bench/train_speed.py --models n --imgsz 320 --steps 8 --device cpu
    torchrun --nproc_per_node 2 bench/train_speed.py --models n --imgsz 320
    python bench/train_speed.py --models n --imgsz 320 --scaling 2   # 1 process, then 2, and the efficiency
    python bench/train_speed.py --models n --imgsz 320 --profile torch   # where the step's time goes

Each configuration is set up by train.py's own builder: ``yolotrain.utils.engine.setup.build_training`` on
arguments parsed by ``train.build_parser()`` (--cfg models/<model>.yaml, this script's --data,
--hyp (default: train.py's for the family), --imgsz, --batch-size, --workers, --threads, --seed, --device, --channels-last, --amp; --epochs 1,
--noautoanchor, --noplots, the run folder in a temporary directory that is removed afterwards).
So the loader (mosaic etc. from the hyp file), model, optimizer, EMA, loss, AMP +
GradScaler on CUDA and DDP under torchrun are exactly train.py's. Each step is train_one_epoch's,
from the loop's shared pieces (utils/engine/loop.py): ``batch_images`` (utils/data/device_feed.py), forward and
``criterion`` under autocast, ``check_step`` (the per-step NaN all-reduce), ``backward``, and
``optimizer_step`` (clip, step, EMA) every ``accumulate`` batches, as after warmup (train.py's
nominal batch of 64, unless --accumulate). Every timed epoch has mosaic on (the run's last
close_mosaic epochs, without it, are not measured). Left out: the LR/momentum warmup and its
accumulate ramp, autoanchor, --multi-scale, the running mean loss, the first-batch pictures,
mid-epoch and epoch-end checkpoints, the epoch's closing optimizer step, validation and the
progress bar (whose loss formatting reads the device every step on rank 0: free on CPU, a sync
on CUDA, so CUDA figures here are a bound train.py does not quite reach).

Flags that measure proposals rather than train.py as it is: --ddp-no-sync (no gradient
all-reduce on accumulation steps) and --accumulate (the optimizer-step interval only; the weight
decay stays train.py's for the batch, which costs the same). --threads, --channels-last and
--amp measure train.py's flags of those names. The val loader is built, as train.py builds it, but
never read.

Figures:
  img/s      images per second summed over all ranks, over the timed steps only (warm-up steps
             start the loader workers and fill allocator caches). The timed window is the
             slowest rank's, so a straggler counts.
  breakdown  mean ms per step of each phase: data (waiting for the loader), prep (images to
             the device, /255, memory format), forward, loss (targets to the device, target
             building + loss; under --cuda-graphs counted in forward), nan-check (the NaN flag on
             the device, and at each optimizer step check_step: one all-reduce of the flags and
             running loss, one host read), backward
             (includes DDP's gradient all-reduce),
             optim (unscale, clip, SGD step, zero_grad, EMA; amortised over accumulate steps).
             On CUDA the device is synchronised at each phase boundary, only here, so phases do
             not overlap as they would in train.py; --no-sync times the whole step only.
  MFU        model-FLOP utilisation = training FLOPs per image (3 x the forward FLOPs that thop
             counts, as Model.info reports them) x img/s, divided by the throughput of a large
             matmul (and, second figure, a 3x3 convolution) timed in the same run, by every rank
             at once with the same thread count: the machine's own limit for that set-up.

Timings on a shared machine are noisy: compare figures only from the same run (--scaling does
both halves back to back), and take final figures on a quiet machine.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import itertools
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere, also under torchrun
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from yolotrain.utils.core.cli import IMGSZ, SEED, ArgumentParser, Range  # noqa: E402

PHASES = ("data", "prep", "forward", "loss", "nan-check", "backward", "optim")


@dataclass
class Result:
    """One configuration's figures, as rank 0 prints them (and --json writes them)."""

    model: str
    imgsz: int
    world_size: int
    batch: int  # global
    threads: int  # intra-op threads per rank
    workers: int  # loader workers per rank (after create_dataloader's cap)
    accumulate: int
    steps: int
    img_s: float
    ms: dict[str, float] = field(default_factory=dict)  # mean per step, averaged over ranks
    train_gflops_per_img: float = 0.0
    ref_matmul_gflops: float = 0.0  # summed over ranks
    ref_conv_gflops: float = 0.0
    mfu_matmul: float = 0.0
    mfu_conv: float = 0.0
    device: str = "cpu"
    layout: str = "NCHW"  # memory format of activations (NHWC: channels-last)
    precision: str = "fp32"  # forward precision: fp32, or the autocast dtype of --amp (bf16 on CPU, fp16 on CUDA)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["n", "s"],
                   help="models: a YOLOv5 size (n -> models/yolov5n.yaml) or a yaml name such as yolov8n")
    p.add_argument("--imgsz", nargs="+", type=IMGSZ, default=[320, 640], help="training image sizes")
    p.add_argument("--batch-size", type=Range(int, min=1), default=16,
                   help="global batch, split over ranks as in train.py")
    p.add_argument("--warmup", type=Range(int, min=0), default=4,
                   help="untimed steps first (loader start-up, allocator); rounded up to whole accumulation cycles")
    p.add_argument("--steps", type=Range(int, min=1), default=4,
                   help="timed steps; rounded up to whole accumulation cycles")
    p.add_argument("--accumulate", type=Range(int, min=0), default=0,
                   help="batches per optimizer step (0: train.py's steady state for the batch size)")
    p.add_argument("--device", default="", help="'' (auto), cpu, 0 ... as in train.py")
    p.add_argument("--workers", type=Range(int, min=0), default=8,
                   help="max loader workers per rank (train.py's default)")
    p.add_argument("--threads", type=Range(int, min=0), default=0,
                   help="torch intra-op threads per rank (0: train.py's default)")
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"), help="dataset yaml")
    p.add_argument("--hyp", default=None, help="hyperparameters yaml (default: train.py's for the model's family)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--ref-seconds", type=Range(float, min=0), default=1.0, help="time spent on each reference kernel")
    p.add_argument("--no-sync", action="store_true", help="no device sync between phases (CUDA: total only)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="memory format, as train.py's flag (default: train.py's for the device)")
    p.add_argument("--both-layouts", action="store_true",
                   help="time every configuration in NCHW and then NHWC, back to back, and print NHWC's speed-up")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="mixed precision, as train.py's flag (default: train.py's for the device)")
    p.add_argument("--both-precisions", action="store_true",
                   help="time every configuration in fp32 and then with --amp, back to back, and print the speed-up")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="train.py's --cuda-graphs: the model's forward, loss and backward replayed as CUDA graphs")
    p.add_argument("--ddp-no-sync", action="store_true",
                   help="DDP: no gradient all-reduce on accumulation steps without an optimizer step (not what "
                        "train.py does today; same math, different float summation order)")
    p.add_argument("--profile", choices=("torch", "cprofile"), default=None,
                   help="profile the timed steps and print the top entries")
    p.add_argument("--profile-rows", type=Range(int, min=1), default=25, help="rows of profile output")
    p.add_argument("--scaling", type=Range(int, min=0), default=0, metavar="N",
                   help="run each configuration with 1 and then N processes (torchrun) and print the efficiency")
    p.add_argument("--json", default=None, help="also write the results to this file (rank 0)")
    p.add_argument("--local-rank", "--local_rank", type=Range(int, min=-1), default=-1, help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------------------------------------- reference


def _timed_rate(fn, flops: float, seconds: float, sync, windows: int = 5) -> float:
    """Best FLOP/s of ``fn`` (``flops`` per call) over ``windows`` windows of ``seconds / windows``.

    The best window, not the mean: the reference is the machine's limit, and on a shared machine
    the other windows are slowed by whatever else runs.
    """
    fn()
    sync()
    best = 0.0
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            sync()
            dt = time.perf_counter() - t0
            if dt >= seconds / windows:
                break
        best = max(best, n * flops / dt)
    return best


@torch.no_grad()
def reference_flops(device: torch.device, seconds: float) -> tuple[float, float]:
    """This rank's matmul and 3x3-conv FLOP/s, timed while every rank does the same (barrier first).

    CPU: fp32 (what CPU training runs in). CUDA: fp16, since train.py trains with AMP there.
    The conv is a mid-network YOLO layer shape (128 -> 128 channels, 40 x 40, batch 16).
    """
    from yolotrain.utils.core import dist

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    x = torch.randn(16, 128, 40, 40, device=device, dtype=dtype)
    conv = torch.nn.Conv2d(128, 128, 3, padding=1, bias=False).to(device, dtype)
    sync = _syncer(device, True)
    dist.barrier()
    mm = _timed_rate(lambda: a @ b, 2.0 * n ** 3, seconds, sync)
    dist.barrier()
    cv = _timed_rate(lambda: conv(x), 2.0 * 16 * 128 * 128 * 9 * 40 * 40, seconds, sync)
    return mm, cv


def _syncer(device: torch.device, enabled: bool):
    """A function that waits for the device (a no-op on CPU, or when disabled)."""
    if enabled and device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


# ---------------------------------------------------------------------------------------------- training step


def _batches(loader) -> Iterator[Any]:
    """Batches without end: the next epoch (same persistent workers) when one runs out."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def train_opt(size: str, imgsz: int, opt: argparse.Namespace, project: str) -> argparse.Namespace:
    """train.py's own arguments for one configuration, parsed by train.py's parser (its defaults and checks)."""
    from yolotrain.app import train

    argv = ["--data", opt.data, "--cfg", str(ROOT / "models" / f"{model_name(size)}.yaml"),
            "--imgsz", str(imgsz), "--batch-size", str(opt.batch_size), "--workers", str(opt.workers),
            "--threads", str(opt.threads), "--seed", str(opt.seed), "--device", opt.device, "--epochs", "1",
            "--noautoanchor", "--noplots", "--project", project, "--name", f"{model_name(size)}-{imgsz}", "--exist-ok"]
    argv += ["--hyp", opt.hyp] if opt.hyp else []
    argv += [] if opt.channels_last is None else ["--channels-last" if opt.channels_last else "--no-channels-last"]
    argv += [] if opt.amp is None else ["--amp" if opt.amp else "--no-amp"]
    argv += ["--cuda-graphs"] if opt.cuda_graphs else []
    return train.build_parser().parse_args(argv)


def model_name(size: str) -> str:
    """--models entry -> yaml stem: a bare YOLOv5 size letter, or a name as given."""
    return size if size.startswith("yolo") else f"yolov5{size}"


def run_config(size: str, imgsz: int, opt: argparse.Namespace, device: torch.device, info) -> Result | None:
    """Build train.py's set-up for one model and image size (``build_training``), and time its steps."""
    from yolotrain.utils.core.cli import ResolvedArgs
    from yolotrain.utils.engine.config import Resume, resolve_config
    from yolotrain.utils.engine.setup import build_training

    with tempfile.TemporaryDirectory(prefix="train_speed_") as project:  # opt.yaml, hyp.yaml (rank 0's is used)
        cfg = resolve_config(Resume(ResolvedArgs(**vars(train_opt(size, imgsz, opt, project)))), device)  # as train.py resolves it
        t = build_training(cfg, info, device)
        # every timed epoch trains with mosaic, as all but a run's last close_mosaic epochs do
        t.train_loader.sampler.load_state_dict({"mosaic_off_from_epoch": None})
        try:
            return time_steps(t, size, opt)
        finally:
            del t  # ends the persistent loader workers before the next configuration


def time_steps(t, size: str, opt: argparse.Namespace) -> Result | None:
    """Warm-up steps, then the timed ones: the training step (utils/engine/step.py) from its own pieces, a
    timer between each two; every rank's figures go to rank 0, which returns the configuration's Result."""
    from yolotrain.utils.core import dist, precision
    from yolotrain.utils.data.device_feed import batch_images
    from yolotrain.utils.engine.step import check_step

    device, info, step = t.device, t.info, t.step
    model = step.module  # what the step's forward runs (DDP around the model when distributed)
    world = info.world_size
    accumulate = opt.accumulate or t.plan.accumulate
    if opt.cuda_graphs and accumulate > 1:
        sys.exit("--cuda-graphs needs an optimizer step after every batch: leave out --accumulate")
    # whole accumulation cycles, so the timed window holds its fair share of optimizer steps
    warmup_steps, steps = (-(-n // accumulate) * accumulate for n in (opt.warmup, opt.steps))
    gflops = t.model_info.gflops * (t.imgsz / t.cfg.imgsz) ** 2  # forward, per image (thop), at the size trained
    model.train()
    sync = _syncer(device, not opt.no_sync)
    totals = dict.fromkeys(PHASES, 0.0)
    batches = _batches(t.train_loader)
    profiler, t_start = None, 0.0
    for k in range(warmup_steps + steps):
        timed = k >= warmup_steps
        if k == warmup_steps:
            dist.barrier()  # every rank starts the timed window together
            _sync_all(device)
            profiler = _start_profiler(opt.profile, device)
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        imgs = batch_images(batch, t.device, t.memory_format)
        sync()
        t2 = time.perf_counter()
        step_now = (k + 1) % accumulate == 0
        # --ddp-no-sync (a proposal for train.py, measured here): skip DDP's gradient all-reduce on
        # the accumulation steps that do not end in an optimizer step; no_sync covers forward+backward.
        skip_sync = opt.ddp_no_sync and world > 1 and not step_now
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            with step.autocast():
                if opt.cuda_graphs:  # one replay of the model and (with packed targets) its loss: all of it "forward"
                    loss, loss_items = step.loss(imgs, batch.targets)
                else:
                    pred = model(imgs)
                sync()
                t3 = time.perf_counter()
                if not opt.cuda_graphs:
                    loss, loss_items = t.step.criterion(pred, batch.targets)
                sync()
            t4 = time.perf_counter()
            bad = ~torch.isfinite(loss_items).all()  # train.py's flag, on the device until the optimizer step
            if step_now:
                check_step(bad, loss_items, info, False, False)  # the step's all-reduce and its one host copy
            t5 = time.perf_counter()
            step.backward(loss)
            sync()
        t6 = time.perf_counter()
        if step_now:
            step.optimizer_step()
            sync()
        t7 = time.perf_counter()
        if timed:
            for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)):
                totals[name] += dt
    _sync_all(device)
    wall = time.perf_counter() - t_start
    profile_text = _stop_profiler(profiler, opt.profile, opt.profile_rows, device)
    batches.close()
    parts = dist.all_gather_object({"wall": wall, "totals": totals, "threads": torch.get_num_threads(),
                                    "workers": t.train_loader.num_workers, "profile": profile_text})
    if not info.is_main:
        return None
    slowest = max(p["wall"] for p in parts)
    ms = {name: 1e3 * sum(p["totals"][name] for p in parts) / len(parts) / steps for name in PHASES}
    for r, p in enumerate(parts):
        if p["profile"]:
            print(f"\n--- profile, {model_name(size)} {t.imgsz}px, rank {r} ---\n{p['profile']}")
    return Result(model=model_name(size), imgsz=t.imgsz, world_size=world, batch=t.plan.global_batch,
                  threads=parts[0]["threads"], workers=parts[0]["workers"], accumulate=accumulate,
                  steps=steps, img_s=steps * t.plan.global_batch / slowest, ms=ms,
                  train_gflops_per_img=3 * gflops, device=device.type,
                  layout="NHWC" if t.cfg.channels_last else "NCHW",
                  precision={torch.bfloat16: "bf16", torch.float16: "fp16"}[precision.amp_dtype(device)] if t.amp else "fp32")


def _sync_all(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start_profiler(kind: str | None, device: torch.device):
    if kind == "torch":
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        prof.__enter__()
        return prof
    if kind == "cprofile":
        prof = cProfile.Profile()
        prof.enable()
        return prof
    return None


def _stop_profiler(prof, kind: str | None, rows: int, device: torch.device) -> str:
    """The profile as text: torch's self-time table (device time first on CUDA), or cProfile's listing."""
    if prof is None:
        return ""
    if kind == "torch":
        prof.__exit__(None, None, None)
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        return prof.key_averages().table(sort_by=key, row_limit=rows)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(rows)
    return out.getvalue()


# ---------------------------------------------------------------------------------------------- reporting


def finish_result(r: Result, mm: float, cv: float) -> Result:
    """Add the reference throughputs (summed over ranks) and the MFU they imply."""
    achieved = r.train_gflops_per_img * r.img_s  # GFLOP/s
    r.ref_matmul_gflops, r.ref_conv_gflops = mm / 1e9, cv / 1e9
    r.mfu_matmul = achieved / r.ref_matmul_gflops if mm else 0.0
    r.mfu_conv = achieved / r.ref_conv_gflops if cv else 0.0
    return r


def speedups(results: list[Result], field: str, base: str, title: str) -> str:
    """img/s of each configuration over the same one with ``field`` == ``base`` (same run, back to back)."""
    key = lambda r, value: (r.model, r.imgsz, r.world_size, *(value if f == field else getattr(r, f)
                                                              for f in ("layout", "precision")))
    by_key = {key(r, getattr(r, field)): r.img_s for r in results}
    lines = [title]
    for r in results:
        if getattr(r, field) != base and key(r, base) in by_key:
            lines.append(f"  {r.model} {r.imgsz}px x{r.world_size} {r.layout} {r.precision}: "
                         f"{r.img_s / by_key[key(r, base)]:.2f}x")
    return "\n".join(lines)


def format_results(results: list[Result]) -> str:
    """A table: throughput, the per-step breakdown in ms (and its shares), FLOPs and MFU."""
    head = (f"{'model':<9}{'layout':>7}{'prec':>6}{'px':>5}{'ranks':>6}{'thr':>4}{'wrk':>4}{'img/s':>8} |"
            + "".join(f"{n:>10}" for n in PHASES) + f"{'step':>9} |{'GFLOP/img':>10}{'GFLOP/s':>9}"
            f"{'MFU mm':>8}{'MFU cv':>8}{'ref mm':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        step = sum(r.ms.values())
        lines.append(f"{r.model:<9}{r.layout:>7}{r.precision:>6}{r.imgsz:>5}{r.world_size:>6}{r.threads:>4}{r.workers:>4}{r.img_s:>8.1f} |"
                     + "".join(f"{r.ms[n]:>8.0f}ms" for n in PHASES) + f"{step:>7.0f}ms |"
                     f"{r.train_gflops_per_img:>10.2f}{r.train_gflops_per_img * r.img_s:>9.1f}"
                     f"{100 * r.mfu_matmul:>7.1f}%{100 * r.mfu_conv:>7.1f}%{r.ref_matmul_gflops:>8.0f}")
        lines.append(f"{'':<9}{'':>7}{'':>6}{'':>5}{'':>6}{'':>4}{'':>4}{'share':>8} |"
                     + "".join(f"{100 * r.ms[n] / step:>9.1f}%" for n in PHASES))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- scaling


def scaling(opt: argparse.Namespace, argv: list[str]) -> None:
    """Run this script with 1 process and then with N (torchrun) per configuration; print efficiency.

    Efficiency = img/s with N processes / (N x img/s with 1): 100 % is perfect linear scaling
    at the same global batch (train.py's --batch-size is global, so each rank gets batch / N).
    """
    n = opt.scaling
    base = _strip_flag(argv, "--scaling", 1)
    base = _strip_flag(base, "--json", 1)
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    rows = []
    for size in opt.models:
        for imgsz in opt.imgsz:
            one = ["--models", size, "--imgsz", str(imgsz)]
            base_cfg = _strip_flag(_strip_flag(base, "--models", None), "--imgsz", None)
            single = _run_json([sys.executable, str(Path(__file__).resolve()), *base_cfg, *one], env)
            multi = _run_json([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                               str(Path(__file__).resolve()), *base_cfg, *one], env)
            rows.append((single, multi))
            print(f"{model_name(size)} {imgsz}px: 1 process {single.img_s:.1f} img/s ({single.threads} threads), "
                  f"{n} processes {multi.img_s:.1f} img/s ({multi.threads} threads each): "
                  f"speed-up {multi.img_s / single.img_s:.2f}x, efficiency {multi.img_s / (n * single.img_s):.0%}",
                  flush=True)
    print("\nscaling, back to back in this run (global batch the same for both"
          + ("; DDP no_sync on accumulation steps" if opt.ddp_no_sync else "") + "):")
    print(format_results([r for pair in rows for r in pair]))
    if opt.json:
        Path(opt.json).write_text(json.dumps([[asdict(a), asdict(b)] for a, b in rows], indent=1))


def _strip_flag(argv: list[str], flag: str, nvalues: int | None) -> list[str]:
    """argv without ``flag`` and its values (``None``: every value up to the next --flag)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == flag or a.startswith(flag + "="):
            i += 1
            if "=" in a:
                continue
            if nvalues is None:
                while i < len(argv) and not argv[i].startswith("--"):
                    i += 1
            else:
                i += nvalues
            continue
        out.append(a)
        i += 1
    return out


def _run_json(cmd: list[str], env: dict[str, str]) -> Result:
    """Run one benchmark process (or torchrun group) and read back its single result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run([*cmd, "--json", str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if proc.returncode or not out.is_file():
            sys.stdout.write(proc.stdout[-4000:])
            raise SystemExit(f"benchmark process failed (exit {proc.returncode})")
        return Result(**json.loads(out.read_text())[0])


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    opt = parse_args(argv)
    if opt.scaling:
        from yolotrain.utils.core.dist import dist_info

        if dist_info().distributed:
            raise SystemExit("--scaling starts its own processes: run it with plain python, not torchrun")
        scaling(opt, argv)
        return
    from yolotrain.utils.core import dist
    from yolotrain.utils.core.cores import set_cpu_threads
    from yolotrain.utils.core.logging import setup_logging

    info = dist.dist_info(opt.local_rank)
    setup_logging(info.rank, info.world_size, verbose=False)
    set_cpu_threads(info, opt.threads)  # as train.py: ranks x threads <= cores unless --threads
    device = dist.select_device(opt.device, opt.batch_size, info)
    if device.type == "cpu":
        from yolotrain.utils.core.cpu import tune_malloc

        tune_malloc()  # as train.py
    with dist.process_group(info, device):
        results = []
        layouts = (False, True) if opt.both_layouts else (opt.channels_last,)
        precisions = (False, True) if opt.both_precisions else (opt.amp,)
        for size, imgsz, layout, amp in itertools.product(opt.models, opt.imgsz, layouts, precisions):
            # the machine's limit just before each configuration: on a shared machine it drifts
            mm, cv = reference_flops(device, opt.ref_seconds)
            mm_all, cv_all = (sum(v) for v in zip(*dist.all_gather_object((mm, cv))))
            r = run_config(size, imgsz, argparse.Namespace(**{**vars(opt), "channels_last": layout, "amp": amp}),
                           device, info)
            if r is not None:
                results.append(finish_result(r, mm_all, cv_all))
                print(f"{model_name(size)} {imgsz}px {r.layout} {r.precision}: {r.img_s:.1f} img/s; reference ({torch.get_num_threads()} "
                      f"threads x {info.world_size} rank(s), {'fp16' if device.type == 'cuda' else 'fp32'}): "
                      f"matmul {mm_all / 1e9:.1f} GFLOP/s, 3x3 conv {cv_all / 1e9:.1f} GFLOP/s", flush=True)
        if info.is_main:
            print(f"\nbatch {opt.batch_size} global, accumulate {results[0].accumulate if results else '-'}, "
                  f"{results[0].steps if results else opt.steps} timed steps after warm-up, ms per step averaged over ranks"
                  + (", DDP no_sync on accumulation steps" if opt.ddp_no_sync and info.distributed else ""))
            print(format_results(results))
            if opt.both_layouts:
                print(speedups(results, "layout", "NCHW", "NHWC (channels-last) speed-up over NCHW, same run:"))
            if opt.both_precisions:
                print(speedups(results, "precision", "fp32", "--amp speed-up over fp32, same run:"))
            if opt.json:
                Path(opt.json).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
