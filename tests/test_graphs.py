"""--cuda-graphs: the settings it refuses, with messages, and the padded targets a captured loss takes, on any
machine; on a GPU (the ``cuda`` marker), graphed training steps that equal eager ones and a train.py run that
captures, replays and saves."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from yolotrain.models.heads.base import PackedCriterion
from yolotrain.models.heads.tal import pack_targets
from yolotrain.models.yolo import Model
from tests.helpers import ROOT, TORCHRUN, run_env
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.engine.config import RESUME_HARMLESS
from yolotrain.utils.engine.graphs import MIN_SLOTS, StepLoss, accumulation_problem, graphs_problems, slots_for
from yolotrain.utils.engine.step import optimizer_step
from yolotrain.utils.engine.optim import ModelEMA
from yolotrain.app import train

CUDA = torch.device("cuda")


def test_graphs_problems_name_each_setting_it_cannot_run_with():
    assert graphs_problems(CUDA, 1, compile_=False, rect=False, multi_scale=False) == []
    assert graphs_problems(torch.device("cpu"), 1, False, False, False) == [
        "--cuda-graphs needs a CUDA device (this run is on cpu)"]
    assert graphs_problems(CUDA, 2, False, False, False) == []  # DDP wraps the graphed unit
    assert "--sync-bn" in graphs_problems(CUDA, 2, False, False, False, sync_bn=True)[0]
    assert graphs_problems(CUDA, 1, False, False, False, sync_bn=True) == []  # one rank: plain BatchNorm
    assert "--compile" in graphs_problems(CUDA, 1, True, False, False)[0]
    assert "--rect changes it" in graphs_problems(CUDA, 1, False, True, False)[0]
    assert "--multi-scale changes it" in graphs_problems(CUDA, 1, False, False, True)[0]
    assert len(graphs_problems(torch.device("cpu"), 1, True, True, False)) == 3  # each said, in one line


def test_accumulation_problem_asks_for_a_step_per_batch():
    assert accumulation_problem(64, 1, 64) is None
    message = accumulation_problem(16, 4, 64)
    assert "accumulates 4 batches per step" in message and "use --batch-size 64 or more" in message


def test_cuda_graphs_is_a_flag_a_resume_may_switch():
    assert train.build_parser().parse_args(["--cuda-graphs"]).cuda_graphs is True
    assert train.build_parser().parse_args([]).cuda_graphs is False
    assert "cuda_graphs" in RESUME_HARMLESS


@pytest.mark.slow  # a subprocess
def test_train_on_a_cpu_refuses_cuda_graphs_with_one_line(tmp_path):
    p = subprocess.run([sys.executable, "train.py", "--cuda-graphs", "--device", "cpu", "--epochs", "1",
                        "--project", str(tmp_path)], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0
    assert "--cuda-graphs needs a CUDA device (this run is on cpu)" in p.stderr + p.stdout
    assert "Traceback" not in p.stderr
    assert not list(tmp_path.iterdir())  # refused before a run folder is made


REFUSED = {  # flags -> the sentence train.py refuses them with (beside "needs a CUDA device" on this CPU)
    "rect": (["--rect"], "--cuda-graphs needs one input shape for the run; --rect changes it"),
    "multi-scale": (["--multi-scale"], "--cuda-graphs needs one input shape for the run; --multi-scale changes it"),
    "compile": (["--compile"], "--cuda-graphs and --compile both change how the step is launched; choose one"),
    "accumulation": (["--cfg", "models/yolov5n.yaml", "--batch-size", "16"],
                     "at --batch-size 16 this run's optimizer accumulates 4 batches per step (it steps every 64 "
                     "images): use --batch-size 64 or more"),
    "long schedule": (["--batch-size", "32", "--epochs", "10001"],  # anchor-free, 16 images: 10,001 steps of 64, SGD
                      "at --batch-size 32 this run's optimizer accumulates 2 batches per step"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refused_combination_is_one_line_before_anything_is_written(case, tiny_data, tmp_path, capsys,
                                                                        restore_logger):
    """Refused in the resolved config, before the run folder, the data scan and the model build: exit code 1,
    one ERROR line naming the combination, no run folder, no data generated."""
    flags, sentence = REFUSED[case]
    data = tmp_path / "fresh.yaml"  # a built-in set never generated: the refusal must not make it
    data.write_text(tiny_data.read_text().replace("seed: 1", "seed: 77"))
    code = train.cli(["--cuda-graphs", "--data", str(data), "--imgsz", "64", "--project", str(tmp_path / "runs"),
                      *flags])
    out = capsys.readouterr()
    errors = [line for line in (out.out + out.err).splitlines() if line.startswith("ERROR")]
    assert code == 1 and len(errors) == 1 and sentence in errors[0], out.out + out.err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "shapes").exists()


def test_graphed_steps_of_several_ranks_refuse_sync_bn():
    from yolotrain.utils.engine.plan import problems

    args = train.build_parser().parse_args(["--cuda-graphs", "--sync-bn", "--batch-size", "64"])
    found = problems(args, torch.device("cuda", 0), 2, lambda: 16)
    assert found == ["--cuda-graphs and --sync-bn: SyncBatchNorm exchanges statistics between ranks inside the "
                     "forward, which a graph cannot hold; choose one"]
    assert problems(args, torch.device("cuda", 0), 1, lambda: 16) == []  # one rank: SyncBatchNorm is plain BN
    assert problems(train.build_parser().parse_args([]), torch.device("cpu"), 1, lambda: 64) == []


def _targets(batch: int, generator: torch.Generator) -> torch.Tensor:
    n = 3 * batch
    return torch.cat([torch.randint(0, batch, (n, 1), generator=generator).float(),
                      torch.randint(0, 3, (n, 1), generator=generator).float(),
                      torch.rand(n, 2, generator=generator) * 0.6 + 0.2,
                      torch.rand(n, 2, generator=generator) * 0.2 + 0.05], 1)


def test_slots_grow_in_powers_of_two_from_the_minimum():
    assert [slots_for(n) for n in (0, 1, MIN_SLOTS, MIN_SLOTS + 1, 100)] == [MIN_SLOTS, MIN_SLOTS, MIN_SLOTS,
                                                                          2 * MIN_SLOTS, 128]


@pytest.mark.parametrize("name", ["yolov8n", "yolo26n"])
def test_padding_slots_change_no_loss_and_no_gradient(name):
    """What the captured loss computes, targets packed into more slots than any image has labels, is the eager
    loss bit for bit (assignment, loss, items and gradients); an image without labels included."""
    torch.manual_seed(0)
    model = Model(ROOT / "models" / f"{name}.yaml", nc=3).train()
    criterion = model.detect.build_criterion(Hyp(), 64)
    assert isinstance(criterion, PackedCriterion)
    g = torch.Generator().manual_seed(0)
    images, targets = torch.rand(4, 3, 64, 64, generator=g), _targets(4, g)
    targets = targets[targets[:, 0] != 3]  # the last image has none
    results = []
    for packed in (None, pack_targets(targets, 4, torch.device("cpu"), slots=MIN_SLOTS)):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            preds = model(images)
            loss, items = criterion(preds, targets) if packed is None else criterion.packed_loss(preds, packed)
        loss.backward()
        results.append((loss.detach(), items, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (a, ai, ag), (b, bi, bg) = results
    assert torch.equal(a, b) and torch.equal(ai, bi) and len(ag) == len(bg) and all(map(torch.equal, ag, bg))


def test_the_anchor_family_loss_is_not_captured():
    """YOLOv5's loss builds its targets per batch on the host: the graphs hold that model alone."""
    model = Model(ROOT / "models" / "yolov5n.yaml", nc=3)
    assert not isinstance(model.detect.build_criterion(Hyp(), 64), PackedCriterion)


