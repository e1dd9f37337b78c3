"""The engine's GPU paths, proven on CPU where torch allows (fp16 loss scaling with GradScaler("cpu"), the NaN
rollback copy laid out like the live optimizer state, the EMA identical on every rank), and on CUDA when present."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from torch import nn

from tests.helpers import RESUME, ROOT, TORCHRUN, run_env
from yolotrain.utils.engine.step import FP16_OVERFLOW_PATIENCE, Fp16Overflows, optimizer_step
from yolotrain.utils.engine.optim import ModelEMA, smart_optimizer
from yolotrain.utils.engine.recover import NanRecovery

EMA_RANKS = str(ROOT / "tests" / "scripts" / "ema_ranks.py")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 2, 1))


def test_the_grad_scaler_absorbs_fp16_overflows_up_to_its_patience():
    overflows = Fp16Overflows()
    fp16, none = torch.amp.GradScaler("cpu", enabled=True), torch.amp.GradScaler("cpu", enabled=False)
    assert not overflows.absorbs(none, True)  # fp32 / bf16: a non-finite loss is the run's problem
    assert [overflows.absorbs(fp16, True) for _ in range(FP16_OVERFLOW_PATIENCE)] == [True] * FP16_OVERFLOW_PATIENCE
    assert not overflows.absorbs(fp16, True)  # what lowering the scale did not cure stops the run (or rolls back)
    assert overflows.count == 0 and overflows.absorbs(fp16, True) and not overflows.absorbs(fp16, False)
    assert overflows.count == 0  # a finite step ends the streak


def test_an_fp16_overflow_is_a_skipped_step_and_a_lower_scale():
    """fp16 autocast with GradScaler("cpu"), the CUDA recipe's twin: an inf loss leaves the weights as they
    were, halves the scale, and the next finite batch steps as usual; the scaler's state resumes exactly."""
    model = _model()
    optimizer = smart_optimizer(model, "AdamW", lr=0.01, momentum=0.9, decay=5e-4)
    ema, scaler = ModelEMA(model), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=True)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.rand(2, 3, 8, 8)).float().square().mean() * float("inf")
    scaler.scale(loss).backward()
    optimizer_step(model, optimizer, scaler, ema)
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())  # the step was skipped
    assert scaler.get_scale() == 2.0 ** 9
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.rand(2, 3, 8, 8)).float().square().mean()
    scaler.scale(loss).backward()
    optimizer_step(model, optimizer, scaler, ema)
    assert not torch.equal(before["0.weight"], model.get_parameter("0.weight"))
    resumed = torch.amp.GradScaler("cpu", enabled=True)
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.state_dict() == scaler.state_dict()


def test_a_rollback_copy_from_a_checkpoint_is_laid_out_like_the_live_optimizer_state():
    """Fused AdamW on CUDA keeps ``step`` on the GPU in fp32; the copy a checkpoint brings back must match what
    the loaded optimizer holds, or the first rollback after a resume hands the kernel a CPU step."""
    model = _model()
    optimizer = smart_optimizer(model, "AdamW", lr=0.01, momentum=0.9, decay=5e-4)
    ema, scaler = ModelEMA(model), torch.amp.GradScaler("cuda", enabled=False)
    recovery = NanRecovery(2, model, ema, optimizer, scaler)
    model(torch.rand(2, 3, 8, 8)).square().mean().backward()
    recovery.remember()
    optimizer.step()
    saved = recovery.state_dict()
    for p in optimizer.state:  # stands for the GPU: the live step is held in another layout than the file's
        optimizer.state[p]["step"] = optimizer.state[p]["step"].to(torch.float64)
    resumed = NanRecovery(2, model, ema, optimizer, scaler)
    resumed.load_state_dict(saved)
    assert resumed.restore()
    assert all(optimizer.state[p]["step"].dtype == torch.float64 for p in optimizer.state)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)  # no live state yet: torch's own rule
    bare = NanRecovery(2, model, ema, fresh, scaler)
    bare.load_state_dict({"used": 0, "saved": {**saved["saved"], "optimizer": {
        0: {"step": torch.tensor(3.0, dtype=torch.float64), "exp_avg": torch.zeros_like(next(model.parameters()))}}}})
    assert bare._saved.optimizer[0]["step"].dtype == torch.float32  # fused: fp32 on the parameter's device


