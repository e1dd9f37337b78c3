"""--cuda-graphs: the settings it refuses, with messages, on any machine; on a GPU (the ``cuda`` marker), graphed
training steps that equal eager ones and a train.py run that captures, replays and saves."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from models.yolo import Model
from tests.conftest import ROOT, run_env
from utils.core.hyp import Hyp
from utils.engine.config import RESUME_HARMLESS
from utils.engine.graphs import GraphedForward, accumulation_problem, graphs_problem
from utils.engine.loop import optimizer_step
from utils.engine.optim import ModelEMA
from yolotrain.app import train

CUDA = torch.device("cuda")


def test_graphs_problem_names_each_setting_it_cannot_run_with():
    assert graphs_problem(CUDA, 1, compile_=False, rect=False, multi_scale=False) is None
    assert "needs a CUDA device (this run is on cpu)" in graphs_problem(torch.device("cpu"), 1, False, False, False)
    assert "one process per job (this job has 2)" in graphs_problem(CUDA, 2, False, False, False)
    assert "--compile" in graphs_problem(CUDA, 1, True, False, False)
    assert "--rect changes it" in graphs_problem(CUDA, 1, False, True, False)
    assert "--multi-scale changes it" in graphs_problem(CUDA, 1, False, False, True)


def test_accumulation_problem_asks_for_a_step_per_batch():
    assert accumulation_problem(64, 1, 64) is None
    message = accumulation_problem(16, 4, 64)
    assert "accumulates 4 batches per step" in message and "use --batch-size 64 or more" in message


def test_cuda_graphs_is_a_flag_a_resume_may_switch():
    assert train.build_parser().parse_args(["--cuda-graphs"]).cuda_graphs is True
    assert train.build_parser().parse_args([]).cuda_graphs is False
    assert "cuda_graphs" in RESUME_HARMLESS


def test_train_on_a_cpu_refuses_cuda_graphs_with_one_line(tmp_path):
    p = subprocess.run([sys.executable, "train.py", "--cuda-graphs", "--device", "cpu", "--epochs", "1",
                        "--project", str(tmp_path)], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0
    assert "--cuda-graphs needs a CUDA device (this run is on cpu)" in p.stderr + p.stdout
    assert "Traceback" not in p.stderr
    assert not list(tmp_path.iterdir())  # refused before a run folder is made


def _targets(batch: int, generator: torch.Generator) -> torch.Tensor:
    n = 3 * batch
    return torch.cat([torch.randint(0, batch, (n, 1), generator=generator).float(),
                      torch.randint(0, 3, (n, 1), generator=generator).float(),
                      torch.rand(n, 2, generator=generator) * 0.6 + 0.2,
                      torch.rand(n, 2, generator=generator) * 0.2 + 0.05], 1)


def _steps(model, run_model, batches) -> list[float]:
    """AdamW steps under fp16 autocast (its cast cache off, as --cuda-graphs runs) as the loop takes them."""
    criterion = model.detect.build_criterion(Hyp(), 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler, ema = torch.amp.GradScaler("cuda"), ModelEMA(model)
    losses = []
    for imgs, targets in batches:
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            loss, _ = criterion(run_model(imgs), targets)
        scaler.scale(loss).backward()
        optimizer_step(model, optimizer, scaler, ema)
        losses.append(float(loss))
    return losses


@pytest.mark.cuda
def test_graphed_steps_equal_eager_steps_on_cuda(monkeypatch):
    """Replayed graphs train what the eager module trains: the same losses, weights and BatchNorm statistics
    after steps at the captured shape and one at another shape (eager), and the capture's warm-up leaves
    no trace in the statistics."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    eager = Model(ROOT / "models" / "yolov8n.yaml", nc=3).to(CUDA).train()
    graphed = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(8, 3, 64, 64, generator=g).to(CUDA), _targets(8, g)) for _ in range(3)]
    batches.append((torch.rand(5, 3, 64, 64, generator=g).to(CUDA), _targets(5, g)))  # another shape: eager
    forward = GraphedForward(graphed)
    a, b = _steps(eager, eager, batches), _steps(graphed, forward, batches)
    assert forward.signature is not None and forward.signature[0] == (8, 3, 64, 64)
    assert "forward" not in vars(graphed)  # the module keeps its own forward: copies and eval stay eager
    assert a == pytest.approx(b, rel=1e-4)
    for (name, x), y in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-5), name


@pytest.mark.cuda
def test_an_epoch_with_cuda_graphs_captures_replays_and_saves(tiny_data, tmp_path):
    """train.py --cuda-graphs, one step per batch and in micro-steps of 8: finite weights in last.pt and the
    capture's line in the log."""
    for name, extra in (("steps", []), ("micro", ["--micro-steps", "8"])):
        cmd = [sys.executable, "train.py", "--data", str(tiny_data), "--project", str(tmp_path), "--name", name,
               "--imgsz", "64", "--batch-size", "16", "--workers", "1", "--epochs", "2", "--device", "0",
               "--cuda-graphs", *extra]
        p = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        shape = "(8, 3, 64, 64)" if extra else "(16, 3, 64, 64)"
        assert f"--cuda-graphs: the training forward and backward captured for input {shape}" in p.stdout + p.stderr
        ckpt = torch.load(tmp_path / name / "weights" / "last.pt", map_location="cpu", weights_only=True)
        assert all(v.isfinite().all() for v in ckpt["model"].values() if v.is_floating_point())