def test_step_loss_without_graphs_is_the_model_then_the_loss():
    torch.manual_seed(0)
    model = Model(ROOT / "models" / "yolov8n.yaml", nc=3).train()
    criterion = model.detect.build_criterion(Hyp(), 64)
    g = torch.Generator().manual_seed(1)
    images, targets = torch.rand(2, 3, 64, 64, generator=g), _targets(2, g)
    loss, items = StepLoss(model, criterion)(images, targets)
    want, want_items = criterion(model(images), targets)
    assert torch.equal(loss, want) and torch.equal(items, want_items)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("name", ["yolov8n", "yolov5n"])
def test_two_ranks_reduce_what_the_graphed_unit_computes(tmp_path, name):
    """--cuda-graphs under torchrun (gloo, the capture replaced by the eager forward: tests/scripts/graphs_ranks.py):
    DDP around the replayable unit gives every rank the losses, all-reduced gradients and rank 0's broadcast
    BatchNorm statistics that DDP around the model gives, at the captured shape, after rank 1 alone captured anew
    for a crowded image (yolov8n, whose loss is graphed), and at a smaller eager batch; yolov5n's graphs hold the
    model alone, its loss outside DDP."""
    out = tmp_path / "ranks.jsonl"
    p = subprocess.run([*TORCHRUN, str(ROOT / "tests" / "scripts" / "graphs_ranks.py"), str(out), name], cwd=ROOT,
                       env=run_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    ranks = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["equal_losses"] == r["equal_grads"] == r["equal_buffers"] == [True] * 3, r
    assert ranks[0]["grad_sum"] == ranks[1]["grad_sum"]  # the gradients were all-reduced
    if name == "yolov5n":
        assert ranks[0]["captures"] == ranks[1]["captures"] == [[[4, 3, 64, 64]]]
        return
    first = [[4, 3, 64, 64], [4, MIN_SLOTS, 6]]
    assert ranks[0]["captures"] == [first] and ranks[1]["captures"] == [first, [[4, 3, 64, 64], [4, 2 * MIN_SLOTS, 6]]]


def _steps(model, step_loss, batches) -> list[float]:
    """AdamW steps under fp16 autocast (its cast cache off, as --cuda-graphs runs) as the loop takes them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler, ema = torch.amp.GradScaler("cuda"), ModelEMA(model)
    losses = []
    for imgs, targets in batches:
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            loss, _ = step_loss(imgs, targets)
        scaler.scale(loss).backward()
        optimizer_step(model, optimizer, scaler, ema)
        losses.append(float(loss))
    return losses


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["yolov8n", "yolo26n", "yolov5n"])
def test_graphed_steps_equal_eager_steps_on_cuda(name, monkeypatch):
    """Replayed graphs train what the eager module trains: the same losses, weights and BatchNorm statistics
    after steps at the captured shape, one with more labels in an image than the first capture's slots (captured
    anew), and one at another shape (eager); the capture's warm-up leaves no trace in the statistics. yolov5n's
    loss stays eager (its graphs hold the model alone)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    eager = Model(ROOT / "models" / f"{name}.yaml", nc=3).to(CUDA).train()
    graphed = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.rand(8, 3, 64, 64, generator=g).to(CUDA), _targets(8, g)) for _ in range(3)]
    crowded = _targets(8, g).repeat(MIN_SLOTS, 1)  # image 0 holds more than MIN_SLOTS labels
    crowded[:, 0] = 0
    batches.insert(2, (torch.rand(8, 3, 64, 64, generator=g).to(CUDA), crowded))
    batches.append((torch.rand(5, 3, 64, 64, generator=g).to(CUDA), _targets(5, g)))  # another shape: eager
    step = StepLoss(graphed, graphed.detect.build_criterion(Hyp(), 64), graphs=True)
    a = _steps(eager, StepLoss(eager, eager.detect.build_criterion(Hyp(), 64)), batches)
    b = _steps(graphed, step, batches)
    assert step.replayable.signature is not None and step.replayable.signature[0] == (8, 3, 64, 64)
    assert step.slots == (0 if name == "yolov5n" else slots_for(len(crowded)))
    assert "forward" not in vars(graphed)  # the module keeps its own forward: copies and eval stay eager
    assert a == pytest.approx(b, rel=1e-4)
    for (key, x), y in zip(eager.state_dict().items(), graphed.state_dict().values()):
        assert torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-5), key


