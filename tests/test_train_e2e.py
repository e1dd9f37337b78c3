"""End to end: torchrun 2 ranks on CPU -> rank-0 checkpoints -> val.py reproduces the logged metrics."""
from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_env

TINY = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0", "--seed", "3"]


def _run(args, timeout=400):
    return subprocess.run(args, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ddp_run(tiny_data, tmp_path_factory):
    project = tmp_path_factory.mktemp("runs")
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "train.py", "--data", str(tiny_data), "--epochs", "2", "--project", str(project), "--name", "ddp", *TINY])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return project / "ddp", p


def test_ddp_training_writes_one_set_of_files(ddp_run):
    run_dir, p = ddp_run
    assert sorted(f.name for f in (run_dir / "weights").iterdir()) == ["best.pt", "last.pt"]
    assert sorted(f.name for f in run_dir.iterdir()) == ["hyp.yaml", "opt.yaml", "results.csv", "weights"]
    for name in ("best.pt", "last.pt"):
        ckpt = torch.load(run_dir / "weights" / name, weights_only=True)
        assert ckpt["world_size"] == 2 and ckpt["epoch"] in (0, 1) and "optimizer" not in ckpt
        assert set(ckpt["model"]) == set(ckpt["ema"])
    rows = list(csv.DictReader(open(run_dir / "results.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    # one log, not one per rank: each epoch summary appears once
    assert p.stdout.count("epoch 2/2:") == 1
    assert "[rank 1]" not in p.stdout


def test_val_reproduces_best_epoch_metrics(ddp_run, tiny_data):
    run_dir, _ = ddp_run
    ckpt = torch.load(run_dir / "weights" / "best.pt", weights_only=True)
    p = _run([sys.executable, "val.py", "--weights", str(run_dir / "weights" / "best.pt"), "--data", str(tiny_data),
              "--batch-size", "4", "--workers", "0"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("Results:")][-1]
    map50, map5095 = float(line.split()[2]), float(line.split()[4])
    assert abs(map50 - ckpt["metrics"]["map50"]) < 1e-4
    assert abs(map5095 - ckpt["metrics"]["map"]) < 1e-4


def test_val_under_torchrun_matches_single_process(ddp_run, tiny_data):
    run_dir, _ = ddp_run
    outs = []
    for launcher in ([sys.executable], [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]):
        p = _run([*launcher, "val.py", "--weights", str(run_dir / "weights" / "last.pt"), "--data", str(tiny_data),
                  "--batch-size", "2", "--workers", "0"])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        outs.append([l for l in p.stdout.splitlines() if l.startswith("Results:")][-1])
    assert outs[0] == outs[1]


def test_bad_data_yaml_is_one_clear_error_on_every_rank(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: nowhere/images\nval: nowhere/images\nnames: [a]\n")
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "train.py", "--data", str(bad), "--epochs", "1", "--project", str(tmp_path / "runs"), *TINY], timeout=200)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "ERROR: " in out and "bad.yaml: 'train' path not found" in out
    assert "[rank 1] ERROR:" in out  # the waiting rank says why it stops too
    # torchrun's launcher prints its own ChildFailedError report; no frame may come from our code
    ours = [f'File "{ROOT / name}' for name in ("train.py", "val.py", "utils", "models", "data")]
    assert not any(frame in out for frame in ours) and "UserError" not in out


def test_bad_data_yaml_single_process_exits_1_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: nowhere/images\nval: nowhere/images\nnames: [a]\n")
    p = _run([sys.executable, "train.py", "--data", str(bad), "--project", str(tmp_path / "runs"), *TINY], timeout=100)
    assert p.returncode == 1
    assert "bad.yaml: 'train' path not found" in p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
