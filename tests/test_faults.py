"""The machine failing under a running job (utils/engine/faults.py, utils/core/storage.py): a read-only run
folder, a disk that fills mid-run, an image that vanishes mid-epoch, a loader worker killed. Each gives one line
naming the file and the problem, a non-zero exit on every rank (or a run that goes on exactly, for a killed
worker), no traceback, and checkpoints that load and resume to the undisturbed run's weights.

Real conditions: a read-only bind mount and a small tmpfs (root only; skipped where mount is not permitted), a
train images folder moved away while the run trains (tests/scripts/vanish.py), a worker SIGKILLed from outside.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import LAUNCHERS, PYTHON, ROOT, assert_same_run, children, load, out, run, run_env, run_train

EPOCHS = 3
# 32 images in batches of 4: 8 batches an epoch, and by epoch 3 the warmup's accumulation puts optimizer steps
# two batches apart, so a fault can land between steps
FLAGS = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0", "--seed", "5",
         "--epochs", str(EPOCHS), "--noplots", "--keep-optimizer"]
VANISH = str(ROOT / "tests" / "scripts" / "vanish.py")


def _yaml(root: Path, at: Path) -> Path:
    at.write_text(f"path: {root}\ntrain: images/train\nval: images/val\n"
                  "names: {0: circle, 1: square, 2: triangle, 3: star, 4: cross, 5: ring}\n")
    return at


@pytest.fixture(scope="module")
def data(shapes_dataset, once) -> Path:
    """The shared 32-image dataset's yaml (read-only: a test that removes files copies it)."""
    root = shapes_dataset(2, 32, 8)
    return once("faults-data", lambda folder: _yaml(root, folder / "data.yaml")) / "data.yaml"


@pytest.fixture
def own_data(shapes_dataset, tmp_path) -> Path:
    """A copy of the dataset this test may damage; its yaml."""
    root = tmp_path / "ds"
    shutil.copytree(shapes_dataset(2, 32, 8), root)
    return _yaml(root, tmp_path / "data.yaml")


