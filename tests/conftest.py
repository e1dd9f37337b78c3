"""Shared fixtures: the repo root, a subprocess environment and a tiny generated dataset.

The repo is importable through pyproject.toml's pytest ``pythonpath``, so nothing here edits sys.path.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def run_env() -> dict:
    """Environment for subprocess runs: repo importable, one thread per process on the 2-core CI box."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    return env


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: tiny convs run far faster than with threads fighting for 2 busy cores."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A tiny built-in shapes dataset yaml (generated on first use, like the real one)."""
    root = tmp_path_factory.mktemp("tiny")
    yaml_file = root / "tiny.yaml"
    yaml_file.write_text(
        "path: shapes\ntrain: images/train\nval: images/val\n"
        "names: {0: circle, 1: square, 2: triangle, 3: star, 4: cross, 5: ring}\n"
        "generate: shapes\ngenerate_args: {seed: 1, n_train: 16, n_val: 8, img_size: 96}\n"
    )
    return yaml_file
