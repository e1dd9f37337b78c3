"""Checkpoints: atomic writes, weights_only loading, RNG round trips, clear errors."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.engine.rng import rng_states, set_rng_states
from yolotrain.utils.weights import checkpoint as ck


def _ckpt(value: float) -> dict:
    return {"model_yaml": {"nc": 1}, "model": {"w": torch.full((3,), value)}, "epoch": 1, "args": {"p": "x"}}


def test_roundtrip_loads_with_weights_only(tmp_path):
    f = tmp_path / "last.pt"
    ck.save_checkpoint({**_ckpt(1.0), "rng": rng_states(), "versions": ck.versions()}, f)
    data = torch.load(f, weights_only=True)
    assert torch.equal(data["model"]["w"], torch.ones(3))
    assert ck.load_checkpoint(f)["epoch"] == 1
    umask = os.umask(0)
    os.umask(umask)
    assert f.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's owner-only one


def test_kill_mid_save_keeps_previous_file(tmp_path, monkeypatch):
    f = tmp_path / "last.pt"
    ck.save_checkpoint(_ckpt(1.0), f)

    def dying_save(obj, fh):
        fh.write(b"partial bytes")
        raise KeyboardInterrupt  # a kill arriving half-way through the write

    monkeypatch.setattr(ck.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(_ckpt(2.0), f)
    monkeypatch.undo()
    assert torch.equal(ck.load_checkpoint(f)["model"]["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temp file left behind


def test_truncated_and_foreign_files_are_user_errors(tmp_path):
    f = tmp_path / "bad.pt"
    ck.save_checkpoint(_ckpt(1.0), f)
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(UserError, match=r"bad\.pt: not a readable yolotrain checkpoint"):
        ck.load_checkpoint(f)
    g = tmp_path / "foreign.pt"
    torch.save({"state": 1}, g)
    with pytest.raises(UserError, match="not a yolotrain checkpoint"):
        ck.load_checkpoint(g)
    with pytest.raises(UserError, match="checkpoint not found"):
        ck.load_checkpoint(tmp_path / "missing.pt")


def test_pickled_objects_are_refused(tmp_path):
    f = tmp_path / "pickled.pt"
    torch.save({"model_yaml": {}, "model": torch.nn.Linear(1, 1)}, f)  # a whole module, YOLOv5 style
    with pytest.raises(UserError, match="not a readable yolotrain checkpoint"):
        ck.load_checkpoint(f)


def test_rng_states_roundtrip(tmp_path):
    """Every byte of Python's, numpy's and torch's generator states comes back, and so do the next draws."""
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    random.random(), np.random.rand(7), torch.rand(5)  # mid-state, not just after a seed
    f = tmp_path / "rng.pt"
    ck.save_checkpoint({**_ckpt(0.0), "rng": rng_states()}, f)
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    expected = ([random.random() for _ in range(700)], np.random.rand(700), torch.rand(700))
    set_rng_states(ck.load_checkpoint(f)["rng"])
    py, (name, keys, *rest), pt = random.getstate(), np.random.get_state(), torch.get_rng_state()
    assert py == saved[0] and torch.equal(pt, saved[2])
    assert name == saved[1][0] and np.array_equal(keys, saved[1][1]) and tuple(rest) == tuple(saved[1][2:])
    draws = ([random.random() for _ in range(700)], np.random.rand(700), torch.rand(700))
    assert draws[0] == expected[0] and np.array_equal(draws[1], expected[1]) and torch.equal(draws[2], expected[2])


def test_strip_optimizer(tmp_path):
    f = tmp_path / "best.pt"
    ck.save_checkpoint({**_ckpt(1.0), "optimizer": {"state": {}}, "ema_updates": 3}, f)
    ck.strip_optimizer(f)
    data = ck.load_checkpoint(f)
    assert "optimizer" not in data and data["stripped"] is True


def test_to_plain_makes_weights_only_safe_values(tmp_path):
    from pathlib import Path
    plain = ck.to_plain({"p": Path("/a"), "t": (1, 2), "n": np.float32(0.5), "a": np.arange(2)})
    assert plain == {"p": "/a", "t": [1, 2], "n": 0.5, "a": [0, 1]}


def test_cuda_rng_is_the_run_devices_only_and_resumes_with_fewer_gpus_visible(monkeypatch):
    """Twin of a CUDA run (torch.cuda patched): the checkpoint holds the training device's generator, not every
    visible GPU's, and a file with one state per GPU resumes on a rank that sees fewer GPUs without an IndexError."""
    states = {i: torch.full((4,), i, dtype=torch.uint8) for i in range(4)}
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: states[torch.device(device).index])
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states.values()))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda all_states: restored.append(("all", None)))
    assert "cuda" not in rng_states(torch.device("cpu"))  # a CPU run on a GPU host saves no GPU state
    saved = rng_states(torch.device("cuda", 2))
    assert torch.equal(saved["cuda"], states[2])
    set_rng_states(saved, torch.device("cuda", 0))  # requeued where one GPU is visible per task
    legacy = {**saved, "cuda": list(states.values())}  # one state per visible GPU
    set_rng_states(legacy, torch.device("cuda", 1))
    set_rng_states({**saved, "cuda": list(states.values())[:1]}, torch.device("cuda", 3))  # index not in the file
    set_rng_states(saved, torch.device("cpu"))
    assert restored == [(2, torch.device("cuda", 0)), (1, torch.device("cuda", 1))]
