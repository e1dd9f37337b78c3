"""The run state and the frozen config: one home for what a continuation needs, read and written in
one place, and arguments that nothing changes once resolved."""
from __future__ import annotations

import argparse
import os
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch
from torch import nn

from yolotrain.app import train
from yolotrain.utils.core.cli import ResolvedArgs
from yolotrain.utils.core.dist import BatchSplit, DistInfo
from yolotrain.utils.data.loader import TrainSampler
from yolotrain.utils.engine.budget import TimeBudget
from yolotrain.utils.engine.config import Resume, RunConfig, resolve_config
from yolotrain.utils.engine.recipe import RECIPES
from yolotrain.utils.engine.optim import EarlyStopping, LRSchedule, ModelEMA, Warmup, smart_optimizer
from yolotrain.utils.engine.plan import StepPlan
from yolotrain.utils.engine.state import RunState
from yolotrain.utils.engine.step import Step, StepOptions, StepParts, build_step

NB = 5  # batches per epoch of the fake run
CPU = torch.device("cpu")

# The training-state keys of a checkpoint as this project has written them (format 1): a resume of a
# file written by any version since must find every one it reads.
EPOCH_END_KEYS = {"epoch", "best_fitness", "model", "ema", "ema_updates", "optimizer", "scaler", "early_stop", "rng",
                  "train_seconds", "mosaic_off_from_epoch", "epoch_seconds", "metrics"}
MID_EPOCH_KEYS = EPOCH_END_KEYS | {"batches_done", "mloss", "lr_scale"}


class _Criterion:
    """What a step reads of its criterion when it is only trained by hand and checkpointed."""

    loss_names = ("box", "cls", "dfl")


