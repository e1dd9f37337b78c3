"""End to end: torchrun 2 ranks on CPU -> rank-0 checkpoints -> val.py reproduces the logged metrics."""
from __future__ import annotations

import csv
import subprocess
import sys

import cv2
import pytest
import torch

from tests.conftest import ROOT, run_env

pytestmark = pytest.mark.slow  # subprocess training runs: `pytest -m 'not slow'` skips them


TINY = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0", "--seed", "3"]


def _run(args, timeout=400):
    return subprocess.run(args, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ddp_run(tiny_data, tmp_path_factory):
    project = tmp_path_factory.mktemp("runs")
    shm_before = _shm_caches()
    # --cache ram: one /dev/shm image cache per node shared by both ranks; val.py below reads from
    # disk, so equal metrics also show the cache is byte-identical to the uncached path
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "train.py", "--data", str(tiny_data), "--epochs", "2", "--project", str(project), "--name", "ddp",
              "--cache", "ram", *TINY])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("Caching images") == 2  # train and val caches, each built once (by rank 0)
    assert _shm_caches() == shm_before  # released at the end of training
    return project / "ddp", p


def _shm_caches() -> set[str]:
    import os
    return {f for f in os.listdir("/dev/shm") if f.startswith("yolotrain-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.dist
def test_ddp_training_writes_one_set_of_files(ddp_run):
    run_dir, p = ddp_run
    assert sorted(f.name for f in (run_dir / "weights").iterdir()) == ["best.pt", "last.pt"]
    pictures = ["F1_curve.png", "PR_curve.png", "P_curve.png", "R_curve.png", "confusion_matrix.png", "labels.jpg",
                "results.png", "train_batch0.jpg", "train_batch1.jpg", "train_batch2.jpg", "val_batch0_labels.jpg",
                "val_batch0_pred.jpg", "val_batch1_labels.jpg", "val_batch1_pred.jpg"]  # rank 0 draws its own two
    # 8 val images at a global --val-batch-size 4: batches of 2 per rank, the first 4 images on rank 0
    assert sorted(f.name for f in run_dir.iterdir()) == sorted(["hyp.yaml", "opt.yaml", "results.csv", "weights",
                                                                *pictures])  # rank 0's, no temp files
    assert all(cv2.imread(str(run_dir / f)) is not None for f in pictures)
    assert "Plots in " in p.stdout and p.stdout.count("Run: ") == 1  # the start summary, once
    for name in ("best.pt", "last.pt"):
        ckpt = torch.load(run_dir / "weights" / name, weights_only=True)
        assert ckpt["world_size"] == 2 and ckpt["epoch"] in (0, 1) and "optimizer" not in ckpt
        assert set(ckpt["model"]) == set(ckpt["ema"])
    rows = list(csv.DictReader(open(run_dir / "results.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    # one log, not one per rank: each epoch summary appears once
    assert p.stdout.count("epoch 2/2:") == 1
    assert "[rank 1]" not in p.stdout


def test_val_reproduces_best_epoch_metrics(ddp_run, tiny_data):
    run_dir, _ = ddp_run
    ckpt = torch.load(run_dir / "weights" / "best.pt", weights_only=True)
    p = _run([sys.executable, "val.py", "--noplots", "--weights", str(run_dir / "weights" / "best.pt"), "--data", str(tiny_data),
              "--batch-size", "4", "--workers", "0", *(["--half"] if ckpt["val_precision"] == "bf16" else [])])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("Results:")][-1]
    map50, map5095 = float(line.split()[2]), float(line.split()[4])
    assert abs(map50 - ckpt["metrics"]["map50"]) < 1e-4
    assert abs(map5095 - ckpt["metrics"]["map"]) < 1e-4
    assert ckpt["val_precision"] == ("bf16" if ckpt["args"]["amp"] else "fp32")


@pytest.mark.dist
def test_val_under_torchrun_matches_single_process(ddp_run, tiny_data, tmp_path):
    run_dir, _ = ddp_run
    outs, torchrun = [], [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for launcher, name in (([sys.executable], "v1"), (torchrun, "v2")):
        p = _run([*launcher, "val.py", "--noplots", "--weights", str(run_dir / "weights" / "last.pt"), "--data", str(tiny_data),
                  "--batch-size", "2", "--workers", "0", "--save-json", "--project", str(tmp_path), "--name", name])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        outs.append([l for l in p.stdout.splitlines() if l.startswith("Results:")][-1])
    assert outs[0] == outs[1]
    assert (tmp_path / "v1" / "predictions.json").read_bytes() == (tmp_path / "v2" / "predictions.json").read_bytes()


@pytest.mark.dist
def test_bad_data_yaml_is_one_clear_error_on_every_rank(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: nowhere/images\nval: nowhere/images\nnames: [a]\n")
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "train.py", "--data", str(bad), "--epochs", "1", "--project", str(tmp_path / "runs"), *TINY], timeout=200)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "ERROR: " in out and "bad.yaml: 'train' path not found" in out
    assert "[rank 1] ERROR:" in out  # the waiting rank says why it stops too
    # torchrun's launcher prints its own ChildFailedError report; no frame may come from our code
    ours = [f'File "{ROOT / name}' for name in ("train.py", "val.py", "utils", "models")]
    assert not any(frame in out for frame in ours) and "UserError" not in out


def test_bad_data_yaml_single_process_exits_1_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: nowhere/images\nval: nowhere/images\nnames: [a]\n")
    p = _run([sys.executable, "train.py", "--data", str(bad), "--project", str(tmp_path / "runs"), *TINY], timeout=100)
    assert p.returncode == 1
    assert "bad.yaml: 'train' path not found" in p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr


def test_users_own_dataset_trains_unchanged(tiny_data, tmp_path):
    """A plain YOLO dataset: absolute path, a .txt list for train, a folder for val, names as a list."""
    from utils.data.config import load_data_config, prepare_dataset
    prepare_dataset(load_data_config(tiny_data))  # make sure the images exist
    src = tiny_data.parent / "shapes"
    listing = tmp_path / "train.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted((src / "images" / "train").glob("*.jpg"))[:12]))
    own = tmp_path / "own.yaml"
    own.write_text(f"path: {src}\ntrain: {listing}\nval: images/val\n"
                   "names: [circle, square, triangle, star, cross, ring]\n")
    before = sorted(p.name for p in (src / "labels").rglob("*"))
    p = _run([sys.executable, "train.py", "--data", str(own), "--epochs", "1", "--project", str(tmp_path / "runs"),
              "--name", "own", "--cache-dir", str(tmp_path / "cache"), *TINY])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "runs" / "own" / "weights" / "best.pt").is_file()
    assert "12 images" in p.stdout
    # the dataset's own files are untouched (caches are added beside labels, never label edits)
    assert [n for n in sorted(p.name for p in (src / "labels").rglob("*")) if not n.endswith(".npz")] == \
           [n for n in before if not n.endswith(".npz")]


def test_killed_run_resumes_where_it_stopped(tiny_data, tmp_path):
    import os
    import signal
    import time
    project = tmp_path / "runs"
    args = [sys.executable, "train.py", "--data", str(tiny_data), "--epochs", "4", "--project", str(project),
            "--name", "r", *TINY]
    proc = subprocess.Popen(args, cwd=ROOT, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    results = project / "r" / "results.csv"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (project / "r" / "weights" / "last.pt").exists():  # epoch 0 is checkpointed
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpt = torch.load(project / "r" / "weights" / "last.pt", weights_only=True)  # intact despite the kill
    assert ckpt["epoch"] < 3 and "optimizer" in ckpt
    p = _run([sys.executable, "train.py", "--resume", str(project / "r" / "weights" / "last.pt"), "--workers", "0"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"Resuming {project / 'r' / 'weights' / 'last.pt'} from epoch {ckpt['epoch'] + 2} of 4" in p.stdout
    rows = list(csv.DictReader(open(results)))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    final = torch.load(project / "r" / "weights" / "last.pt", weights_only=True)
    assert final["epoch"] == 3 and "optimizer" not in final
    p = _run([sys.executable, "train.py", "--resume", str(project / "r" / "weights" / "last.pt")])
    assert p.returncode == 1 and "nothing to resume" in p.stdout + p.stderr


def test_fine_tune_with_new_class_count_and_frozen_layers(ddp_run, tiny_data, tmp_path):
    run_dir, _ = ddp_run
    source = torch.load(run_dir / "weights" / "best.pt", weights_only=True)
    p = _run([sys.executable, "train.py", "--data", str(tiny_data), "--single-cls", "--weights",
              str(run_dir / "weights" / "best.pt"), "--freeze", "10", "--epochs", "1",
              "--project", str(tmp_path), "--name", "ft", *TINY])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [l for l in p.stdout.splitlines() if l.startswith("Transferred ")][0]
    n_ok, n_all = map(int, line.split()[1].split("/"))
    # the default yolov8n: only the last class conv of each level (weight + bias, nc 6 -> 1) is new
    assert n_all - n_ok == 6 and all(f"model.22.cv3.{i}.2.weight" in line for i in range(3))
    assert "Froze" in p.stdout
    assert "outside [0, 0]" not in p.stdout + p.stderr  # --single-cls maps classes to 0; it drops no rows
    tuned = torch.load(tmp_path / "ft" / "weights" / "last.pt", weights_only=True)
    assert tuned["model_yaml"]["nc"] == 1
    params = [k for k in tuned["model"] if k.endswith(("conv.weight", "bn.weight", "bn.bias"))]
    frozen = [k for k in params if int(k.split(".")[1]) < 10]
    trainable = [k for k in params if int(k.split(".")[1]) >= 10]
    assert frozen and all(torch.equal(tuned["model"][k], source["ema"][k]) for k in frozen)
    # the warmup steps move the trainable tensors
    assert sum(not torch.equal(tuned["model"][k], source["ema"][k]) for k in trainable) >= 20


def test_custom_model_yaml_checkpoint_loads_without_the_file(tiny_data, tmp_path):
    cfg = (ROOT / "models" / "yolov5n.yaml").read_text().replace("width_multiple: 0.25", "width_multiple: 0.125")
    custom = tmp_path / "tiny-net.yaml"
    custom.write_text(cfg)
    p = _run([sys.executable, "train.py", "--data", str(tiny_data), "--cfg", str(custom), "--epochs", "1",
              "--project", str(tmp_path), "--name", "c", *TINY])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "AutoAnchor:" in p.stdout
    custom.unlink()  # the checkpoint carries its own model description
    p = _run([sys.executable, "val.py", "--noplots", "--weights", str(tmp_path / "c" / "weights" / "best.pt"), "--workers", "0"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Results: mAP50" in p.stdout


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
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "train.py", "--data", str(data), "--epochs", "1", "--project", str(tmp_path / "runs"), *TINY], timeout=200)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and time.time() - t0 < 120
    assert "no usable images" in out and "0.jpg" in out  # the fatal error and the per-file reason
    assert "[rank 1] ERROR:" in out
    assert not any(f'File "{ROOT / name}' in out for name in ("train.py", "utils", "models"))
    assert {p: p.read_bytes() for p in before} == before  # nothing on disk was changed


def test_recipe_flags_save_period_multiscale_keep_optimizer_syncbn(tiny_data, tmp_path):
    p = _run([sys.executable, "train.py", "--data", str(tiny_data), "--epochs", "2", "--project", str(tmp_path),
              "--name", "f", "--save-period", "1", "--multi-scale", "--keep-optimizer", "--sync-bn", "--cos-lr",
              "--optimizer", "AdamW", "--channels-last", *TINY])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    weights = tmp_path / "f" / "weights"
    assert sorted(f.name for f in weights.iterdir()) == ["best.pt", "epoch1.pt", "epoch2.pt", "last.pt"]
    assert "optimizer" in torch.load(weights / "last.pt", weights_only=True)  # kept, not stripped
    assert "--sync-bn needs CUDA and more than one rank" in p.stdout + p.stderr
    assert "Optimizer: AdamW lr 0.01" in p.stdout and "as requested" in p.stdout  # hyp lr0 for a named optimizer
    last = torch.load(weights / "last.pt", weights_only=True)
    assert last["args"]["channels_last"] and all(torch.isfinite(v).all() for v in last["model"].values()
                                                 if v.is_floating_point())
