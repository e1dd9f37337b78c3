"""--batch-size -1 (AutoBatch): the fit, the free-memory rule, out-of-memory sizes, the ranks' minimum,
the CPU refusal through train.py, and (on a GPU) a real profile of yolov8n at 320."""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest
import torch

from yolotrain.app import train
from yolotrain.models.yolo import Model
from tests.helpers import ROOT, run_env
from yolotrain.utils.core.cli import ResolvedArgs
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.engine.autobatch import FREE_FRACTION, GiB, PROFILE_BATCHES, agree_on_batch, auto_batch_size, cuda_measure, \
    cuda_usable_bytes, fit_batch, global_batch, profile_size, profile_step, synthetic_targets
from yolotrain.utils.engine.config import Resume, resolve_config

TOTAL = 80 * GiB


def linear(a: float, b: float, oom_from: int | None = None, calls: list | None = None):
    """A simulated GPU: ``a + b * batch`` bytes, out of memory from batch ``oom_from``."""
    def measure(batch: int) -> int | None:
        if calls is not None:
            calls.append(batch)
        return None if oom_from is not None and batch >= oom_from else int(a + b * batch)
    return measure


def test_fit_recovers_the_line_and_keeps_the_free_fraction():
    a, b = 1.5 * GiB, 0.03 * GiB
    fit = fit_batch(linear(a, b), TOTAL)
    assert [p[0] for p in fit.points] == list(PROFILE_BATCHES) and fit.failed is None
    assert fit.slope == pytest.approx(b, rel=1e-6) and fit.intercept == pytest.approx(a, rel=1e-6)
    limit = TOTAL * (1 - FREE_FRACTION)
    assert a + b * fit.batch <= limit < a + b * (fit.batch + 1)  # the largest batch that leaves the fraction free
    assert fit.batch == int((limit - a) // b) == 2083


def test_free_fraction_is_a_parameter_and_more_free_memory_means_a_smaller_batch():
    m = linear(GiB, 0.05 * GiB)
    tight, loose = fit_batch(m, TOTAL, free=0.5), fit_batch(m, TOTAL, free=0.1)
    assert 0.5 * TOTAL >= GiB + 0.05 * GiB * tight.batch and tight.batch < loose.batch
    assert "keeps 50% of 80.0 GiB free" in tight.describe()


def test_noisy_points_fit_by_least_squares():
    noise = {1: 3e6, 2: -2e6, 4: 1e6, 8: -4e6, 16: 2e6}
    fit = fit_batch(lambda n: int(GiB + 0.02 * GiB * n + noise[n]), TOTAL)
    assert fit.slope == pytest.approx(0.02 * GiB, rel=0.01) and abs(fit.batch - 3150) <= 5


def test_out_of_memory_stops_the_profile_and_caps_the_batch():
    calls: list[int] = []
    fit = fit_batch(linear(GiB, 10 * GiB, oom_from=8, calls=calls), TOTAL)  # the line alone would allow 6
    assert calls == [1, 2, 4, 8] and fit.failed == 8 and [p[0] for p in fit.points] == [1, 2, 4]
    assert fit.batch == 6 and "out of memory at 8" in fit.describe()
    fit = fit_batch(linear(GiB, 0.01 * GiB, oom_from=16), TOTAL)  # the line allows thousands; 16 failed
    assert fit.batch == 15


def test_one_point_fits_through_the_origin():
    fit = fit_batch(linear(0, 30 * GiB, oom_from=2), TOTAL)
    assert fit.points == ((1, 30 * GiB),) and fit.intercept == 0 and fit.batch == 1


def test_out_of_memory_at_the_smallest_size_is_a_user_error_naming_the_sizes():
    with pytest.raises(UserError, match=r"--batch-size -1 \(AutoBatch\): out of GPU memory at batch 1, the smallest "
                                        r"size tried \(of 1, 2, 4, 8, 16\).*--batch-size"):
        fit_batch(linear(GiB, GiB, oom_from=1), TOTAL)


def test_a_batch_over_the_limit_at_size_one_still_trains_one():
    fit = fit_batch(linear(0.9 * TOTAL, GiB), TOTAL)
    assert fit.batch == 1 and "batch 1 per rank (the smallest) leaves less than 20% of 80.0 GiB free" in fit.describe()


def test_the_smallest_rank_wins_and_the_global_batch_splits_evenly():
    assert global_batch([2083], 1) == 2083
    assert global_batch([812, 790, 811, 900], 4) == 3160
    for per_rank, world in (([7, 5, 9], 3), ([1, 1], 2), ([333] * 8, 8)):
        batch = global_batch(per_rank, world)
        assert batch % world == 0 and batch // world == min(per_rank)


def test_one_rank_agrees_with_itself_and_logs_the_fit(caplog):
    fit = fit_batch(linear(1.5 * GiB, 0.03 * GiB), TOTAL)
    with caplog.at_level(logging.INFO, logger="yolotrain"):
        assert agree_on_batch(fit, 1, "imgsz 320, fp32") == 2083
    assert "peak GiB per batch 1: 1.53, 2: 1.56, 4: 1.62, 8: 1.74, 16: 1.98" in caplog.text
    assert "fit 0.0300 GiB per image + 1.50 GiB; batch 2083 per rank keeps 20% of 80.0 GiB free" in caplog.text
    assert "(rank 0, imgsz 320, fp32)" in caplog.text and "AutoBatch: --batch-size 2083 (2083 per rank)" in caplog.text


def test_a_failed_profile_is_an_error_on_every_rank():
    with pytest.raises(UserError, match=r"^--batch-size -1 \(AutoBatch\): out of GPU memory at batch 1"):
        agree_on_batch("--batch-size -1 (AutoBatch): out of GPU memory at batch 1", 1)


def test_multi_scale_profiles_the_largest_size():
    assert profile_size(320, 32, False) == 320
    assert profile_size(320, 32, True) == 480  # rescale_batch draws up to int(1.5 x 320) + 31, floored to 32
    assert profile_size(640, 64, True) == 960


def test_synthetic_labels_are_normalised_boxes_for_every_image():
    t = synthetic_targets(3, nc=5, boxes=4)
    assert t.shape == (12, 6) and t[:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert t[:, 1].max() < 5 and ((t[:, 2:] > 0) & (t[:, 2:] < 1)).all()
    assert torch.equal(t, synthetic_targets(3, nc=5, boxes=4))


@pytest.mark.parametrize("cfg", ["yolov5n.yaml", "yolov8n.yaml"])
def test_the_profiled_step_trains_both_families(cfg, one_thread):
    """The step the GPU profile measures runs the real model and loss and fills every trainable gradient."""
    model = Model(ROOT / "models" / cfg, nc=3).train()
    criterion = model.detect.build_criterion(Hyp(), 64)
    profile_step(model, criterion, 2, 64, 3, amp=False, memory_format=torch.contiguous_format)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)


def test_parser_takes_minus_one_and_refuses_other_values_below_one(capsys):
    parser = train.build_parser()
    assert parser.parse_args(["--batch-size", "-1"]).batch_size == -1
    assert parser.parse_args(["--batch-size", "8"]).batch_size == 8
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--batch-size", bad])
        assert e.value.code == 2
        assert f"argument --batch-size: must be an integer >= 1, or -1 for AutoBatch, got '{bad}'" in capsys.readouterr().err


def test_resolve_config_refuses_autobatch_on_cpu(tmp_path):
    args = vars(train.build_parser().parse_args(["--batch-size", "-1", "--project", str(tmp_path)]))
    with pytest.raises(UserError, match=r"--batch-size -1 \(AutoBatch\) needs a CUDA device; give a batch size"):
        resolve_config(Resume(ResolvedArgs(**args)), torch.device("cpu"))


@pytest.mark.slow
def test_train_py_refuses_autobatch_on_cpu_in_one_line(tmp_path):
    p = subprocess.run([sys.executable, "train.py", "--batch-size", "-1", "--device", "cpu", "--epochs", "1",
                        "--project", str(tmp_path)], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "--batch-size -1 (AutoBatch) needs a CUDA device; give a batch size" in out
    assert "Traceback" not in out
    assert not list(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.cuda
def test_autobatch_profiles_yolov8n_at_320_on_a_gpu(capsys):
    """A real profile: points grow with the batch, the chosen batch runs within the budget."""
    device = torch.device("cuda", torch.cuda.current_device())
    args = argparse.Namespace(imgsz=320, multi_scale=False)
    batch = auto_batch_size(ROOT / "models" / "yolov8n.yaml", 80, Hyp(), args, device, world_size=1, amp=True,
                            channels_last=False)
    assert batch >= 16
    model = Model(ROOT / "models" / "yolov8n.yaml", nc=80).to(device).train()
    used = cuda_measure(model, Hyp(), 320, 80, True, torch.contiguous_format)(batch)
    assert used is not None and used <= cuda_usable_bytes(device) * (1 - FREE_FRACTION / 2)
