"""MuSGD (utils/engine/muon.py): the orthogonalisation, one step against a plain re-implementation,
SGD on 1-D parameters, state round trips and a short regression."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from yolotrain.utils.core.dist import BatchSplit
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.engine.muon import MuSGD, newton_schulz
from yolotrain.utils.engine.optim import LRSchedule, ModelEMA, Warmup, smart_optimizer
from yolotrain.utils.engine.recipe import RECIPES
from yolotrain.utils.engine.recover import NanRecovery

LR, MOMENTUM, DECAY = 0.05, 0.9, 5e-4


def _model(seed: int = 0) -> nn.Module:
    """Convs (two of one shape: a shared batched Newton-Schulz call), BN, a tall and a wide Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                         nn.BatchNorm2d(8), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 24), nn.SiLU(), nn.Linear(24, 4))


def _set_grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (10, 200), (8, 3, 3, 3), (32, 16, 3, 3), (24, 12, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_moves_singular_values_into_its_band_and_keeps_the_vectors(shape, dtype):
    """Five quintic steps map every singular value at least 1/500 of the Frobenius norm into
    [0.68, 1.21] (the scalar iteration's range); bf16 rounding widens that a little."""
    torch.manual_seed(1)
    m = torch.randn(shape).reshape(shape[0], -1)
    s = torch.linalg.svdvals(m)
    assert s.min() / m.norm() > 2e-3  # the band's condition holds for these shapes
    o = newton_schulz(m, dtype=dtype)
    assert o.dtype == dtype and o.shape == m.shape
    so = torch.linalg.svdvals(o.float())
    assert so.min() > 0.65 and so.max() < 1.25
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    d = u.T @ o.float() @ vh.T  # diagonal: the same singular vectors, each value moved on its own
    off = 1e-3 if dtype == torch.float32 else 0.05
    assert (d - torch.diag(d.diagonal())).abs().max() < off and d.diagonal().min() > 0.65


def test_newton_schulz_batches_and_ignores_autocast():
    torch.manual_seed(2)
    x = torch.randn(3, 16, 40)
    batched = newton_schulz(x, dtype=torch.float32)
    assert torch.allclose(batched, torch.stack([newton_schulz(m, dtype=torch.float32) for m in x]), atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert newton_schulz(x, dtype=torch.float32).dtype == torch.float32


def _reference_newton_schulz(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = m.float()
    x = (x / (x.norm() + 1e-7)).to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def _reference_step(params: list[torch.Tensor], state: dict, lr: float, beta: float, decay: float,
                    dtype: torch.dtype) -> None:
    """MuSGD's maths one parameter at a time, for a decayed group with Ultralytics' mix (muon 0.2, sgd 1.0)."""
    for i, p in enumerate(params):
        g = p.grad
        s = state.setdefault(i, {"muon": torch.zeros_like(p), "sgd": torch.zeros_like(p)})
        factor = lr
        if p.ndim >= 2:
            s["muon"] = beta * s["muon"] + (1 - beta) * g
            nesterov = beta * s["muon"] + (1 - beta) * g
            o = _reference_newton_schulz(nesterov.reshape(p.shape[0], -1), dtype).float().reshape(p.shape)
            o = o * max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5
            p -= lr * 0.2 * o
            factor = lr * 1.0
        g = g + decay * p
        s["sgd"] = beta * s["sgd"] + g
        p -= factor * (g + beta * s["sgd"])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-4)])