def _run(seed: int, nan_recover: int = 2) -> tuple[RunState, Step]:
    """A run of a toy model: the loop's state and the step that owns the model, EMA, optimizer and LR."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 2, 1))
    optimizer = smart_optimizer(model, "AdamW", lr=0.01, momentum=0.9, decay=5e-4)
    lr = LRSchedule(optimizer, Warmup(iters=3, bias_lr=0.1, momentum0=0.8, momentum=0.9), 4, lrf=0.01, cos=False)
    parts = StepParts(model, _Criterion(), optimizer, torch.amp.GradScaler("cuda", enabled=False), ModelEMA(model), lr)
    step = build_step(parts, StepPlan.of(BatchSplit(2, 1), 2, 1, 2 * NB), DistInfo(), CPU,
                      StepOptions(amp=False, graphs=False, sync_bn=False, compile=False), nan_recover=nan_recover)
    state = RunState(epochs=4, device=CPU, sampler=TrainSampler(8), stopper=EarlyStopping(patience=3),
                     clock=TimeBudget(0))
    return state, step


def _train_steps(state: RunState, step: Step, n: int) -> None:
    for _ in range(n):
        step.lr.warmup_step(state.epoch * NB + state.batches_done, state.epoch)
        step.recovery.remember()
        loss = step.model(torch.rand(2, 3, 8, 8)).square().mean()
        loss.backward()
        step.optimizer_step()
        state.batches_done += 1


def _saved(state: RunState, step: Step) -> dict:
    mid = state.mid_epoch(NB)
    return {**state.state_dict(mid), **step.state_dict(mid)}


def _resumed(saved: dict, seed: int, nan_recover: int = 2, restore_mosaic: bool = True) -> tuple[RunState, Step]:
    """Another run (other initial weights: everything must come from the checkpoint) continuing ``saved``."""
    state, step = _run(seed, nan_recover)
    step.model.load_state_dict(saved["model"])
    state.load_state_dict(saved, restore_mosaic=restore_mosaic)
    step.load_state_dict(saved, state.epoch, state.batches_done)
    step.begin(state.epoch, state.batches_done)
    return state, step


def _assert_equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k in ("rng", "train_seconds"):
            continue
        _assert_equal(a[k], b[k], k)


def _assert_equal(x, y, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y), where
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_equal(x[k], y[k], f"{where}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (p, q) in enumerate(zip(x, y)):
            _assert_equal(p, q, f"{where}/{i}")
    else:
        assert x == y, where


def test_a_mid_epoch_state_round_trips_through_its_state_dict():
    state, step = _run(0)
    state.epoch, state.best_fitness = 1, 0.25
    _train_steps(state, step, 3)
    step.lr.halve()  # --nan-recover's scale for the rest of the epoch
    step.mloss = torch.tensor([0.5, 0.25, 0.125])
    step.agree_loss()  # what a mid-epoch save records: the running loss over ranks (one rank here)
    state.sampler.close_mosaic_from(2)
    state.stopper(1, 0.25)
    state.clock.epoch_seconds = [12.5]
    saved = _saved(state, step)
    assert set(saved) == MID_EPOCH_KEYS | {"nan_recovery"}
    assert (saved["epoch"], saved["batches_done"], saved["lr_scale"]) == (0, 3, 0.5)  # one epoch done, 3 batches

    resumed, again = _resumed(saved, seed=1)
    assert (resumed.epoch, resumed.batches_done, resumed.resumed, resumed.best_fitness) == (1, 3, True, 0.25)
    assert torch.equal(again.mloss, step.mloss) and again.lr.scale == 0.5 and again.lr.epoch == 1
    assert again.lr.values() == step.lr.values() and resumed.clock.epoch_seconds == [12.5]
    assert resumed.sampler.mosaic_off_from_epoch == 2 and again.recovery.used == 0
    assert again.last_opt_step == 1 * NB + 3 - 1  # the cursor: the step before batch 4 of epoch 2
    _assert_equal_states(_saved(resumed, again), saved)


def test_an_epoch_end_checkpoint_records_the_epoch_and_no_cursor():
    state, step = _run(0, nan_recover=0)
    _train_steps(state, step, NB)
    saved = _saved(state, step)
    assert set(saved) == EPOCH_END_KEYS and saved["epoch"] == 0  # the epoch just finished
    resumed, again = _resumed(saved, seed=0, nan_recover=0, restore_mosaic=False)
    assert (resumed.epoch, resumed.batches_done, again.agreed, again.lr.scale) == (1, 0, None, 1.0)
    assert not again.mloss.any()  # a new epoch's running loss starts at zero


def test_the_close_mosaic_epoch_is_restored_only_when_asked():
    """A --time run keeps the close_mosaic epoch it had moved; other runs recompute it from --epochs (which a
    resume may have raised)."""
    state, step = _run(0)
    state.sampler.close_mosaic_from(1)
    _train_steps(state, step, NB)
    saved = _saved(state, step)
    for restore, want in ((True, 1), (False, 7)):
        resumed, _ = _run(0)
        resumed.sampler.close_mosaic_from(7)
        resumed.load_state_dict(saved, restore_mosaic=restore)
        assert resumed.sampler.mosaic_off_from_epoch == want


def test_replan_refits_close_mosaic_and_keeps_a_closed_mosaic_closed():
    state, _ = _run(0)
    state.sampler.close_mosaic_from(3)
    state.epoch = 0
    state.replan(9, close_mosaic=2)
    assert state.epochs == 9 and state.sampler.mosaic_off_from_epoch == 7
    state.epoch = 7  # mosaic closed from epoch 7: a later, longer plan leaves it closed
    state.replan(20, close_mosaic=2)
    assert state.sampler.mosaic_off_from_epoch == 7


def test_the_lr_schedule_refits_to_the_new_length():
    _, step = _run(0)
    step.lr.next_epoch()
    step.lr.refit(9)
    assert step.lr.values()[1] == pytest.approx(0.01 * ((1 - 1 / 9) * 0.99 + 0.01))


def test_the_run_config_is_frozen_and_resolved_once(tmp_path):
    args = vars(train.build_parser().parse_args(["--project", str(tmp_path), "--name", "run",
                                                "--cfg", "models/yolov5n.yaml"]))
    cfg = resolve_config(Resume(ResolvedArgs(**args)), torch.device("cpu"))
    assert isinstance(cfg, RunConfig) and isinstance(cfg, ResolvedArgs)
    assert cfg.hyp == str(RECIPES["anchor-based"].hyp) and cfg.save_dir == str(tmp_path / "run") and cfg.channels_last is True
    with pytest.raises(FrozenInstanceError, match="cannot set epochs"):
        cfg.epochs = 3
    with pytest.raises(FrozenInstanceError):
        del cfg.seed
    longer = cfg.replace(epochs=30)
    assert (longer.epochs, cfg.epochs) == (30, 8) and longer.as_dict().keys() == cfg.as_dict().keys()
    (tmp_path / "run").mkdir()  # taken: a fresh run gets the next folder, an anchor-free model its own hyp file
    free = resolve_config(Resume(ResolvedArgs(**{**args, "cfg": "models/yolov8n.yaml"})), torch.device("cpu"))
    assert free.save_dir == str(tmp_path / "run2") and free.hyp == str(RECIPES["anchor-free"].hyp)


def test_a_fresh_run_reads_its_weights_once(tmp_path, monkeypatch):
    """--weights is read when the arguments are merged, and that read serves the config and the build."""
    import yolotrain.utils.engine.config as config
    from yolotrain.models.parse import load_model_yaml
    from yolotrain.utils.weights.checkpoint import WeightsSource

    reads, yaml = [], load_model_yaml("yolov8n.yaml")[0]
    monkeypatch.setattr(config, "load_weights_source", lambda p: reads.append(p) or WeightsSource(Path(p), yaml, {}))
    opt = train.build_parser().parse_args(["--project", str(tmp_path), "--weights", "w.pt"])
    resume = config.resolve_resume(opt, defaults=vars(train.build_parser().parse_args([])))
    cfg = config.resolve_config(resume, torch.device("cpu"))
    assert reads == ["w.pt"] and resume.fresh_model() is resume.model and resume.model.cfg is yaml
    assert resume.model.recipe.family == "anchor-free" and cfg.hyp == str(RECIPES["anchor-free"].hyp)


def test_a_resume_keeps_the_saved_run_folder_and_hyp(tmp_path):
    import yolotrain.utils.engine.config as config
    args = vars(train.build_parser().parse_args(["--hyp", "hyps/hyp.v8.yaml"]))
    saved = config.SavedRun(tmp_path / "exp" / "weights" / "last.pt", {"args": {**args, "amp": False}})
    cfg = resolve_config(Resume(ResolvedArgs(**{**args, "save_dir": str(tmp_path / "exp")}), saved), torch.device("cpu"))
    assert cfg.save_dir == str(tmp_path / "exp") and cfg.hyp == "hyps/hyp.v8.yaml"


def test_val_py_resolves_its_arguments_without_changing_the_parsed_ones():
    from yolotrain.app import val
    opt = val.parse_opt(["--weights", "a.pt", "--task", "speed", "--save-json"])
    resolved = val.check_opt(opt)
    assert (resolved.conf_thres, resolved.save_json, resolved.noplots) == (0.25, False, True)
    assert (opt.conf_thres, opt.save_json) == (0.001, True)
    with pytest.raises(FrozenInstanceError):
        resolved.conf_thres = 0.5


def test_train_py_holds_no_checkpoint_keys_and_no_library_state():
    """Only utils/engine/state.py and utils/weights/checkpoint.py read or write checkpoint keys; train.py
    acts on typed values (SavedRun, Stop)."""
    text = Path(train.__file__).read_text()
    assert "ckpt" not in text and '["' not in text
    assert isinstance(train.build_parser(), argparse.ArgumentParser)


def test_a_resume_of_a_run_saved_before_a_flag_existed_takes_that_flags_given_value(tmp_path):
    """Saved arguments lack flags added since; the merged arguments still hold every flag of the parser."""
    from yolotrain.utils.engine.config import resolve_resume
    saved = vars(train.build_parser().parse_args([]))
    for newer in ("deterministic", "hang_timeout", "amp"):
        saved.pop(newer)
    torch.save({"args": saved, "optimizer": {}, "epoch": 1, "model_yaml": {}, "model": {}}, tmp_path / "last.pt")
    opt = train.build_parser().parse_args(["--resume", str(tmp_path / "last.pt"), "--hang-timeout", "5"])
    args = resolve_resume(opt, vars(train.build_parser().parse_args([]))).args
    assert (args.deterministic, args.hang_timeout, args.amp) == (False, 5.0, None)
    assert args.as_dict().keys() >= vars(opt).keys()


def test_determinism_switches_torch_and_cudnn_together(monkeypatch):
    from yolotrain.utils.core import precision
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        precision.set_determinism(True, fixed_shapes=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        precision.set_determinism(False, fixed_shapes=True)
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
        precision.set_determinism(False, fixed_shapes=False)  # --rect / --multi-scale: every new shape would be re-timed
        assert not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


def test_the_memory_format_default_follows_device_and_precision(monkeypatch):
    from yolotrain.utils.core import precision
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert precision.channels_last_default(None, cpu) and precision.channels_last_default(None, cpu, half=True)
    assert precision.channels_last_default(None, cuda, half=True) and not precision.channels_last_default(None, cuda)
    assert not precision.channels_last_default(False, cuda, half=True) and precision.channels_last_default(True, cuda)
    monkeypatch.setattr(precision.sys, "platform", "win32")
    assert not precision.channels_last_default(None, cuda, half=True)


def test_a_short_run_trains_about_half_its_epochs_in_mosaics():
    from yolotrain.utils.engine.state import mosaic_off_from

    assert mosaic_off_from(10, 100) == 90 and mosaic_off_from(10, 20) == 10  # YOLOv5's last 10 epochs
    assert mosaic_off_from(10, 8) == 4 and mosaic_off_from(10, 7) == 3  # at most half, rounded up: 3 of 7
    assert mosaic_off_from(10, 1) == 0 and mosaic_off_from(3, 2) == 1  # a 1-epoch run closes it throughout
    assert mosaic_off_from(0, 7) == 7
    state, _ = _run(0)
    state.epoch = 0
    state.replan(6, close_mosaic=10)  # --time's refit follows the same rule
    assert state.sampler.mosaic_off_from_epoch == 3
