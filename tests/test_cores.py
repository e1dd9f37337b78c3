"""Two trainings on one machine: the second takes the cores the first leaves (utils/core/cores.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from yolotrain.utils.core import cores
from yolotrain.utils.core.cores import Holder, Registry, choose_threads, claim_cores, job_key
from yolotrain.utils.core.dist import DistInfo

ONE = DistInfo(0, 0, 1, 1)


@pytest.fixture
def other_process():
    """A live process that stands for a training started earlier."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(cores, "usable_cpus", lambda: 4)
    n = torch.get_num_threads()
    torch.set_num_threads(4)  # torch's default on a 4-core machine
    yield
    torch.set_num_threads(n)


def test_the_thread_count_rule():
    busy = [Holder(1, "pid:1", 3)]
    assert choose_threads(ONE, 0, 8, 4, [], False) == 4  # alone: torch's default, capped at the cores
    assert choose_threads(DistInfo(0, 0, 2, 2), 0, 8, 4, [], False) == 2  # two ranks on the node share it
    assert choose_threads(ONE, 0, 4, 4, busy, False) == 1  # beside a 3-thread job: the core it leaves
    assert choose_threads(ONE, 0, 4, 4, [Holder(1, "pid:1", 4)], False) == 1  # none left: still one
    assert choose_threads(ONE, 0, 4, 4, busy, explicit=True) == 4  # OMP_NUM_THREADS: the user's count stands
    assert choose_threads(ONE, 2, 4, 4, busy, False) == 2  # --threads stands


def test_a_second_training_takes_the_cores_the_first_leaves(tmp_path, four_cores, other_process):
    registry = Registry(tmp_path)
    registry.entry(other_process.pid).write_text("3 pid:other")
    with claim_cores(ONE, registry=registry, env={}) as n:
        assert n == 1 == torch.get_num_threads()
        mine = registry.entry(os.getpid())
        assert mine.read_text() == f"1 {job_key({})}"
    assert not mine.exists()  # the run is over: a later job may take its core
    with claim_cores(ONE, registry=registry, env={"OMP_NUM_THREADS": "4"}) as n:
        assert n == 4  # the user's own count


def test_entries_of_ended_runs_and_of_the_same_job_do_not_count(tmp_path, four_cores, other_process):
    registry = Registry(tmp_path)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = tmp_path / f"{ended.stdout.strip()}-123"
    gone.write_text("4 pid:gone")  # a killed run leaves its entry behind
    env = {"TORCHELASTIC_RUN_ID": "job7"}
    registry.entry(other_process.pid).write_text(f"2 {job_key(env)}")  # another rank of this torchrun job
    with claim_cores(ONE, registry=registry, env=env) as n:
        assert n == 4
    assert not gone.exists()


def test_job_keys():
    assert job_key({"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "run:abc"
    assert job_key({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "addr:h:1"
    assert job_key({}).startswith("pid:")
