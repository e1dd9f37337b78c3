"""When a run ends other than after --epochs: a time budget (--time), NaN recovery (--nan-recover) and a
listener's request (TrainEvent.request_stop)."""
from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers import NAN_GRAD, PYTHON, RESUME, assert_same_run, load, out, run, run_env, run_train, train_here
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.data.loader import TrainSampler
from yolotrain.utils.engine.budget import TimeBudget
from yolotrain.utils.engine.config import resolve_resume
from yolotrain.utils.engine.optim import LRSchedule, ModelEMA, Warmup, lr_lambda, smart_optimizer
from yolotrain.utils.engine.recover import NanRecovery
from yolotrain.utils.engine.state import RunState



# ---------------------------------------------------------------- --nan-recover
def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 2, 1))


def _step(model, optimizer, ema, poison: bool = False) -> None:
    loss = model(torch.rand(2, 3, 8, 8)).square().mean()
    if poison:  # 0 in value, NaN in gradient
        loss = loss + (next(model.parameters()).sum() * 0).sqrt()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ema.update(model)


def _snapshot(model, optimizer, ema) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "ema": ema.ema.state_dict(), "opt": optimizer.state_dict(),
                          "updates": ema.updates})


def _assert_same(a: dict, b: dict) -> None:
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert a["updates"] == b["updates"]


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_nan_recovery_puts_model_ema_and_optimizer_back_exactly(name):
    model = _tiny_model()
    optimizer = smart_optimizer(model, name, lr=0.01, momentum=0.9, decay=5e-4)
    ema = ModelEMA(model)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    recovery = NanRecovery(2, model, ema, optimizer, scaler)
    for _ in range(3):
        recovery.remember()
        _step(model, optimizer, ema)
    recovery.remember()
    good = _snapshot(model, optimizer, ema)
    _step(model, optimizer, ema, poison=True)
    assert not all(p.isfinite().all() for p in model.parameters())  # the step really diverged
    assert recovery.restore() and recovery.used == 1 and recovery.left == 1
    _assert_same(_snapshot(model, optimizer, ema), good)
    _step(model, optimizer, ema)  # and training goes on from there
    assert all(p.isfinite().all() for p in model.parameters())


def test_nan_recovery_before_any_step_keeps_the_starting_state():
    model = _tiny_model()
    optimizer = smart_optimizer(model, "AdamW", lr=0.01, momentum=0.9, decay=5e-4)
    ema = ModelEMA(model)
    recovery = NanRecovery(1, model, ema, optimizer, torch.amp.GradScaler("cuda", enabled=False))
    start = _snapshot(model, optimizer, ema)
    assert not recovery.restore()  # nothing remembered: the state is still the one the run started from
    recovery.remember()
    _step(model, optimizer, ema, poison=True)
    assert recovery.restore()
    _assert_same(_snapshot(model, optimizer, ema), start)
    assert not optimizer.state  # the first step's lazily made buffers are gone too