def test_two_steps_equal_a_plain_reimplementation(dtype, atol):
    model, ref = _model(), _model()
    opt = smart_optimizer(model, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    opt.ns_dtype = dtype
    assert isinstance(opt, MuSGD) and [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0, DECAY]
    decayed = opt.param_groups[2]["params"]
    assert {p.ndim for p in decayed} == {2, 4}  # every matrix weight sits in the decayed group
    index = {id(p): i for i, p in enumerate(model.parameters())}
    ref_params, state = [list(ref.parameters())[index[id(p)]] for p in decayed], {}
    for seed in (3, 4):
        _set_grads(model, seed)
        _set_grads(ref, seed)
        opt.step()
        with torch.no_grad():
            _reference_step(ref_params, state, LR, MOMENTUM, DECAY, dtype)
    for p, q in zip(decayed, ref_params):
        assert torch.allclose(p, q, rtol=0, atol=atol), (p.shape, (p - q).abs().max())
    moved = [(p - q).abs().max() for p, q in zip(decayed, (list(_model().parameters())[index[id(p)]] for p in decayed))]
    assert min(moved) > 1e-3  # the steps did move every weight


def test_one_dimensional_parameters_take_exactly_torch_sgd():
    model, twin = _model(), _model()
    opt = smart_optimizer(model, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    sgd = smart_optimizer(twin, "SGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    for seed in (5, 6, 7):
        _set_grads(model, seed)
        _set_grads(twin, seed)
        opt.step()
        sgd.step()
    ones = [(p, q) for p, q in zip(model.parameters(), twin.parameters()) if p.ndim == 1]
    assert len(ones) == 7 and all(torch.equal(p, q) for p, q in ones)
    # muon=0 makes a group plain SGD for its matrices too
    model, twin = _model(), _model()
    opt = smart_optimizer(model, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    for g in opt.param_groups:
        g["muon"] = 0.0
    sgd = smart_optimizer(twin, "SGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    for seed in (5, 6):
        _set_grads(model, seed)
        _set_grads(twin, seed)
        opt.step()
        sgd.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, seeds) -> None:
    for seed in seeds:
        _set_grads(model, seed)
        opt.step()


def test_state_dict_round_trip_through_a_weights_only_file_gives_identical_steps(tmp_path):
    model = _model()
    opt = smart_optimizer(model, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    LRSchedule(opt, Warmup(iters=10, bias_lr=0.1, momentum0=0.8, momentum=MOMENTUM), 5, 0.01, False).warmup_step(3, 0)
    _steps(model, opt, (8, 9))
    torch.save({"optimizer": opt.state_dict(), "model": model.state_dict()}, tmp_path / "last.pt")
    ckpt = torch.load(tmp_path / "last.pt", weights_only=True)
    resumed = _model(seed=1)
    resumed.load_state_dict(ckpt["model"])
    opt2 = smart_optimizer(resumed, "MuSGD", lr=1.0, momentum=0.5, decay=0.0)
    opt2.load_state_dict(ckpt["optimizer"])
    assert [g["momentum"] for g in opt2.param_groups] == [g["momentum"] for g in opt.param_groups] != [MOMENTUM] * 3
    _steps(model, opt, (10, 11))
    _steps(resumed, opt2, (10, 11))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))
    assert opt.state_dict()["state"].keys() == opt2.state_dict()["state"].keys()


def test_nan_recover_rollback_restores_musgd_exactly():
    model = _model()
    opt = smart_optimizer(model, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    ema = ModelEMA(model)
    recovery = NanRecovery(1, model, ema, opt, torch.amp.GradScaler("cuda", enabled=False))
    _steps(model, opt, (12,))
    recovery.remember()
    twin = copy.deepcopy(model)
    twin_opt = smart_optimizer(twin, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict keeps the tensors it is given
    _steps(model, opt, (13,))  # the step a NaN would have followed
    assert recovery.restore()
    _steps(model, opt, (14,))
    _steps(twin, twin_opt, (14,))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_grad_scaler_and_autocast_leave_the_step_as_it_is():
    """scaler.step unscales (a power of two: exact) and skips a step with an inf gradient; a step taken inside an
    autocast region computes as outside it."""
    plain, scaled = _model(), _model()
    opt = smart_optimizer(plain, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    opt_s = smart_optimizer(scaled, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x = torch.rand(2, 3, 8, 8)
    for model, o in ((plain, opt), (scaled, opt_s)):
        loss = model(x).square().mean()
        (scaler.scale(loss) if o is opt_s else loss).backward()
    opt.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scaler.step(opt_s)
    scaler.update()
    assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(plain.parameters(), scaled.parameters()))
    before = [p.clone() for p in scaled.parameters()]
    opt_s.zero_grad()
    scaler.scale(scaled(x).square().mean() * float("inf")).backward()
    scaler.step(opt_s)
    assert all(torch.equal(p, q) for p, q in zip(before, scaled.parameters()))


def test_a_toy_regression_converges():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 4) + 0.1 * torch.randn(256, 4)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4))
    opt = smart_optimizer(model, "MuSGD", lr=0.02, momentum=0.9, decay=0.0)
    losses = []
    for _ in range(30):
        loss = (model(x) - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses


def test_musgd_is_chosen_by_name_and_kept_for_resume():
    from yolotrain.app import train
    hyp = Hyp(lr0=0.01, momentum=0.937, warmup_bias_lr=0.1)
    choice = RECIPES["anchor-free"].optimizer("MuSGD", hyp, nc=80, n_images=800, batch=BatchSplit(16, 1), epochs=30)
    assert (choice.name, choice.lr, choice.momentum, choice.warmup_bias_lr, choice.nominal_batch) == \
        ("MuSGD", 0.01, 0.937, 0.1, 64)
    assert train.parse_opt(["--optimizer", "MuSGD"]).optimizer == "MuSGD"
    assert RECIPES["anchor-free"].optimizer("auto", hyp, nc=80, n_images=640_000, batch=BatchSplit(64, 1), epochs=30).name == "SGD"


def test_channels_last_weights_step_as_contiguous_ones():
    """--channels-last: a conv weight's Newton-Schulz view is its logical (out, in * kh * kw) matrix whatever its
    memory layout."""
    plain, nhwc = _model(), _model().to(memory_format=torch.channels_last)
    assert not nhwc[0].weight.is_contiguous()
    opts = [smart_optimizer(m, "MuSGD", lr=LR, momentum=MOMENTUM, decay=DECAY) for m in (plain, nhwc)]
    for seed in (15, 16):
        for m, o in zip((plain, nhwc), opts):
            _set_grads(m, seed)
            for p in m.parameters():
                if m is nhwc and p.ndim == 4:
                    p.grad = p.grad.contiguous(memory_format=torch.channels_last)
            o.step()
    assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(plain.parameters(), nhwc.parameters()))


def test_musgd_gives_the_class_branches_three_times_the_lr_and_warms_their_biases_from_the_bias_lr():
    """Ultralytics 8.4's MuSGD recipe: the head's class branches (Head.class_branches) train at 3x the LR, in
    groups of their own kinds; the other optimizers and a plain MuSGD model keep the three groups."""
    from yolotrain.models.yolo import Model

    hyp = Hyp(lr0=LR, momentum=MOMENTUM, warmup_bias_lr=0.1)
    choice = RECIPES["anchor-free"].optimizer("MuSGD", hyp, nc=3, n_images=64, batch=BatchSplit(16, 1), epochs=1)
    assert choice.class_lr_gain == 3.0
    assert RECIPES["anchor-free"].optimizer("SGD", hyp, 3, 64, BatchSplit(16, 1), 1).class_lr_gain == 1.0
    model = Model("models/yolo26n.yaml", nc=3)
    head = model.detect
    boosted = {id(p) for m in head.class_branches() for p in m.parameters()}
    assert boosted == {id(p) for m in (head.cv3, head.one2one_cv3) for p in m.parameters()}
    opt = smart_optimizer(model, "MuSGD", LR, MOMENTUM, DECAY, head.class_branches(), choice.class_lr_gain)
    kinds = [(g["kind"], g["lr"], {id(p) in boosted for p in g["params"]}) for g in opt.param_groups]
    assert kinds == [("bias", LR, {False}), ("norm", LR, {False}), ("weight", LR, {False}),
                     ("bias", 3 * LR, {True}), ("norm", 3 * LR, {True}), ("weight", 3 * LR, {True})]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0, DECAY, 0.0, 0.0, DECAY]
    schedule = LRSchedule(opt, Warmup(iters=100, bias_lr=0.1, momentum0=0.8, momentum=MOMENTUM), 10, 0.01, False)
    schedule.warmup_step(0, 0)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.0, 0.0, 0.1, 0.0, 0.0]  # biases warm down from 0.1
    schedule.warmup_step(100, 0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([LR] * 3 + [3 * LR] * 3)
    assert len(smart_optimizer(model, "MuSGD", LR, MOMENTUM, DECAY).param_groups) == 3  # no gain: no groups