@contextlib.contextmanager
def mounted(target: Path, *options: str, source: str = "tmpfs"):
    """``mount`` for the test (root, a mount namespace that permits it), always unmounted after."""
    target.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", *options, source, str(target)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"mount {' '.join(options)} not permitted here: {p.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def no_traceback(text: str, torchrun: bool = False) -> None:
    """No frame of ours and no exception name; no traceback at all but torchrun's own (of its ChildFailedError)."""
    ours = [f'File "{ROOT / name}' for name in ("train.py", "yolotrain")]
    assert not any(frame in text for frame in ours) and "UserError" not in text, text[-3000:]
    assert torchrun or "Traceback" not in text, text[-3000:]


def temp_files(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["1-process", pytest.param("2-process", marks=pytest.mark.dist)])
def test_read_only_run_folder_is_refused_before_any_work(launcher, data, tmp_path):
    """--project on a read-only file system: one line naming the folder and the reason, on every rank, before
    the scan (no label cache written beside the labels of a fresh copy) or the model build."""
    source = tmp_path / "source"
    source.mkdir()
    with mounted(tmp_path / "ro", "--bind", "-o", "ro", source=str(source)) as ro:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        p = run_train(LAUNCHERS[launcher], data, ro / "runs", "exp", *FLAGS, ok=False, timeout=300)
    text = out(p)
    line = f"{ro / 'runs' / 'exp'}: the run folder is not writable: read-only file system (EROFS)"
    assert f"ERROR: {line}" in text, text[-3000:]
    assert launcher == "1-process" or f"[rank 1] ERROR: {line}" in text, text[-3000:]  # rank 1's own line
    assert "Training " not in text
    no_traceback(text, torchrun=launcher == "2-process")


@pytest.mark.slow
def test_full_disk_mid_run_names_the_file_and_the_checkpoint_to_resume(data, reference_run, tmp_path):
    """A tmpfs that holds epoch 1's last.pt and best.pt but not epoch 2's last.pt: exit 1 with the line naming
    last.pt, ENOSPC and the free space, epoch 1's last.pt as the one to resume, no temp file left; the run folder
    copied to a disk with room resumes to the undisturbed run's weights."""
    ref = reference_run(*FLAGS, data=data)
    size = ref.last.stat().st_size
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", f"size={int(2.5 * size)}") as small:
        p = run_train([PYTHON], data, small, "run", *FLAGS, ok=False, timeout=300)
        weights = small / "run" / "weights"
        last = weights / "last.pt"
        assert p.returncode == 1 and f"ERROR: {last}: cannot be written: no space left on the device (ENOSPC); " \
            in out(p), out(p)[-3000:]
        assert f"free of" in out(p) and f"{last} (epoch 1) is the last good checkpoint" in out(p)
        assert f"--resume {last} continues from it" in out(p)
        no_traceback(out(p))
        assert temp_files(weights) == [] and load(last)["epoch"] == 0
        shutil.copytree(small / "run", tmp_path / "run")
    run([PYTHON, "train.py", "--resume", tmp_path / "run" / "weights" / "last.pt"], timeout=300)
    assert_same_run(ref.last, tmp_path / "run" / "weights" / "last.pt", epochs=EPOCHS)


@pytest.mark.slow
def test_run_folder_remounted_read_only_mid_run_stops_at_the_next_write(data, reference_run, tmp_path):
    """The run folder's file system remounted read-only once epoch 1's checkpoints are written: epoch 2's
    results.csv row is refused with EROFS, epoch 1's last.pt (whole, loadable) named as the one to resume."""
    ref = reference_run(*FLAGS, data=data)
    source = tmp_path / "source"
    source.mkdir()
    log = tmp_path / "log.txt"
    with mounted(tmp_path / "disk", "--bind", source=str(source)) as disk:
        weights = disk / "run" / "weights"
        cmd = [PYTHON, "train.py", "--data", data, "--project", disk, "--name", "run", *FLAGS]
        with open(log, "w") as f:
            proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=run_env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            _wait_for(weights / "best.pt", proc, log)  # written after last.pt: epoch 1's checkpoints are done
            subprocess.run(["mount", "-o", "remount,bind,ro", str(disk)], check=True)
            assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
        finally:
            proc.kill()
        text = log.read_text()
        assert f"ERROR: {disk / 'run' / 'results.csv'}: cannot be written: read-only file system (EROFS)" in text, \
            text[-3000:]
        assert f"{weights / 'last.pt'} (epoch 1) is the last good checkpoint" in text
        no_traceback(text)
    last = source / "run" / "weights" / "last.pt"
    assert temp_files(last.parent) == [] and load(last)["epoch"] == 0 and load(last)["model"].keys() == \
        load(ref.last)["model"].keys()


@pytest.mark.slow
def test_run_folder_removed_mid_run_is_named_at_the_next_write(data, tmp_path):
    """The run folder removed once epoch 1's checkpoints are written: epoch 2's results.csv row fails with the
    folder named gone (ENOENT), and the line says no checkpoint is left to resume."""
    run_dir, log = tmp_path / "runs" / "run", tmp_path / "log.txt"
    cmd = [PYTHON, "train.py", "--data", data, "--project", run_dir.parent, "--name", "run", *FLAGS, "--epochs", "2"]
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=run_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        _wait_for(run_dir / "weights" / "best.pt", proc, log)
        shutil.rmtree(run_dir)
        assert proc.wait(timeout=300) == 1, log.read_text()[-3000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert f"ERROR: {run_dir / 'results.csv'}: cannot be written: the folder is gone (ENOENT)" in text, text[-3000:]
    assert f"no checkpoint of this run is left in {run_dir / 'weights'}, so it starts again" in text
    no_traceback(text)


def _wait_for(path: Path, proc: subprocess.Popen, log: Path) -> None:
    """Until ``path`` exists (the run still going)."""
    deadline = time.time() + 240
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


@pytest.mark.slow
def test_image_vanishing_mid_epoch_stops_with_a_checkpoint_that_resumes_exactly(own_data, data, reference_run,
                                                                              tmp_path):
    """The train images folder moved away after batch 5 of epoch 3 (the next fetch lands between optimizer steps):
    the line names the image and the checkpoint, saved at that epoch's last optimizer step before the batch the
    rank could not read (batch 5, no stand-in batch in it); with the folder back, --resume ends bit-identical to
    the undisturbed run."""
    ref = reference_run(*FLAGS, data=data)
    images = own_data.parent / "ds" / "images" / "train"
    p = run([PYTHON, VANISH, "--vanish-at", f"{EPOCHS}:5", images, "--data", own_data, "--project",
             tmp_path / "runs", "--name", "run", *FLAGS], ok=False, timeout=300)
    last = tmp_path / "runs" / "run" / "weights" / "last.pt"
    text = out(p)
    assert p.returncode == 1 and f"ERROR: {images}/" in text and "cannot read image (No such file or directory)" \
        in text, text[-3000:]
    assert f"saved {last} at epoch {EPOCHS}, batch 5/8, the last optimizer step" in text
    assert f"once the file can be read again, python train.py --resume {last} continues from it" in text
    no_traceback(text)
    assert load(last)["batches_done"] == 5
    gone = images.with_name("train.gone")
    images.mkdir()
    for path in sorted(gone.iterdir())[:8]:  # a resume before every image is back: the scan finds fewer
        path.rename(images / path.name)
    p = run([PYTHON, "train.py", "--resume", last], ok=False, timeout=300)
    assert f"ERROR: {own_data}: its train split gives 2 batches per epoch per rank where the run in {last} had 8" \
        in out(p), out(p)[-3000:]
    no_traceback(out(p))
    for path in gone.iterdir():
        path.rename(images / path.name)
    run([PYTHON, "train.py", "--resume", last], timeout=300)
    assert_same_run(ref.last, last, epochs=EPOCHS)


@pytest.mark.slow
def test_killed_loader_workers_restart_and_the_run_ends_exactly(data, reference_run, tmp_path):
    """SIGKILL (what the OOM killer sends) to the training and the validation loaders' workers after epoch 1: a
    warning for each naming the worker, the cause and what to change; the training loader restarts at the batch
    it had not delivered, the validation runs again on fresh workers, and the run ends with the undisturbed run's
    weights and metrics (--workers does not change the draws)."""
    ref = reference_run(*FLAGS, data=data)
    cmd = [PYTHON, "train.py", "--data", data, "--project", tmp_path / "runs", "--name", "run", *FLAGS,
           "--workers", "1"]
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=run_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        train_worker, val_worker = _workers(proc, log)
        for pid in (train_worker, val_worker):
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert f"WARNING: loader worker (pid {train_worker}) was killed by SIGKILL at epoch 2, batch 1; restarted the " \
           "loader there (1/3)" in text, text[-3000:]
    assert f"WARNING: loader worker (pid {val_worker}) was killed by SIGKILL during validation; validating again " \
           "on a fresh loader (1/3)" in text, text[-3000:]
    assert "OOM killer" in text and "--workers" in text and "--cache" in text
    no_traceback(text)
    assert_same_run(ref.last, tmp_path / "runs" / "run" / "weights" / "last.pt", epochs=EPOCHS)


def _workers(proc: subprocess.Popen, log: Path) -> list[int]:
    """Once epoch 1 is logged: the run's two children, the training loader's worker and the validation's (which
    starts later), both waiting for the next epoch."""
    deadline = time.time() + 240
    while "epoch 1/" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)

    def started(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])

    found = sorted(children(proc.pid), key=started)
    assert len(found) == 2, found
    return found