@pytest.mark.cuda
def test_an_epoch_with_cuda_graphs_captures_replays_and_saves(tiny_data, tmp_path):
    """train.py --cuda-graphs, one step per batch and in micro-steps of 8: finite weights in last.pt and the
    capture's line in the log."""
    for name, extra in (("steps", []), ("micro", ["--micro-steps", "8"])):
        cmd = [sys.executable, "train.py", "--data", str(tiny_data), "--project", str(tmp_path), "--name", name,
               "--imgsz", "64", "--batch-size", "16", "--workers", "1", "--epochs", "2", "--device", "0",
               "--cuda-graphs", *extra]
        p = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        shape = "(8, 3, 64, 64)" if extra else "(16, 3, 64, 64)"
        assert (f"--cuda-graphs: the training forward, loss and backward captured for input {shape} and "
                f"{MIN_SLOTS} target slots per image") in p.stdout + p.stderr
        ckpt = torch.load(tmp_path / name / "weights" / "last.pt", map_location="cpu", weights_only=True)
        assert all(v.isfinite().all() for v in ckpt["model"].values() if v.is_floating_point())


@pytest.mark.cuda(devices=2)
def test_two_gpus_train_with_cuda_graphs(tiny_data, tmp_path):
    """train.py --cuda-graphs under torchrun on two GPUs: each rank captures, the run saves finite weights."""
    cmd = [*TORCHRUN, "train.py", "--data", str(tiny_data), "--project", str(tmp_path), "--name", "ddp", "--imgsz",
           "64", "--batch-size", "32", "--workers", "1", "--epochs", "2", "--device", "0,1", "--cuda-graphs"]
    p = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    log = p.stdout + p.stderr
    assert "--cuda-graphs: the training forward, loss and backward captured for input (16, 3, 64, 64)" in log
    ckpt = torch.load(tmp_path / "ddp" / "weights" / "last.pt", map_location="cpu", weights_only=True)
    assert all(v.isfinite().all() for v in ckpt["model"].values() if v.is_floating_point())
