"""The step owns what it steps: a new stateful part is one class, and checkpoints written before the step owned
its state resume here bit for bit."""
from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHON, RESUME, ROOT, assert_same_run, load, run, run_env, run_train

SLOW_EMA = str(ROOT / "tests" / "scripts" / "slow_ema.py")
OLD_MAIN = "4563ef1"  # the last main whose run state, not the step, held the model, EMA, optimizer and LR


@pytest.mark.slow
def test_a_new_stateful_step_part_checkpoints_and_resumes_exactly(tiny_data, tmp_path, reference_run):
    """tests/scripts/slow_ema.py adds a second EMA (a StepExtra and its builder line, nothing else): it is
    updated at every optimizer step, saved under its own key, and a run killed mid-epoch and resumed ends with
    the undisturbed run's bits, the second EMA's included; the rest of the run is the run without it."""
    straight = load(reference_run(*RESUME, "--save-interval", "1e-9", script=(SLOW_EMA,)).last)
    p = run_train([PYTHON], tiny_data, tmp_path, "cut", *RESUME, "--save-interval", "1e-9",
                  script=(SLOW_EMA, "--die-at", "2:2"), ok=None)
    assert p.returncode == 137, (p.stdout + p.stderr)[-3000:]
    last = tmp_path / "cut" / "weights" / "last.pt"
    assert load(last)["ema_slow"]["updates"] > 0
    run([PYTHON, SLOW_EMA, "--resume", last])
    resumed = load(last)
    assert_same_run(straight, resumed)
    slow, fast = straight["ema_slow"]["weights"], straight["ema"]
    assert resumed["ema_slow"]["updates"] == straight["ema_slow"]["updates"] > 0
    assert all(torch.equal(slow[k], resumed["ema_slow"]["weights"][k]) for k in slow)
    assert any(not torch.equal(slow[k], fast[k]) for k in slow if slow[k].is_floating_point())  # its own average
    assert_same_run(load(reference_run(*RESUME).last), straight)  # the part changes nothing else


def _old_main(folder: Path) -> Path:
    """The tree of OLD_MAIN, from this clone's history (skips where the clone has no such commit)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_MAIN], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {OLD_MAIN} is not in this clone's history (a shallow clone?)")
    tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(folder, filter="tar")
    return folder


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_of_the_old_layout_resumes_bit_identically(tiny_data, tmp_path, reference_run):
    """A run of OLD_MAIN's code killed right after a mid-epoch last.pt, resumed by this code: the undisturbed
    run's bits (the step's keys in the file are the ones the run state wrote)."""
    old = _old_main(tmp_path / "old")
    p = subprocess.run([PYTHON, old / "tests" / "scripts" / "die_after_save.py", "--die-at", "2:2", "--data",
                        str(tiny_data), "--project", str(tmp_path), "--name", "cut", *RESUME, "--save-interval",
                        "1e-9"], cwd=old, env=run_env(PYTHONPATH=str(old)), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 137, (p.stdout + p.stderr)[-3000:]
    last = tmp_path / "cut" / "weights" / "last.pt"
    saved = load(last)
    assert (saved["epoch"], saved["batches_done"]) == (0, 2) and {"optimizer", "mloss", "lr_scale"} <= saved.keys()
    out = run([PYTHON, "train.py", "--resume", last]).stdout
    assert "from epoch 2, batch 3" in out
    assert_same_run(load(reference_run(*RESUME).last), last)
