"""YOLO26 (the end-to-end head, E2ELoss with ProgLoss) keeps the engine's guarantees: two ranks, a stop signal
mid-epoch and --resume end bit-identical to the undisturbed run, and validation gives the same numbers on one
rank and two."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from tests.helpers import (NAN_GRAD, RESUME, ROOT, TORCHRUN, assert_same_run, children, load, out, run,
                           run_env, train_here, val_here, wait_until_gone)

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EPOCHS = 3
ARGS = ["--cfg", "models/yolo26n.yaml", *RESUME, "--epochs", str(EPOCHS)]


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
    os.kill(children(proc.pid)[0], signal.SIGTERM)
    proc.wait(timeout=300)
    reader.join(timeout=60)
    wait_until_gone(str(run_dir))
    assert "exiting with code 75" in "".join(lines), "".join(lines)[-3000:]


def test_yolo26_two_ranks_stopped_and_resumed_end_as_the_undisturbed_run(tiny_data, tmp_path, restore_logger):
    base = [*TORCHRUN, "train.py", "--data", str(tiny_data), "--project", str(tmp_path), *ARGS]
    run([*base, "--name", "straight"])
    _stopped_mid_run([*base, "--name", "cut"], tmp_path / "cut")
    last = tmp_path / "cut" / "weights" / "last.pt"
    assert "optimizer" in load(last)
    run([*TORCHRUN, "train.py", "--resume", last])
    assert_same_run(tmp_path / "straight" / "weights" / "last.pt", last, epochs=EPOCHS)

    best, scores = tmp_path / "straight" / "weights" / "best.pt", []
    val = ["--weights", best, "--data", tiny_data, "--imgsz", "64", "--batch-size", "6", "--save-json", "--noplots",
           "--project", tmp_path, "--name"]
    val_here(*val, "v1")  # one rank: this process; two: torchrun
    run([*TORCHRUN, "val.py", *val, "v2"])
    for name in ("v1", "v2"):
        scores.append(json.loads((tmp_path / name / "metrics.json").read_text())["metrics"])
        assert json.loads((tmp_path / name / "metrics.json").read_text())["end2end"] is True
    assert scores[0] == scores[1]
    assert (tmp_path / "v1" / "predictions.json").read_text() == (tmp_path / "v2" / "predictions.json").read_text()


def test_yolo26_musgd_two_ranks_roll_back_a_diverged_step_and_a_time_budget_ends_cleanly(tiny_data, tmp_path,
                                                                                           capsys, restore_logger):
    """--nan-recover on the end-to-end head with MuSGD's boosted class-branch groups, two ranks: the NaN step is
    rolled back on both and the run ends with finite weights; --time on one process ends like a normal end."""
    common = [*ARGS, "--epochs", "1", "--data", str(tiny_data), "--project", str(tmp_path)]
    p = run([*TORCHRUN, NAN_GRAD, "3", *common, "--name", "nan", "--optimizer", "MuSGD", "--nan-recover", "2"])
    assert "recovery 1/2: rolled back to the state before the last optimizer step" in out(p)
    assert "the class branches' " in out(p) and "at 3x the LR" in out(p)
    last = load(tmp_path / "nan" / "weights" / "last.pt")
    assert all(v.isfinite().all() for key in ("model", "ema") for v in last[key].values() if v.is_floating_point())
    train_here(*ARGS, "--data", tiny_data, "--project", tmp_path, "--name", "budget", "--time", "0.0001")
    assert "--time 0.0001 h: 1 epochs fit" in capsys.readouterr().out
    assert (tmp_path / "budget" / "weights" / "best.pt").exists()
