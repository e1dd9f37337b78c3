"""End to end: torchrun 2 ranks on CPU -> rank-0 checkpoints -> val.py reproduces the logged metrics."""
from __future__ import annotations

import csv
import re

import cv2
import pytest
import torch

from tests.helpers import PYTHON, ROOT, TINY, TORCHRUN, out, run, run_train, train_here, val_here

pytestmark = pytest.mark.slow  # training runs: `pytest -m 'not slow'` skips them


@pytest.fixture(scope="module")
def ddp_run(tiny_data, once):
    """A 2-epoch torchrun run with --cache ram (made once per test run): (its folder, its stdout)."""
    def build(project):
        # --cache ram: one /dev/shm image cache per node shared by both ranks; val.py below reads from
        # disk, so equal metrics also show the cache is byte-identical to the uncached path
        p = run_train(TORCHRUN, tiny_data, project, "ddp", "--epochs", "2", "--cache", "ram", *TINY, timeout=400)
        (project / "stdout.txt").write_text(p.stdout)

    project = once("ddp-run", build)
    return project / "ddp", (project / "stdout.txt").read_text()


def _shm_caches_of(stdout: str) -> list[str]:
    """The /dev/shm files a run's log names as its image caches."""
    return re.findall(r"/dev/shm/(yolotrain-[^\s:,)]+)", stdout)


