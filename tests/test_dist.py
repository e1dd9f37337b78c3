"""Distributed helpers: device selection errors, and zero-first under a real 2-process torchrun."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from utils import dist
from utils.errors import UserError
from tests.conftest import ROOT, run_env


def test_single_process_defaults(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    info = dist.dist_info()
    assert (info.rank, info.world_size, info.is_main, info.distributed) == (0, 1, True, False)
    assert dist.dist_info(local_rank_flag=3).local_rank == 3  # legacy --local-rank flag
    with dist.torch_distributed_zero_first(0):
        pass
    assert dist.all_gather_object(5) == [5] and dist.broadcast_object("x") == "x"
    assert dist.select_device("cpu", 16) == torch.device("cpu")


def test_torchrun_env_is_read(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert dist.dist_info() == dist.DistInfo(rank=3, local_rank=1, world_size=4, local_world_size=2)


def test_batch_not_divisible_by_world_size():
    info = dist.DistInfo(rank=0, local_rank=0, world_size=3, local_world_size=3)
    with pytest.raises(UserError, match="--batch-size 16 must be a multiple of the world size 3"):
        dist.select_device("cpu", 16, info)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("device", ["0", "0,1", "cuda:0"])
def test_missing_cuda_device_is_clear(device):
    with pytest.raises(UserError, match="CUDA is not available"):
        dist.select_device(device, 16)


def _torchrun(tmp_path, mode):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "scripts" / "zero_first.py"), str(tmp_path), mode]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=240)
    return p, time.time() - t0


def test_zero_first_master_works_first_and_objects_travel(tmp_path):
    p, _ = _torchrun(tmp_path, "ok")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "read1").read_text() == "by rank 0"  # rank 1 waited for rank 0's file
    for r in (0, 1):
        assert (tmp_path / f"result{r}").read_text() == "[0, 10] decision from rank 0"


def test_zero_first_master_failure_stops_every_rank_promptly(tmp_path):
    p, seconds = _torchrun(tmp_path, "fail")
    assert p.returncode != 0
    assert "ERROR rank 0: data.yaml: simulated scan failure" in p.stderr
    assert "ERROR rank 1: a node's local rank 0 failed while preparing data" in p.stderr
    assert not (tmp_path / "read1").exists()
    assert seconds < 120
