"""Training on CUDA (and NCCL with two GPUs): run by pytest wherever GPUs are present, skipped elsewhere
(the ``cuda`` marker, tests/conftest.py). Their CPU twins live beside the code they prove: test_engine_gpu.py,
test_checkpoint.py (the RNG), test_device.py, test_export_device.py, test_eval_device.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import PYTHON, RESUME, ROOT, TORCHRUN, run, run_env, run_train

SCRIPTS = ROOT / "tests" / "scripts"
pytestmark = pytest.mark.slow


RUN_SECONDS = 300  # one tiny training on a GPU host: a run past this has stalled


def _run(cmd: list, env=None) -> subprocess.CompletedProcess:
    """A run that fails the test with its last output when it stalls, instead of holding the GPU checks' time to
    the end."""
    return run(cmd, ok=None, env=env, timeout=RUN_SECONDS)


def _train(tmp_path, name: str, extra=(), script=("train.py",), launcher=(PYTHON,), env=None, data=None):
    return run_train(launcher, data, tmp_path, name, *RESUME, *extra, script=script, ok=None, env=env,
                     timeout=RUN_SECONDS)


def _weights(path) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return {k: ckpt[k] for k in ("model", "ema")}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


@pytest.mark.cuda
@pytest.mark.parametrize("cfg, optimizer", [("models/yolov5n.yaml", "SGD"), ("models/yolov8n.yaml", "auto")])
def test_an_epoch_on_a_gpu_and_its_checkpoint_loads_on_a_cpu_only_machine(tiny_data, tmp_path, cfg, optimizer):
    """yolov5n with SGD and yolov8n with fused AdamW under fp16: finite losses, the GradScaler's state saved, and
    last.pt readable with weights_only=True where no GPU is visible."""
    p = _train(tmp_path, "gpu", ["--device", "0", "--cfg", cfg, "--optimizer", optimizer, "--epochs", "1",
                                 "--keep-optimizer"], data=tiny_data)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    last = tmp_path / "gpu" / "weights" / "last.pt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["scaler"].get("scale", 0) > 0 and ckpt["val_precision"] == "fp16"
    assert all(v.isfinite().all() for v in ckpt["model"].values() if v.is_floating_point())
    probe = ("import torch; from yolotrain.utils.weights.checkpoint import load_model; "
             f"m, card = load_model({str(last)!r}, torch.device('cpu')); print(torch.cuda.is_available(), card.epoch)")
    q = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env={**run_env(), "CUDA_VISIBLE_DEVICES": ""},
                       capture_output=True, text=True, timeout=300)
    assert q.returncode == 0 and q.stdout.split() == ["False", "0"], q.stderr[-2000:]


@pytest.mark.cuda
def test_an_fp16_gradient_overflow_is_skipped_by_the_scaler(tiny_data, tmp_path):
    """An inf/NaN gradient under fp16 is the GradScaler's to skip: the run ends normally, no recovery needed."""
    p = _train(tmp_path, "inf", ["--device", "0"], script=(SCRIPTS / "nan_grad.py", "3"), data=tiny_data)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    last = _weights(tmp_path / "inf" / "weights" / "last.pt")
    assert all(v.isfinite().all() for part in last.values() for v in part.values() if v.is_floating_point())


@pytest.mark.cuda
def test_exact_resume_on_cuda_under_deterministic(tiny_data, tmp_path):
    straight = _train(tmp_path, "straight", ["--device", "0", "--deterministic"], data=tiny_data)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    die = (SCRIPTS / "die_after_save.py", "--die-at", "2:2")
    _train(tmp_path, "cut", ["--device", "0", "--deterministic", "--save-interval", "1e-9"], script=die, data=tiny_data)
    last = tmp_path / "cut" / "weights" / "last.pt"
    p = _run([PYTHON, "train.py", "--resume", str(last)])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert _same(_weights(tmp_path / "straight" / "weights" / "last.pt"), _weights(last))


@pytest.mark.cuda(devices=2)
def test_a_resume_sees_fewer_gpus_than_the_run_saved_with(tiny_data, tmp_path):
    """Saved on cuda:1 of two visible GPUs, resumed where one GPU is visible (a SLURM requeue with one per task)."""
    die = (SCRIPTS / "die_after_save.py", "--die-at", "2:2")
    two = {**run_env(), "CUDA_VISIBLE_DEVICES": "0,1"}
    _train(tmp_path, "cut", ["--device", "1", "--save-interval", "1e-9"], script=die, env=two, data=tiny_data)
    last = tmp_path / "cut" / "weights" / "last.pt"
    p = _run([PYTHON, "train.py", "--resume", str(last), "--device", "0"],
             env={**run_env(), "CUDA_VISIBLE_DEVICES": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]


@pytest.mark.cuda(devices=2)
@pytest.mark.parametrize("sync_bn", [False, True], ids=["bn", "sync-bn"])
def test_two_gpus_validate_with_one_ema(tiny_data, tmp_path, sync_bn):
    out = tmp_path / "hashes.jsonl"
    env = {**run_env(), "EMA_HASHES": str(out), "EMA_NO_SYNC": "0"}
    p = _train(tmp_path, "ema", ["--device", "0,1", *(["--sync-bn"] if sync_bn else [])],
               script=(SCRIPTS / "ema_ranks.py",), launcher=TORCHRUN, env=env, data=tiny_data)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    hashes = [json.loads(line) for line in out.read_text().splitlines()]
    assert hashes and all(h[0] == h[1] for h in hashes)


@pytest.mark.cuda(devices=2)
def test_nccl_nan_recovery_and_a_preemption(tiny_data, tmp_path):
    """The per-step agreement on nccl: a NaN gradient on rank 1 is rolled back on both ranks; SIGUSR1 on one rank
    stops both at the same optimizer step with exit 75."""
    p = _train(tmp_path, "nan", ["--device", "0,1", "--no-amp", "--nan-recover", "2"],
               script=(SCRIPTS / "nan_grad.py", "3"), launcher=TORCHRUN, data=tiny_data)
    assert p.returncode == 0 and "recovery 1/2" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    q = _train(tmp_path, "usr1", ["--device", "0,1", "--no-amp"], script=(SCRIPTS / "nan_grad.py", "0"),
               launcher=TORCHRUN, env={**run_env(), "NAN_GRAD_USR1_AT": "3"}, data=tiny_data)
    assert q.returncode != 0 and "exiting with code 75" in q.stdout + q.stderr, (q.stdout + q.stderr)[-3000:]