@pytest.mark.slow
@pytest.mark.dist
def test_image_vanishing_under_torchrun_stops_every_rank_with_a_checkpoint(own_data, tmp_path):
    """Two ranks: the images folder moved away mid-epoch; each rank names an image and the checkpoint, every rank
    exits non-zero together (no rank waits for another). Resumed with the folder back and half its images moved
    away as training starts, each rank fails before it trained a batch, stands in a readable sample and stops at
    the first step with the checkpoint it resumed from; with all back the resumed job finishes."""
    images = own_data.parent / "ds" / "images" / "train"
    torchrun = LAUNCHERS["2-process"]
    t0 = time.time()
    p = run([*torchrun, VANISH, "--vanish-at", f"{EPOCHS}:5", images, "--data", own_data, "--project",
             tmp_path / "runs", "--name", "run", *FLAGS], ok=False, timeout=400)
    text, last = out(p), tmp_path / "runs" / "run" / "weights" / "last.pt"
    assert time.time() - t0 < 400 and "cannot read image (No such file or directory)" in text, text[-3000:]
    said = f"the last optimizer step every rank's batches were read for: once the file can be read again, " \
           f"python train.py --resume {last} continues from it"
    ranks = [line for line in text.splitlines() if said in line and "ERROR: " in line]
    assert any(line.startswith("ERROR: ") for line in ranks), text[-3000:]
    assert any(line.startswith("[rank 1] ERROR: ") for line in ranks), text[-3000:]  # rank 1's own line
    assert "exitcode  : 1" in text
    no_traceback(text, torchrun=True)
    assert load(last)["epoch"] == EPOCHS - 2 and 0 < load(last)["batches_done"] < 8
    images.with_name("train.gone").rename(images)
    p = run([*torchrun, VANISH, "--vanish-at", f"{EPOCHS}:0:half", images, "--resume", last], ok=False, timeout=400)
    ranks = [line for line in out(p).splitlines() if "cannot read image (No such file or directory)" in line]
    assert any(line.startswith("ERROR: ") for line in ranks), out(p)[-3000:]
    assert any(line.startswith("[rank 1] ERROR: ") for line in ranks), out(p)[-3000:]
    assert f"{last} (the checkpoint this run resumed from) stays the checkpoint to resume" in out(p)
    assert any(f"at epoch {EPOCHS}, batch 6, after the scan" in line for line in ranks)  # a rank's first batch
    no_traceback(out(p), torchrun=True)
    assert load(last)["epoch"] == EPOCHS - 2
    for path in images.with_name("train.gone").iterdir():
        path.rename(images / path.name)
    run([*torchrun, "train.py", "--resume", last], timeout=400)
    assert load(last)["epoch"] == EPOCHS - 1


@pytest.mark.slow
@pytest.mark.dist
def test_full_disk_under_torchrun_stops_every_rank_with_the_line(data, reference_run, tmp_path):
    """Two ranks, a tmpfs that holds epoch 1's last.pt but not its best.pt: rank 0's refused write reaches rank 1
    at the epoch's end agreement; both exit 1 with the same line, which names that last.pt as written and good."""
    size = reference_run(*FLAGS, data=data).last.stat().st_size
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", f"size={int(1.5 * size)}") as small:
        p = run_train(LAUNCHERS["2-process"], data, small, "run", *FLAGS, ok=False, timeout=400)
        weights = small / "run" / "weights"
        text = out(p)
        line = f"{weights / 'best.pt'}: cannot be written: no space left on the device (ENOSPC)"
        assert f"ERROR: {line}" in text and f"[rank 1] ERROR: {line}" in text, text[-3000:]  # each rank's own
        assert f"{weights / 'last.pt'} of epoch 1 was written and is good" in text and "exitcode  : 1" in text
        no_traceback(text, torchrun=True)
        assert temp_files(weights) == [] and load(weights / "last.pt")["epoch"] == 0
