"""YOLO26 (the end-to-end head, E2ELoss with ProgLoss) keeps the engine's guarantees: two ranks, a stop signal
mid-epoch and --resume end bit-identical to the undisturbed run, and validation gives the same numbers on one
rank and two."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import ROOT, run_env
from tests.test_resume import _wait_until_gone

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EPOCHS = 3
ARGS = ["--cfg", "models/yolo26n.yaml", "--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers",
        "1", "--seed", "5", "--epochs", str(EPOCHS)]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _assert_same_run(a: dict, b: dict) -> None:
    assert a["epoch"] == b["epoch"] == EPOCHS - 1
    for key in ("model", "ema"):
        assert [k for k in a[key] if not torch.equal(a[key][k], b[key][k])] == [], key
    assert a["metrics"] == b["metrics"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=600)


def _stopped_mid_run(cmd: list[str], run_dir) -> None:
    """Start the run, SIGTERM one worker once the loop trains; every rank agrees, saves and exits 75."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, training = [], threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("epoch 1/"):  # the first epoch is recorded: stop inside the second
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert training.wait(timeout=300), "".join(lines)[-3000:]
    time.sleep(0.3)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        os.kill(int(f.read().split()[0]), signal.SIGTERM)
    proc.wait(timeout=300)
    reader.join(timeout=60)
    _wait_until_gone(str(run_dir))
    assert "exiting with code 75" in "".join(lines), "".join(lines)[-3000:]


def test_yolo26_two_ranks_stopped_and_resumed_end_as_the_undisturbed_run(tiny_data, tmp_path):
    base = [*TORCHRUN, "train.py", "--data", str(tiny_data), "--project", str(tmp_path), *ARGS]
    p = _run([*base, "--name", "straight"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    _stopped_mid_run([*base, "--name", "cut"], tmp_path / "cut")
    last = tmp_path / "cut" / "weights" / "last.pt"
    assert "optimizer" in torch.load(last, weights_only=True)
    p = _run([*TORCHRUN, "train.py", "--resume", str(last)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    _assert_same_run(torch.load(tmp_path / "straight" / "weights" / "last.pt", weights_only=True),
                     torch.load(last, weights_only=True))

    best, scores = tmp_path / "straight" / "weights" / "best.pt", []
    for launcher, name in (([sys.executable], "v1"), (TORCHRUN, "v2")):
        p = _run([*launcher, "val.py", "--weights", str(best), "--data", str(tiny_data), "--imgsz", "64",
                  "--batch-size", "6", "--save-json", "--noplots", "--project", str(tmp_path), "--name", name])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        scores.append(json.loads((tmp_path / name / "metrics.json").read_text())["metrics"])
        assert json.loads((tmp_path / name / "metrics.json").read_text())["end2end"] is True
    assert scores[0] == scores[1]
    assert (tmp_path / "v1" / "predictions.json").read_text() == (tmp_path / "v2" / "predictions.json").read_text()


def test_yolo26_musgd_two_ranks_roll_back_a_diverged_step_and_a_time_budget_ends_cleanly(tiny_data, tmp_path):
    """--nan-recover on the end-to-end head with MuSGD's boosted class-branch groups, two ranks: the NaN step is
    rolled back on both and the run ends with finite weights; --time on one process ends like a normal end."""
    nan_grad = str(ROOT / "tests" / "scripts" / "nan_grad.py")
    common = [*ARGS[:-1], "1", "--data", str(tiny_data), "--project", str(tmp_path)]
    p = _run([*TORCHRUN, nan_grad, "3", *common, "--name", "nan", "--optimizer", "MuSGD", "--nan-recover", "2"])
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "recovery 1/2: rolled back to the state before the last optimizer step" in out
    assert "the class branches' " in out and "at 3x the LR" in out
    last = torch.load(tmp_path / "nan" / "weights" / "last.pt", weights_only=True)
    assert all(v.isfinite().all() for key in ("model", "ema") for v in last[key].values() if v.is_floating_point())
    p = _run([sys.executable, "train.py", *ARGS, "--data", str(tiny_data), "--project", str(tmp_path), "--name",
              "budget", "--time", "0.0001"])
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "--time 0.0001 h: 1 epochs fit" in out, out[-3000:]
    assert (tmp_path / "budget" / "weights" / "best.pt").exists()