@pytest.mark.dist
def test_ddp_training_writes_one_set_of_files(ddp_run):
    run_dir, stdout = ddp_run
    assert stdout.count("Caching images") == 2  # train and val caches, each built once (by rank 0)
    import os
    assert not [f for f in _shm_caches_of(stdout) if os.path.exists(f"/dev/shm/{f}")]  # released at the end
    assert sorted(f.name for f in (run_dir / "weights").iterdir()) == ["best.pt", "last.pt"]
    pictures = ["F1_curve.png", "PR_curve.png", "P_curve.png", "R_curve.png", "confusion_matrix.png", "labels.jpg",
                "results.png", "train_batch0.jpg", "train_batch1.jpg", "train_batch2.jpg", "val_batch0_labels.jpg",
                "val_batch0_pred.jpg", "val_batch1_labels.jpg", "val_batch1_pred.jpg"]  # rank 0 draws its own two
    # 8 val images at a global --val-batch-size 4: batches of 2 per rank, the first 4 images on rank 0
    assert sorted(f.name for f in run_dir.iterdir()) == sorted(["hyp.yaml", "opt.yaml", "results.csv", "weights",
                                                                *pictures])  # rank 0's, no temp files
    assert all(cv2.imread(str(run_dir / f)) is not None for f in pictures)
    assert "Plots in " in stdout and stdout.count("Run: ") == 1  # the start summary, once
    for name in ("best.pt", "last.pt"):
        ckpt = torch.load(run_dir / "weights" / name, weights_only=True)
        assert ckpt["world_size"] == 2 and ckpt["epoch"] in (0, 1) and "optimizer" not in ckpt
        assert set(ckpt["model"]) == set(ckpt["ema"])
    rows = list(csv.DictReader(open(run_dir / "results.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    # one log, not one per rank: each epoch summary appears once
    assert stdout.count("epoch 2/2:") == 1
    assert "[rank 1]" not in stdout


def test_val_reproduces_best_epoch_metrics(ddp_run, tiny_data, capsys, restore_logger):
    run_dir, _ = ddp_run
    ckpt = torch.load(run_dir / "weights" / "best.pt", weights_only=True)
    val_here("--noplots", "--weights", run_dir / "weights" / "best.pt", "--data", tiny_data, "--batch-size", "4",
             "--workers", "0", *(["--half"] if ckpt["val_precision"] == "bf16" else []))
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("Results:")][-1]
    map50, map5095 = float(line.split()[2]), float(line.split()[4])
    assert abs(map50 - ckpt["metrics"]["map50"]) < 1e-4
    assert abs(map5095 - ckpt["metrics"]["map"]) < 1e-4
    assert ckpt["val_precision"] == ("bf16" if ckpt["args"]["amp"] else "fp32")


@pytest.mark.dist
def test_val_under_torchrun_matches_single_process(ddp_run, tiny_data, tmp_path):
    run_dir, _ = ddp_run
    outs = []
    for launcher, name in (([PYTHON], "v1"), (TORCHRUN, "v2")):
        p = run([*launcher, "val.py", "--noplots", "--weights", run_dir / "weights" / "last.pt", "--data", tiny_data,
                 "--batch-size", "2", "--workers", "0", "--save-json", "--project", tmp_path, "--name", name])
        outs.append([l for l in p.stdout.splitlines() if l.startswith("Results:")][-1])
    assert outs[0] == outs[1]
    assert (tmp_path / "v1" / "predictions.json").read_bytes() == (tmp_path / "v2" / "predictions.json").read_bytes()


@pytest.mark.dist
def test_bad_data_yaml_is_one_clear_error_on_every_rank(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: nowhere/images\nval: nowhere/images\nnames: [a]\n")
    p = run([*TORCHRUN, "train.py", "--data", bad, "--epochs", "1", "--project", tmp_path / "runs", *TINY],
            ok=False, timeout=200)
    text = out(p)
    assert "ERROR: " in text and "bad.yaml: 'train' path not found" in text
    assert "[rank 1] ERROR:" in text  # the waiting rank says why it stops too
    # torchrun's launcher prints its own ChildFailedError report; no frame may come from our code
    ours = [f'File "{ROOT / name}' for name in ("train.py", "val.py", "utils", "models")]
    assert not any(frame in text for frame in ours) and "UserError" not in text


def test_bad_data_yaml_single_process_exits_1_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: nowhere/images\nval: nowhere/images\nnames: [a]\n")
    p = run([PYTHON, "train.py", "--data", bad, "--project", tmp_path / "runs", *TINY], ok=False, timeout=100)
    assert p.returncode == 1
    assert "bad.yaml: 'train' path not found" in out(p)
    assert "Traceback" not in out(p)


def test_users_own_dataset_trains_unchanged(tiny_data, tmp_path, capsys, restore_logger):
    """A plain YOLO dataset: absolute path, a .txt list for train, a folder for val, names as a list."""
    from yolotrain.utils.data.config import load_data_config, prepare_dataset
    prepare_dataset(load_data_config(tiny_data))  # make sure the images exist
    src = tiny_data.parent / "shapes"
    listing = tmp_path / "train.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted((src / "images" / "train").glob("*.jpg"))[:12]))
    own = tmp_path / "own.yaml"
    own.write_text(f"path: {src}\ntrain: {listing}\nval: images/val\n"
                   "names: [circle, square, triangle, star, cross, ring]\n")
    before = sorted(p.name for p in (src / "labels").rglob("*"))
    train_here("--data", own, "--epochs", "1", "--project", tmp_path / "runs", "--name", "own", "--cache-dir",
               tmp_path / "cache", *TINY)
    assert (tmp_path / "runs" / "own" / "weights" / "best.pt").is_file()
    assert "12 images" in capsys.readouterr().out
    # the dataset's own files are untouched (caches are added beside labels, never label edits)
    assert [n for n in sorted(p.name for p in (src / "labels").rglob("*")) if not n.endswith(".npz")] == \
           [n for n in before if not n.endswith(".npz")]


def test_fine_tune_with_new_class_count_and_frozen_layers(ddp_run, tiny_data, tmp_path, capsys, restore_logger):
    run_dir, _ = ddp_run
    source = torch.load(run_dir / "weights" / "best.pt", weights_only=True)
    train_here("--data", tiny_data, "--single-cls", "--weights", run_dir / "weights" / "best.pt", "--freeze", "10",
               "--epochs", "1", "--project", tmp_path, "--name", "ft", *TINY)
    captured = capsys.readouterr()
    stdout = captured.out
    line = [l for l in stdout.splitlines() if l.startswith("Transferred ")][0]
    n_ok, n_all = map(int, line.split()[1].split("/"))
    # the default yolov8n: only the last class conv of each level (weight + bias, nc 6 -> 1) is new
    assert n_all - n_ok == 6 and all(f"model.22.cv3.{i}.2.weight" in line for i in range(3))
    assert "Froze" in stdout
    assert "outside [0, 0]" not in stdout + captured.err  # --single-cls maps classes to 0; it drops no rows
    tuned = torch.load(tmp_path / "ft" / "weights" / "last.pt", weights_only=True)
    assert tuned["model_yaml"]["nc"] == 1
    params = [k for k in tuned["model"] if k.endswith(("conv.weight", "bn.weight", "bn.bias"))]
    frozen = [k for k in params if int(k.split(".")[1]) < 10]
    trainable = [k for k in params if int(k.split(".")[1]) >= 10]
    assert frozen and all(torch.equal(tuned["model"][k], source["ema"][k]) for k in frozen)
    # the warmup steps move the trainable tensors
    assert sum(not torch.equal(tuned["model"][k], source["ema"][k]) for k in trainable) >= 20


def test_custom_model_yaml_checkpoint_loads_without_the_file(tiny_data, tmp_path, capsys, restore_logger):
    cfg = (ROOT / "models" / "yolov5n.yaml").read_text().replace("width_multiple: 0.25", "width_multiple: 0.125")
    custom = tmp_path / "tiny-net.yaml"
    custom.write_text(cfg)
    train_here("--data", tiny_data, "--cfg", custom, "--epochs", "1", "--project", tmp_path, "--name", "c", *TINY)
    assert "AutoAnchor:" in capsys.readouterr().out
    custom.unlink()  # the checkpoint carries its own model description
    val_here("--noplots", "--weights", tmp_path / "c" / "weights" / "best.pt", "--workers", "0")
    assert "Results: mAP50" in capsys.readouterr().out


@pytest.mark.dist
def test_no_usable_image_stops_every_rank_promptly(tmp_path):
    import time
    for split in ("train", "val"):
        (tmp_path / "ds" / "images" / split).mkdir(parents=True)
        (tmp_path / "ds" / "labels" / split).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "ds" / "images" / split / f"{i}.jpg").write_bytes(b"not a jpeg at all")
            (tmp_path / "ds" / "labels" / split / f"{i}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    data = tmp_path / "broken.yaml"
    data.write_text(f"path: {tmp_path / 'ds'}\ntrain: images/train\nval: images/val\nnames: [a]\n")
    before = {p: p.read_bytes() for p in (tmp_path / "ds").rglob("*") if p.is_file()}
    t0 = time.time()
    p = run([*TORCHRUN, "train.py", "--data", data, "--epochs", "1", "--project", tmp_path / "runs", *TINY], ok=False,
            timeout=200)
    text = out(p)
    assert time.time() - t0 < 120
    assert "no usable images" in text and "0.jpg" in text  # the fatal error and the per-file reason
    assert "[rank 1] ERROR:" in text
    assert not any(f'File "{ROOT / name}' in text for name in ("train.py", "utils", "models"))
    assert {p: p.read_bytes() for p in before} == before  # nothing on disk was changed


def test_recipe_flags_save_period_multiscale_keep_optimizer_syncbn(tiny_data, tmp_path, capsys, restore_logger):
    train_here("--data", tiny_data, "--epochs", "2", "--project", tmp_path, "--name", "f", "--save-period", "1",
               "--multi-scale", "--keep-optimizer", "--sync-bn", "--cos-lr", "--optimizer", "AdamW", "--channels-last",
               *TINY)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    weights = tmp_path / "f" / "weights"
    assert sorted(f.name for f in weights.iterdir()) == ["best.pt", "epoch1.pt", "epoch2.pt", "last.pt"]
    assert "optimizer" in torch.load(weights / "last.pt", weights_only=True)  # kept, not stripped
    assert "--sync-bn needs CUDA and more than one rank" in text
    assert "Optimizer: AdamW lr 0.01" in text and "as requested" in text  # hyp lr0 for a named optimizer
    last = torch.load(weights / "last.pt", weights_only=True)
    assert last["args"]["channels_last"] and all(torch.isfinite(v).all() for v in last["model"].values()
                                                 if v.is_floating_point())
