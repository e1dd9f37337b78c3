"""The machine's cores shared between yolotrain processes (utils/core/cores.py): a process takes its
share as others start and gives it back as they end, --threads keeps its own count, dead entries go."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from utils.core import cores
from utils.core.fileio import ROOT

# a second process that joins the share in ``folder`` (its TMPDIR) the way every CLI does, then waits
JOINER = """
import sys, time, torch
from utils.core import cores
print(cores.join(int(sys.argv[1]), 1, int(sys.argv[2])), torch.get_num_threads(), flush=True)
time.sleep(60)
"""


def _joiner(tmp_path: Path, cores_: int, fixed: int = 0) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "8"}  # not capped by torch
    p = subprocess.Popen([sys.executable, "-c", JOINER, str(cores_), str(fixed)], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    threads, torch_threads = map(int, p.stdout.readline().split())
    assert threads == torch_threads  # join set torch's pool
    return p, threads


@pytest.fixture
def share(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    before = torch.get_num_threads()
    s = cores.CoreShare(cores=4, cap=4, folder=cores.share_folder())
    yield s
    s.leave()
    torch.set_num_threads(before)


def test_a_process_shares_with_the_ones_that_start_and_takes_back_when_they_end(share, tmp_path):
    assert share.folder.parent == tmp_path and share.join() == 4  # alone: the whole machine
    p, theirs = _joiner(tmp_path, 4)
    try:
        assert theirs == 2  # it saw this process and took half
        assert share.refresh(force=True) == 2 and torch.get_num_threads() == 2
    finally:
        p.kill()
        p.wait()
    assert share.refresh(force=True) == 4
    assert sorted(e.name for e in share.folder.iterdir()) == [share.entry.name]  # the dead one's entry removed


def test_fixed_threads_are_counted_and_kept(share, tmp_path):
    share.join()
    p, theirs = _joiner(tmp_path, 4, fixed=3)  # --threads 3 beside a sharing process
    try:
        assert theirs == 3
        assert share.refresh(force=True) == 1  # the one core left
        share.fixed = 2
        assert share.refresh(force=True) == 2  # a fixed count stands even when the machine is full
    finally:
        p.kill()
        p.wait()


def test_refresh_is_rate_limited_and_a_reused_pid_is_not_a_live_process(share):
    share.join()
    stale = share.folder / f"{os.getpid() + 1}-1"  # a start time no live process of that pid has
    stale.write_text("0")
    assert share.refresh() == 4  # within REFRESH_S of the join: no re-count
    time.sleep(cores.REFRESH_S)
    assert share.refresh() == 4 and not stale.exists()


def test_leave_removes_the_entry(share):
    share.join()
    assert share.entry.exists()
    share.leave()
    assert not share.entry.exists()