@pytest.fixture(scope="module")
def rolled_back(reference_run):
    """``rolled_back(kind)``: a run whose third backward (on the last rank) gives a NaN gradient, with
    --nan-recover 2 (made once per test run)."""
    return lambda kind: reference_run(*RESUME, "--nan-recover", "2", launcher=kind, script=(NAN_GRAD, "3"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("kind", ["1-process", "2-process"])
def test_a_diverged_step_is_rolled_back_and_training_ends_normally(rolled_back, kind):
    run = rolled_back(kind)
    assert "the loss became NaN/inf on rank(s)" in run.output
    assert "recovery 1/2: rolled back to the state before the last optimizer step" in run.output
    assert "recovery 2/2" not in run.output
    last = load(run.last)
    assert all(v.isfinite().all() for v in last["model"].values() if v.is_floating_point())
    assert all(v.isfinite().all() for v in last["ema"].values() if v.is_floating_point())


@pytest.mark.slow
def test_a_resumed_run_rolls_back_as_the_uninterrupted_one(tiny_data, tmp_path, rolled_back):
    """Stopped (SIGUSR1, sent during the NaN backward, agreed at that batch's optimizer step) at the step whose
    gradient was NaN, the run saves NaN weights; the resumed run must roll that step back as the uninterrupted
    run does and end with the same bits."""
    cut = run_train([PYTHON], tiny_data, tmp_path, "cut", *RESUME, "--nan-recover", "2", script=(NAN_GRAD, "3"),
                env=run_env(NAN_GRAD_USR1_AT="3"), ok=None)
    assert cut.returncode == 75 and "at epoch 1, batch 3/4" in out(cut), out(cut)[-3000:]  # saved right after the NaN step
    last = tmp_path / "cut" / "weights" / "last.pt"
    p = run([PYTHON, NAN_GRAD, "0", "--resume", last])
    assert "recovery 1/2: rolled back to the state before the last optimizer step" in out(p)
    assert_same_run(rolled_back("1-process").last, last)


@pytest.mark.slow
def test_recoveries_run_out_and_the_run_stops_with_the_reason(tiny_data, tmp_path):
    p = run_train([PYTHON], tiny_data, tmp_path, "nan", *RESUME, "--nan-recover", "1", script=(NAN_GRAD, "3,8"), ok=False)
    assert p.returncode == 1, out(p)[-3000:]
    assert "recovery 1/1: rolled back" in out(p)
    assert "all 1 --nan-recover recoveries are used" in out(p)
    assert "Traceback" not in out(p)


@pytest.mark.slow
def test_without_the_option_a_non_finite_loss_stops_and_points_to_it(tiny_data, tmp_path):
    p = run_train([PYTHON], tiny_data, tmp_path, "nan", *RESUME, script=(NAN_GRAD, "3"), ok=False)
    assert p.returncode == 1 and "the loss became NaN/inf" in out(p) and "--nan-recover N" in out(p)


# ---------------------------------------------------------------- --time


class _FakeRun:
    """The parts --time touches: the run state (its epochs, sampler and time budget) and an SGD LR schedule."""

    def __init__(self, epochs: int, hours: float) -> None:
        self.optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01, momentum=0.9)
        self.lr = LRSchedule(self.optimizer, Warmup(iters=0, bias_lr=0.0, momentum0=0.8, momentum=0.9), epochs,
                             lrf=0.01, cos=False)
        self.state = RunState(epochs=epochs, device=torch.device("cpu"), sampler=TrainSampler(8), stopper=None,
                              clock=TimeBudget(hours))

    def __getattr__(self, name):  # the state's fields, as run_epochs reads them
        return getattr(self.state, name)


def _after_epoch(run: _FakeRun, epoch: int, spent: float, seconds: float, close_mosaic: int = 2) -> None:
    """What run_epochs does after ``epoch``, which took ``seconds``, with ``spent`` seconds of the budget used."""
    state = run.state
    state.epoch = epoch
    run.lr.next_epoch()
    state.clock.seconds_before, state.clock.started = spent, time.time()
    fits = state.clock.end_epoch(epoch + 1, state.epochs, seconds, DistInfo(), close_mosaic)
    if fits is not None:
        state.replan(fits, close_mosaic)
        run.lr.refit(fits)


def _lr(run: _FakeRun) -> float:
    return run.optimizer.param_groups[0]["lr"]


def test_time_budget_fits_the_epochs_the_schedule_and_close_mosaic():
    state = _FakeRun(epochs=3, hours=100 / 3600)  # 100 s
    _after_epoch(state, 0, spent=12.0, seconds=10.0)
    assert state.epochs == 1 + 8  # 88 s left, 10 s an epoch
    assert _lr(state) == pytest.approx(0.01 * lr_lambda(9, 0.01)(1))  # epoch 1's LR, 9-epoch plan
    assert state.sampler.mosaic_off_from_epoch == 9 - 2
    _after_epoch(state, 1, spent=40.0, seconds=26.0)
    assert state.epochs == 2 + 3  # 60 s left at 18 s an epoch
    assert _lr(state) == pytest.approx(0.01 * lr_lambda(5, 0.01)(2))
    assert state.sampler.mosaic_off_from_epoch == 3
    for epoch in (2, 3):  # epoch 3 closed mosaic; a faster pace later does not reopen it
        _after_epoch(state, epoch, spent=41.0 + epoch, seconds=1.0)
    assert state.epochs > 5 and state.sampler.mosaic_off_from_epoch == 3


def test_time_budget_ends_on_the_epoch_planned_last_and_when_nothing_fits():
    state = _FakeRun(epochs=4, hours=1 / 3600)
    _after_epoch(state, 0, spent=5.0, seconds=5.0)
    assert state.epochs == 1  # over budget: the epoch just done is the last
    state = _FakeRun(epochs=2, hours=1.0)
    state.clock.epoch_seconds = [2.0]
    _after_epoch(state, 1, spent=5.0, seconds=2.0)
    assert state.epochs == 2  # began as the last epoch: not extended
    state = _FakeRun(epochs=3, hours=0)
    _after_epoch(state, 0, spent=1e9, seconds=1.0)
    assert state.epochs == 3 and state.clock.epoch_seconds == [1.0]  # off: timed, never refitted


def test_the_lr_schedule_is_the_only_writer_of_learning_rates():
    """Warmup, the epoch schedule, the NaN halving and the --time refit all go through LRSchedule, and a
    resumed schedule (loaded from the optimizer's state and the run state) continues the same LRs."""
    def run(resume_at: int | None) -> list[float]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))] * 1, lr=0.01, momentum=0.9)
        lr = LRSchedule(optimizer, Warmup(iters=3, bias_lr=0.1, momentum0=0.8, momentum=0.9), 6, lrf=0.01, cos=True)
        seen = []
        for epoch in range(6):
            for b in range(2):
                lr.warmup_step(epoch * 2 + b, epoch)
                if (epoch, b) == (1, 0):
                    lr.halve()
                seen.append(lr.values()[0])
            if resume_at == epoch:  # save at the end of this epoch, then continue in a new schedule
                lr.next_epoch()
                saved = optimizer.state_dict()
                optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5, momentum=0.0)
                lr = LRSchedule(optimizer, lr.warmup, 6, lrf=0.01, cos=True)
                optimizer.load_state_dict(saved)
                lr.load_state_dict({}, epoch + 1)
                continue
            lr.next_epoch()
        return seen
    straight = run(None)
    assert straight[2] == pytest.approx(0.5 * np.interp(2, [0, 3], [0.1, 0.01 * lr_lambda(6, 0.01, True)(1)]))
    assert run(resume_at=2) == straight


