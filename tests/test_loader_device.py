"""DataLoaders on GPU hosts: batches pinned only for a CUDA run (pinning opens a CUDA context on GPU 0),
and workers sized by the CPUs this process may use (its affinity), not by the machine's count."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import write_val_split
from utils.core import cpu
from utils.core.dist import DistInfo
from utils.data.loader import create_dataloader


@pytest.fixture
def split(tmp_path) -> Path:
    return write_val_split(tmp_path, 4, (24, 32), lambda k: 40 + k)


@pytest.mark.parametrize("initialized", [False, True])
def test_pinned_only_once_the_process_uses_cuda(split, monkeypatch, initialized):
    """A --device cpu run on a GPU host (CUDA available, never initialised) does not pin; a CUDA run does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    assert create_dataloader(split, 64, 2, 32, nc=1, workers=0).pin_memory is initialized
    assert create_dataloader(split, 64, 2, 32, nc=1, workers=0, pin_memory=False).pin_memory is False


def test_no_cuda_no_pinning(split, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert create_dataloader(split, 64, 2, 32, nc=1, workers=0).pin_memory is False


def test_usable_cpus_follow_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5}, raising=False)
    assert cpu.usable_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    assert cpu.usable_cpus() == 64


def test_workers_are_sized_by_the_affinity_mask(split, monkeypatch):
    """Two ranks on a node whose process may use 4 of 64 CPUs: 2 workers each, not 8."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    info = DistInfo(rank=0, local_rank=0, world_size=2, local_world_size=2)
    assert create_dataloader(split, 64, 4, 32, nc=1, workers=8, info=info).num_workers == 2