@pytest.mark.slow
@pytest.mark.dist
def test_every_rank_validates_with_rank_0s_ema(tiny_data, tmp_path):
    """Each rank's EMA averages its own BatchNorm statistics; before every validation the ranks take rank 0's,
    so every shard is scored by the model best.pt holds. The control without that shows they do differ."""
    hashes = {}
    for sync in (True, False):
        out = tmp_path / f"hashes-{sync}.jsonl"
        env = {**run_env(), "EMA_HASHES": str(out), "EMA_NO_SYNC": "0" if sync else "1"}
        p = subprocess.run([*TORCHRUN, EMA_RANKS, "--data", str(tiny_data), "--project", str(tmp_path), "--name",
                            f"ema-{sync}", *RESUME[:-1], "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        hashes[sync] = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(hashes[sync]) == 2 and all(len(h) == 2 for h in hashes[sync])
    assert all(h[0] == h[1] for h in hashes[True])
    assert any(h[0] != h[1] for h in hashes[False])


@pytest.mark.cuda
def test_fused_adamw_rolls_back_after_a_resume_on_cuda():
    device = torch.device("cuda", 0)
    model = _model().to(device)
    optimizer = smart_optimizer(model, "AdamW", lr=0.01, momentum=0.9, decay=5e-4)
    ema, scaler = ModelEMA(model), torch.amp.GradScaler("cuda", enabled=True)
    recovery = NanRecovery(2, model, ema, optimizer, scaler)
    for _ in range(2):
        scaler.scale(model(torch.rand(2, 3, 8, 8, device=device)).square().mean()).backward()
        recovery.remember()
        optimizer_step(model, optimizer, scaler, ema)
    saved = {"optimizer": optimizer.state_dict(), "recovery": recovery.state_dict()}
    optimizer2 = smart_optimizer(model, "AdamW", lr=0.01, momentum=0.9, decay=5e-4)
    optimizer2.load_state_dict(saved["optimizer"])
    resumed = NanRecovery(2, model, ema, optimizer2, scaler)
    resumed.load_state_dict(saved["recovery"])
    assert resumed.restore()
    scaler.scale(model(torch.rand(2, 3, 8, 8, device=device)).square().mean()).backward()
    optimizer_step(model, optimizer2, scaler, ema)  # fused AdamW takes the restored step tensors
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.dist
def test_a_val_rank_that_fails_ends_the_job_promptly(tiny_data, tiny_v8n, tmp_path):
    """Rank 1 of val.py fails as its evaluation starts while rank 0 waits to gather: the failed rank must not
    wait for its peers (it used to sit in a barrier while rank 0 sat in the gather), so torchrun ends the job
    with the error named, long before any collective timeout, even with the watchdog off."""
    import time
    started = time.monotonic()
    p = subprocess.run([*TORCHRUN, str(ROOT / "tests" / "scripts" / "crash_val_rank1.py"), "--weights", str(tiny_v8n),
                        "--data", str(tiny_data), "--imgsz", "64", "--batch-size", "4", "--workers", "0",
                        "--hang-timeout", "0", "--project", str(tmp_path)], cwd=ROOT, env=run_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "simulated out of memory on rank 1" in p.stdout + p.stderr
    assert time.monotonic() - started < 120


def test_a_rollback_puts_the_scalers_scale_back_without_reading_it_each_step():
    """fp16's GradScaler under --nan-recover: the copy taken at each step keeps the scale on the device (no host
    read), a rollback restores it, and a checkpoint carries it in the scaler's own state_dict form."""
    model = _model()
    optimizer = smart_optimizer(model, "SGD", lr=0.01, momentum=0.9, decay=5e-4)
    ema, scaler = ModelEMA(model), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, enabled=True)
    recovery = NanRecovery(2, model, ema, optimizer, scaler)
    scaler.scale(model(torch.rand(2, 3, 8, 8)).square().mean()).backward()
    recovery.remember()
    assert torch.is_tensor(recovery._saved.scaler["scale"])
    optimizer_step(model, optimizer, scaler, ema)
    scaler.update(2.0 ** 3)  # the scale moved on after the copy
    saved = recovery.state_dict()["saved"]["scaler"]
    assert saved["scale"] == 2.0 ** 8 and isinstance(saved["_growth_tracker"], int)
    assert recovery.restore() and scaler.get_scale() == 2.0 ** 8
    resumed = NanRecovery(2, model, ema, optimizer, scaler)
    resumed.load_state_dict(recovery.state_dict())
    scaler.update(2.0 ** 2)
    assert resumed.restore() and scaler.get_scale() == 2.0 ** 8


def test_a_training_step_reads_the_device_once_per_optimizer_step(tiny_data, tmp_path, monkeypatch):
    """The whole step on the meta device, where any read of a tensor's value raises: forward, loss, the NaN flag,
    backward, the optimizer step and the EMA run without one, and at each optimizer step check_step's
    host_values is the one device-to-host copy (counted here; four batches, two optimizer steps). The Step is
    built from its parts, as setup builds it, on the meta device."""
    import dataclasses
    import contextlib

    from yolotrain.app import train
    from yolotrain.utils.core import dist
    from yolotrain.utils.core.cli import ResolvedArgs
    from yolotrain.utils.core.dist import DistInfo
    from yolotrain.utils.core.watchdog import Watchdog
    from yolotrain.utils.engine import loop as engine_loop
    from yolotrain.utils.engine import step as engine_step
    from yolotrain.utils.engine.config import Resume, resolve_config
    from yolotrain.utils.engine.hooks import build_hooks
    from yolotrain.utils.engine.optim import LRSchedule, Warmup
    from yolotrain.utils.engine.preempt import StopRequest
    from yolotrain.utils.engine.setup import build_training
    from yolotrain.utils.engine.step import Step, StepOptions, StepParts, build_step

    argv = ["--data", str(tiny_data), "--project", str(tmp_path), "--imgsz", "64", "--batch-size", "4", "--workers",
            "0", "--optimizer", "SGD", "--noplots", "--no-amp", "--epochs", "1", "--seed", "1"]
    cfg = resolve_config(Resume(ResolvedArgs(**vars(train.build_parser().parse_args(argv)))), torch.device("cpu"))
    t = build_training(cfg, DistInfo(), torch.device("cpu"))
    meta = torch.device("meta")
    model, ema = t.step.model.to(meta), t.step.ema
    ema.ema.to(meta)
    optimizer = smart_optimizer(model, "SGD", lr=0.01, momentum=0.9, decay=5e-4)
    lr = LRSchedule(optimizer, Warmup(iters=-1, bias_lr=0.0, momentum0=0.8, momentum=0.9), 1, lrf=0.01, cos=False)
    criterion = model.detect.build_criterion(t.hyp, t.imgsz)
    plan = dataclasses.replace(t.plan, accumulate=2)
    step = build_step(StepParts(model, criterion, optimizer, t.step.scaler, ema, lr), plan, DistInfo(), meta,
                      StepOptions(amp=False, graphs=False, sync_bn=False, compile=False))
    t = dataclasses.replace(t, device=meta, step=step, state=dataclasses.replace(t.state, device=meta))
    monkeypatch.setattr(Step, "autocast", lambda self: contextlib.nullcontext())  # autocast has no meta device
    monkeypatch.setattr(type(criterion), "packed_loss", type(criterion)._loss)  # ... nor the loss's fp32 guard
    monkeypatch.setattr(dist, "reduce_mean", lambda x: torch.zeros(x.shape))  # the epoch's one closing copy
    copies = []
    monkeypatch.setattr(engine_step, "host_values", lambda x: copies.append(x.shape) or [0.0] * x.numel())
    engine_loop.train_one_epoch(t, build_hooks(t), StopRequest(), Watchdog(0, 0))
    assert t.batches_per_epoch == 4 and len(copies) == 2  # batches 2 and 4 step
    assert next(model.parameters()).device == meta