@pytest.mark.slow
def test_time_budget_ends_the_run_like_a_normal_end(tiny_data, tmp_path, capsys, restore_logger):
    train_here("--data", tiny_data, "--project", tmp_path, "--name", "budget", *RESUME, "--time", "0.0001",
               "--save-period", "1")
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "--time 0.0001 h: 1 epochs fit" in text and "1 epochs completed" in text
    run_dir = tmp_path / "budget"
    last = torch.load(run_dir / "weights" / "last.pt", weights_only=True)
    assert last["epoch"] == 0 and last["args"]["epochs"] == 1 and "optimizer" not in last  # finished, stripped
    assert (run_dir / "weights" / "best.pt").exists() and (run_dir / "results.png").exists()
    assert len((run_dir / "results.csv").read_text().strip().splitlines()) == 2  # header + the one epoch
    assert "python val.py --weights" in text


def test_resuming_a_time_budget_run_keeps_its_refitted_epoch_count(tmp_path):
    """The requeued command repeats --epochs, which only planned a --time run's first epoch: the resume
    neither refuses it (fewer than the epochs done) nor trains to it."""
    from yolotrain.app import train as tool
    saved = vars(tool.build_parser().parse_args(["--time", "1", "--epochs", "2"]))
    saved.update(epochs=40, resume=False)  # the count --time had refitted when the run was saved
    torch.save({"args": saved, "optimizer": {}, "epoch": 5, "model_yaml": {}, "model": {}}, tmp_path / "last.pt")
    opt = tool.build_parser().parse_args(["--time", "1", "--epochs", "2", "--resume", str(tmp_path / "last.pt")])
    assert resolve_resume(opt, vars(tool.build_parser().parse_args([]))).args.epochs == 40


# ---------------------------------------------------------------- a listener's request
@pytest.mark.slow
def test_a_listener_s_request_ends_the_run_after_that_epoch(tiny_data, tmp_path, one_thread, restore_logger):
    """TrainEvent.request_stop (tune.py's pruner asks through it): the run ends after the epoch it was asked in,
    its checkpoint written, as a normal end."""
    from yolotrain.utils.core.callbacks import Callbacks

    callbacks = Callbacks()
    callbacks.add("on_fit_epoch_end", lambda e: e.request_stop("enough") if e.epoch == 0 else None)
    result = train_here("--data", tiny_data, *RESUME, "--workers", "0", "--project", tmp_path, "--name", "asked",
                        callbacks=callbacks)
    assert (result.stop, result.epochs) == ("requested", 1)
    assert len((tmp_path / "asked" / "results.csv").read_text().strip().splitlines()) == 2  # header + epoch 1
    assert torch.load(result.last, weights_only=True)["epoch"] == 0
