"""Distributed helpers: device selection errors, and zero-first under a real 2-process torchrun."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from yolotrain.utils.core import dist
from yolotrain.utils.core.cores import set_cpu_threads
from yolotrain.utils.core.errors import UserError
from tests.helpers import ROOT, TORCHRUN, free_port, run, run_env


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
    with pytest.raises(UserError, match="--val-batch-size 8 must be a multiple of the world size 3"):
        dist.per_rank_batch(8, info, "--val-batch-size")
    assert dist.per_rank_batch(12, info) == 4  # every CLI's batch is global: a rank takes its share


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("device", ["0", "0,1", "cuda:0"])
def test_missing_cuda_device_is_clear(device):
    with pytest.raises(UserError, match="CUDA is not available"):
        dist.select_device(device, 16)


def _torchrun(tmp_path, mode):
    t0 = time.time()
    p = run([*TORCHRUN, ROOT / "tests" / "scripts" / "zero_first.py", tmp_path, mode], ok=None, timeout=240)
    return p, time.time() - t0


@pytest.mark.slow
@pytest.mark.dist
def test_zero_first_master_works_first_and_objects_travel(tmp_path):
    p, _ = _torchrun(tmp_path, "ok")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "read1").read_text() == "by rank 0"  # rank 1 waited for rank 0's file
    for r in (0, 1):
        assert (tmp_path / f"result{r}").read_text() == "[0, 10] decision from rank 0"
        assert (tmp_path / f"released{r}").read_text() == "True"  # leaving the group freed the cyclic DDP wrapper


@pytest.mark.slow
@pytest.mark.dist
def test_zero_first_master_failure_stops_every_rank_promptly(tmp_path):
    p, seconds = _torchrun(tmp_path, "fail")
    assert p.returncode != 0
    assert "ERROR rank 0: data.yaml: simulated scan failure" in p.stderr
    assert "ERROR rank 1: data.yaml: simulated scan failure" in p.stderr  # the master's own message, not a pointer
    assert not (tmp_path / "read1").exists()
    assert seconds < 120


# ---------------------------------------------------------------- SLURM and multi-node
def test_first_slurm_host():
    assert dist.first_slurm_host("gpu[07-09,12],cpu1") == "gpu07"
    assert dist.first_slurm_host("node-a,node-b") == "node-a"
    assert dist.first_slurm_host("n[3-4]-ib") == "n3-ib"
    assert dist.first_slurm_host("solo") == "solo"


def test_slurm_env_is_read_when_torchrun_is_absent():
    env = dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_TASKS_PER_NODE="4(x2)",
               SLURM_JOB_NODELIST="gpu[12-13]", SLURM_JOB_ID="4242")
    assert dist.dist_info(env=env) == dist.DistInfo(rank=5, local_rank=1, world_size=8, local_world_size=4)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"]) == ("gpu12", "29742", "5")  # for env:// init
    torchrun = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", SLURM_PROCID="5", SLURM_NTASKS="8")
    assert dist.dist_info(env=torchrun) == dist.DistInfo(0, 0, 2, 2)  # srun torchrun ...: torchrun's win
    assert dist.dist_info(env=dict(SLURM_PROCID="0", SLURM_NTASKS="1")).world_size == 1  # salloc + python


def _fresh_data(tmp_path):
    """A data yaml whose dataset does not exist yet, so generation and label scans really happen."""
    yaml_file = tmp_path / "fresh.yaml"
    yaml_file.write_text("path: shapes\ntrain: images/train\nval: images/val\nnames: [a, b, c, d, e, f]\n"
                         "generate: shapes\ngenerate_args: {seed: 2, n_train: 8, n_val: 4, img_size: 64}\n")
    return yaml_file


def _events(log):
    import json
    return [json.loads(line) for line in log.read_text().splitlines()]


TRAIN_ARGS = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "8", "--workers", "0", "--epochs", "2",
              "--noautoanchor"]


@pytest.mark.slow
@pytest.mark.dist
def test_two_nodes_scan_once_per_job_and_checkpoint_once(tmp_path):
    """Two torchrun agents on this machine as two nodes of 2 ranks each, sharing the dataset folder: training
    completes, each node's local rank 0 alone generates the data, global rank 0 alone scans each split (every
    other rank reads its label cache), and only global rank 0 writes checkpoints."""
    data, log, port = _fresh_data(tmp_path), tmp_path / "events.jsonl", free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
                               str(node), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
                               str(port), str(ROOT / "tests" / "scripts" / "record_prep.py"), str(log),
                               "--data", str(data), "--project", str(tmp_path), "--name", "mn", *TRAIN_ARGS],
                              cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    events = _events(log)
    prep = [e for e in events if e["event"] in ("generate", "scan")]
    assert prep and all(e["local_rank"] == 0 for e in prep), prep
    assert {e["node"] for e in prep if e["event"] == "generate"} <= {0, 1}
    for node in (0, 1):  # at most one generation on each node
        assert sum(e["event"] == "generate" and e["node"] == node for e in prep) <= 1
    scans = [e for e in prep if e["event"] == "scan"]
    assert len(scans) == 2 and all(e["rank"] == 0 for e in scans), scans  # train and val, once per job
    saves = [e for e in events if e["event"] == "save"]
    assert saves and all(e["rank"] == 0 for e in saves)
    assert sorted(e["path"] for e in saves).count("last.pt") == 2  # once per epoch in total
    assert torch.load(tmp_path / "mn" / "weights" / "last.pt", weights_only=True)["world_size"] == 4


@pytest.mark.slow
@pytest.mark.dist
def test_srun_style_launch_without_torchrun(tmp_path):
    """Two plain processes given only SLURM's variables (as ``srun --ntasks 2 python train.py``) train together."""
    data, port = _fresh_data(tmp_path), free_port()
    env = run_env()
    env.update(SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "train.py", "--data", str(data), "--project", str(tmp_path),
                               "--name", "srun", *TRAIN_ARGS, "--epochs", "1"], cwd=ROOT,
                              env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "x 2 rank(s)" in outs[0]
    assert torch.load(tmp_path / "srun" / "weights" / "last.pt", weights_only=True)["world_size"] == 2


def test_cpu_threads_never_oversubscribe_the_node(one_thread):
    import os
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    assert set_cpu_threads(dist.DistInfo(0, 0, 2 * cores, 2 * cores)) == 1  # more ranks than cores
    torch.set_num_threads(cores)
    assert set_cpu_threads(dist.DistInfo(0, 0, 1, 1)) == cores
    assert set_cpu_threads(dist.DistInfo(0, 0, 1, 1), requested=3) == 3 == torch.get_num_threads()


def test_the_listed_cuda_devices_are_select_devices_parse():
    """The Python API counts the ranks to start from --device with the same parse and refusals."""
    assert [dist.listed_cuda_devices(d) for d in ("0,1", "cuda:1", " 2 , 3 ", "", "cpu", "CPU", "cuda")] == [
        [0, 1], [1], [2, 3], [], [], [], []]
    for bad, message in (("0,0", "listed more than once"), ("gpu", "expected 'cpu', 'cuda' or CUDA indices")):
        with pytest.raises(UserError, match=message):
            dist.listed_cuda_devices(bad)
