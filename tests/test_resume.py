"""Exact resume: a run killed after an epoch and continued with --resume ends with the same bits as
an uninterrupted run, in one process and in two (torchrun, gloo)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (DIE_AFTER_SAVE, LAUNCHERS, NAN_GRAD, PYTHON, RESUME, RESUME_EPOCHS, ROOT, TORCHRUN, assert_same_run,
                           children, free_port, load, out, results_epochs, run, run_env, run_train, wait_until_gone)
from yolotrain.app import shards

pytestmark = pytest.mark.slow  # subprocess training runs: `pytest -m 'not slow'` skips them

EPOCHS = RESUME_EPOCHS
CRASH_RANK1 = str(ROOT / "tests" / "scripts" / "crash_rank1.py")


def _train_and_kill(launcher, data, project, name) -> str:
    """Start a run and stop it right after its first checkpoint: SIGKILL for one process, SIGTERM
    for torchrun (a polite stop: every rank agrees, rank 0 saves, all exit). Returns the resume
    log's "from epoch ..." text for the checkpoint left behind."""
    proc = subprocess.Popen([*launcher, "train.py", "--data", str(data), "--project", str(project), "--name", name,
                             *RESUME], cwd=ROOT, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    last = project / name / "weights" / "last.pt"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not last.exists():
        time.sleep(0.02)
    # A job scheduler's SIGTERM: torchrun forwards it to its workers (which run in sessions of their
    # own, so a SIGKILL of the launcher alone would orphan them). One process gets SIGKILL.
    os.killpg(proc.pid, signal.SIGTERM if launcher == TORCHRUN else signal.SIGKILL)
    proc.wait()
    wait_until_gone(str(project / name))
    return _resumes_from(last)


def _resumes_from(last) -> str:
    """The resume log's "from epoch ..." text for an interrupted run's last.pt."""
    ckpt = load(last)
    epoch, done = ckpt["epoch"], ckpt.get("batches_done", 0)
    assert epoch < EPOCHS - 1 and "optimizer" in ckpt, "the run finished before it could be interrupted"
    return f"from epoch {epoch + 2}" + (f", batch {done + 1}" if done else "") + f" of {EPOCHS}"


def _resume(last, *extra, launcher=(PYTHON,), ok: bool | None = True) -> subprocess.CompletedProcess:
    return run([*launcher, "train.py", "--resume", last, *extra], ok=ok)


@pytest.fixture(scope="module")
def reference(reference_run):
    """``reference(kind)``: the final last.pt of the undisturbed run for that launcher (trained once per test run)."""
    return lambda kind: load(reference_run(*RESUME, launcher=kind).last)


def test_a_run_from_shards_killed_and_resumed_is_the_folder_run(tiny_data, tmp_path, reference):
    """SIGKILL after the first checkpoint of a run reading a shard index, then --resume: the same bits as the
    undisturbed run from the folder the shards were made from."""
    data = shards.main(shards.build_parser().parse_args([str(tiny_data), str(tmp_path / "shards")])) / "data.yaml"
    resumes_from = _train_and_kill([PYTHON], data, tmp_path, "cut")
    p = _resume(tmp_path / "cut" / "weights" / "last.pt")
    assert resumes_from in p.stdout and "(from the shard index)" in p.stdout
    assert_same_run(reference("1-process"), tmp_path / "cut" / "weights" / "last.pt")


def test_two_rank_resume_is_bit_identical(tiny_data, tmp_path, reference):
    """torchrun, stopped after its first checkpoint and resumed: the undisturbed run's bits (one process: the
    shard-index test above, and the mid-epoch one below)."""
    resumes_from = _train_and_kill(TORCHRUN, tiny_data, tmp_path, "cut")
    p = _resume(tmp_path / "cut" / "weights" / "last.pt", launcher=TORCHRUN)
    assert resumes_from in p.stdout
    assert_same_run(reference("2-process"), tmp_path / "cut" / "weights" / "last.pt")


def test_mid_epoch_checkpoint_resumes_exactly(tiny_data, tmp_path, reference):
    """--save-interval: killed right after a checkpoint inside epoch 2, the resumed run skips the
    batches done and ends bit-identical to the undisturbed run."""
    p = run_train([PYTHON], tiny_data, tmp_path, "cut", *RESUME, "--save-interval", "1e-9",
              script=(DIE_AFTER_SAVE, "--die-at", "2:2"), ok=None)
    assert p.returncode == 137, out(p)[-3000:]
    assert "at epoch 1, batch 1/4" in p.stdout and "at epoch 1, batch 3/4" in p.stdout  # after every step
    last = tmp_path / "cut" / "weights" / "last.pt"
    saved = load(last)
    assert (saved["epoch"], saved["batches_done"], len(saved["mloss"])) == (0, 2, 3)
    p = _resume(last)
    assert f"from epoch 2, batch 3 of {EPOCHS}" in p.stdout
    assert_same_run(reference("1-process"), last)
    assert results_epochs(tmp_path / "cut") == list(range(EPOCHS))


FORTY = ("path: shapes\ntrain: images/train\nval: images/val\nnames: {0: circle, 1: square}\n"
         "generate: shapes\ngenerate_args: {seed: 2, n_train: 40, n_val: 4, img_size: 96}\n")


@pytest.fixture(scope="module")
def forty_images(once) -> Path:
    """40 shapes images: batch 16 takes batches of 16, 16 and 8, batch 32 one of 32 and one of 8."""
    return once("forty", lambda folder: (folder / "forty.yaml").write_text(FORTY)) / "forty.yaml"


def test_a_large_batch_trains_as_batch_16_and_resumes_exactly(forty_images, tmp_path):
    """Batch 32 in a short run on one rank: each batch trains in optimizer steps of 16 images (the short last
    batch of 8 in one), the warmup ramping per step, so the run is bit-identical to one at batch 16 on the
    same images; killed after epoch 1's checkpoint and resumed, it still is, even when the resume asks for
    --micro-steps off (the saved choice stands). A fresh run with --micro-steps off takes one step a batch."""
    run_train([PYTHON], forty_images, tmp_path, "sixteen", *RESUME, "--batch-size", "16", "--epochs", "2")
    sixteen = load(tmp_path / "sixteen" / "weights" / "last.pt")
    p = run_train([PYTHON], forty_images, tmp_path, "cut", *RESUME, "--batch-size", "32", "--epochs", "2",
              script=(DIE_AFTER_SAVE, "--die-at", "2:0"), ok=None)
    assert p.returncode == 137, out(p)[-3000:]
    assert "2 optimizer steps per batch (a step per 16 images)" in p.stdout and "warmup 100 optimizer steps" in p.stdout
    last = tmp_path / "cut" / "weights" / "last.pt"
    cut = load(last)  # after one epoch: three AdamW steps, as batch 16's
    assert cut["optimizer_choice"]["steps_per_batch"] == 2
    assert {int(s["step"]) for s in cut["optimizer"]["state"].values()} == {3}
    p = _resume(last, "--micro-steps", "off", "--allow-changes")
    assert "from epoch 2 of 2" in p.stdout
    assert_same_run(sixteen, last, epochs=2)
    p = run_train([PYTHON], forty_images, tmp_path, "off", *RESUME, "--batch-size", "32", "--epochs", "1",
              "--micro-steps", "off")
    assert "a step every batch of 32 images (--micro-steps off; on: a step per 16 images)" in p.stdout
    assert load(tmp_path / "off" / "weights" / "last.pt")["optimizer_choice"]["steps_per_batch"] == 1


def test_other_layout_and_precision_resume_exactly_and_keep_their_settings(tiny_data, tmp_path, reference_run):
    """CPU trains NHWC by default, and in bf16 autocast where bf16 is native; NCHW and the other
    precision (fp32 on such a CPU, bf16 on any other) are exact on their own, and a resume given
    no flags keeps the layout and precision the run started with."""
    from yolotrain.utils.core.precision import cpu_has_native_bf16
    amp = not cpu_has_native_bf16()
    nchw = ("--no-channels-last", "--amp" if amp else "--no-amp")
    straight = reference_run(*RESUME, *nchw)
    assert ("NCHW, bfloat16 autocast (--amp)" if amp else "NCHW, fp32") in straight.output
    p = run_train([PYTHON], tiny_data, tmp_path, "cut", *RESUME, *nchw, "--save-interval", "1e-9",
              script=(DIE_AFTER_SAVE, "--die-at", "2:2"), ok=None)
    assert p.returncode == 137, out(p)[-3000:]
    last = tmp_path / "cut" / "weights" / "last.pt"
    _resume(last)
    resumed = load(last)
    assert resumed["args"]["channels_last"] is False and resumed["args"]["amp"] is amp
    assert_same_run(straight.last, resumed)


@pytest.fixture(scope="module")
def interrupted(tiny_data, once) -> Path:
    """A run killed after its first checkpoint (made once per test run; copied per test, since resuming changes
    it)."""
    return once("interrupted", lambda folder: _train_and_kill([PYTHON], tiny_data, folder, "cut")) / "cut"


def _copy_run(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst / "weights" / "last.pt"


def test_resume_refuses_math_changes_without_flag(interrupted, tmp_path):
    last = _copy_run(interrupted, tmp_path / "r")
    p = _resume(last, "--batch-size", "8", "--seed", "9", ok=False)
    assert p.returncode == 1
    assert "--batch-size 8 (run has 4)" in out(p) and "--seed 9 (run has 5)" in out(p) and "--allow-changes" in out(p)
    assert "Traceback" not in out(p)


def test_resume_allows_harmless_changes_and_says_so(interrupted, tmp_path):
    """A killed run resumed where it stopped, with a later end and fewer workers: it says what changed, finishes
    every epoch once (results.csv), strips the finished checkpoint, and a second resume has nothing to do."""
    last = _copy_run(interrupted, tmp_path / "r")
    resumes_from = _resumes_from(last)
    p = _resume(last, "--epochs", str(EPOCHS + 1), "--workers", "0")
    assert f"Resuming {last} {resumes_from.replace(f'of {EPOCHS}', f'of {EPOCHS + 1}')}" in p.stdout
    assert f"epochs: {EPOCHS} -> {EPOCHS + 1}" in p.stdout and "workers: 1 -> 0" in p.stdout
    final = load(last)
    assert final["epoch"] == EPOCHS and "optimizer" not in final
    assert results_epochs(tmp_path / "r") == list(range(EPOCHS + 1))
    p = _resume(last, ok=False)
    assert p.returncode == 1 and "nothing to resume" in out(p)


def test_resume_of_a_run_from_before_amp_keeps_fp32_on_cpu(interrupted, tmp_path):
    """Checkpoints written before --amp existed trained CPU runs in fp32; resuming one must not
    switch it to bf16 even where bf16 is native."""
    last = _copy_run(interrupted, tmp_path / "r")
    ckpt = load(last)
    del ckpt["args"]["amp"]
    torch.save(ckpt, last)
    p = _resume(last)
    assert ", fp32" in p.stdout and load(last)["args"]["amp"] is False


def test_resume_auto_starts_then_continues(tiny_data, tmp_path, interrupted):
    auto = ["--resume", "auto"]
    p = run_train([PYTHON], tiny_data, tmp_path, "job", *RESUME, "--epochs", "1", *auto)
    assert "no " in p.stdout and "yet; starting the run" in p.stdout
    assert (tmp_path / "job" / "weights" / "last.pt").is_file() and not (tmp_path / "job2").exists()
    resumes_from = _resumes_from(_copy_run(interrupted, tmp_path / "job2"))
    p = run_train([PYTHON], tiny_data, tmp_path, "job2", *RESUME, *auto)
    assert resumes_from in p.stdout


@pytest.mark.dist
@pytest.mark.parametrize("launcher", [[PYTHON], TORCHRUN], ids=["1-process", "2-process"])
def test_non_finite_loss_stops_every_rank_with_the_reason(tiny_data, tmp_path, launcher):
    hyp = tmp_path / "explode.yaml"
    text = (ROOT / "hyps" / "hyp.scratch-low.yaml").read_text().splitlines()
    hyp.write_text("\n".join(l for l in text if not l.startswith("warmup_bias_lr")) + "\nwarmup_bias_lr: 3.0e+38\n")
    p = run_train(launcher, tiny_data, tmp_path, "nan", *RESUME, "--hyp", hyp, "--optimizer", "SGD", ok=False)  # SGD: the hyp's bias warmup
    text = out(p)
    assert "the loss became NaN/inf on rank(s)" in text and "Lower lr0" in text
    if launcher == TORCHRUN:
        assert "[rank 1] ERROR: epoch" in text  # decided together: rank 1 stops with the same reason
    assert not any(f'File "{ROOT / name}' in text for name in ("train.py", "utils", "models"))


@pytest.mark.dist
def test_a_crash_on_one_rank_ends_the_job_promptly_naming_the_rank(tiny_data, tmp_path):
    t0 = time.time()
    p = run_train(TORCHRUN, tiny_data, tmp_path, "crash", *RESUME, script=(CRASH_RANK1,), ok=False, timeout=300)
    elapsed = time.time() - t0
    assert "simulated worker failure on rank 1" in out(p)  # the error, recorded by @record
    assert "rank      : 1" in out(p)  # torchrun's failure report names the rank
    assert elapsed < 60 + 30  # the run itself takes seconds; the failure must not wait for a timeout
    wait_until_gone(str(tmp_path / "crash"))
    assert load(tmp_path / "crash" / "weights" / "last.pt")["epoch"] == 0  # intact


@pytest.mark.dist
def test_elastic_restart_picks_up_its_own_last_pt(tiny_data, tmp_path):
    """torchrun --max-restarts 1 + --resume auto: the crashed attempt's last.pt is continued."""
    p = run_train([*TORCHRUN, "--max-restarts", "1"], tiny_data, tmp_path, "elastic", "--resume", "auto", *RESUME,
              script=(CRASH_RANK1,))
    assert "simulated worker failure on rank 1" in out(p) and "Resuming" in out(p) and "from epoch 2 of" in out(p)
    assert load(tmp_path / "elastic" / "weights" / "last.pt")["epoch"] == EPOCHS - 1
    assert results_epochs(tmp_path / "elastic") == list(range(EPOCHS))


def _workers_of(agent_pid: int) -> list[int]:
    """PIDs of the training processes torchrun's agent started (its direct children running train.py)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent_pid and b"train.py" in cmd:
            pids.append(int(pid))
    return pids


@pytest.mark.dist
def test_kill_9_of_a_worker_under_max_restarts_changes_nothing(tiny_data, tmp_path, reference):
    """torchrun --max-restarts: SIGKILL one worker from outside at a random moment after training
    started (checkpoints are written after every step, so often mid-write); the restarted job
    continues its own last.pt and ends with the undisturbed run's exact weights."""
    import random

    rng = random.Random(0)
    elastic = [*TORCHRUN, "--max-restarts", "2"]
    proc = subprocess.Popen([*elastic, "train.py", "--data", str(tiny_data), "--project", str(tmp_path), "--name",
                             "job", *RESUME, "--resume", "auto", "--exist-ok", "--save-interval", "1e-9"],
                            cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    last = tmp_path / "job" / "weights" / "last.pt"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not last.exists():
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 2.0))
    victims = _workers_of(proc.pid)
    assert victims, "no worker to kill: the run ended before the kill"
    os.kill(rng.choice(victims), signal.SIGKILL)
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, text[-4000:]
    assert "Resuming" in text, text[-4000:]  # the restart continued the killed attempt's checkpoint
    assert_same_run(reference("2-process"), load(last))
    assert results_epochs(tmp_path / "job") == list(range(EPOCHS))


def test_a_stop_agreed_in_an_epoch_s_last_step_saves_that_epoch_and_resumes_exactly(tiny_data, tmp_path, reference):
    """SIGUSR1 during the last batch of epoch 1 (backward 4 of 4): the step agrees to stop, the epoch ends as
    usual (validation, results row, checkpoint), the run exits 75 naming that epoch's end, and --resume starts
    epoch 2 and ends with the undisturbed run's bits."""
    p = run_train([PYTHON], tiny_data, tmp_path, "cut", *RESUME, script=(NAN_GRAD, "0"),
                  env=run_env(NAN_GRAD_USR1_AT="4"), ok=None)
    assert p.returncode == 75 and "at the end of epoch 1; exiting with code 75" in p.stdout, out(p)[-3000:]
    last = tmp_path / "cut" / "weights" / "last.pt"
    saved = load(last)
    assert (saved["epoch"], saved.get("batches_done", 0)) == (0, 0) and results_epochs(tmp_path / "cut") == [0]
    p = _resume(last)
    assert f"from epoch 2 of {EPOCHS}" in p.stdout
    assert_same_run(reference("1-process"), last)
    assert results_epochs(tmp_path / "cut") == list(range(EPOCHS))


@pytest.mark.dist
@pytest.mark.parametrize("kind, sig, target", [("1-process", signal.SIGTERM, "launcher"),
                                               ("2-process", signal.SIGUSR1, "one worker")])
def test_stop_signals_at_random_moments_lose_nothing(tiny_data, tmp_path, kind, sig, target, reference):
    """A scheduler's polite stop, at random moments until the run ends: each time every rank agrees at a
    step, rank 0 saves last.pt (mid-epoch, or at an epoch's end), all exit with code 75 (torchrun:
    its workers do), and the same command with --resume auto continues; the run ends bit-identical
    to an undisturbed one. With torchrun the signal goes to one worker only: the other rank learns
    of it through the step's all-reduce."""
    import random
    import threading

    rng = random.Random(f"{kind}-{sig}")
    cmd = [*LAUNCHERS[kind], "train.py", "--data", str(tiny_data), "--project", str(tmp_path), "--name", "job",
           *RESUME, "--resume", "auto"]
    run_dir, saved = tmp_path / "job", []
    for attempt in range(4):  # up to three stops, then the rest of the run
        proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        lines, training = [], threading.Event()

        def read(stream=proc.stdout, lines=lines, training=training):
            for line in stream:
                lines.append(line)
                if line.startswith(f"Training {EPOCHS} epochs"):  # the start summary's last line: the loop begins
                    training.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        if attempt < 3 and training.wait(timeout=120):
            time.sleep(rng.uniform(0, 0.5))
            if proc.poll() is None:
                os.kill(proc.pid if target == "launcher" else rng.choice(children(proc.pid)), sig)
        proc.wait(timeout=300)
        reader.join(timeout=60)
        text = "".join(lines)
        wait_until_gone(str(run_dir))
        if proc.returncode == 0:  # the rest of the run, or a signal that came after its last step
            break
        assert "exiting with code 75" in text, text[-3000:]
        assert (proc.returncode == 75) if kind == "1-process" else (proc.returncode != 0 and "75" in text), text[-3000:]
        # the marker a batch script tests to requeue, whatever exit code the launcher gave
        assert "exiting with code 75" in (run_dir / "PREEMPTED").read_text()
        ckpt = load(run_dir / "weights" / "last.pt")
        assert "optimizer" in ckpt  # a checkpoint to continue, not a finished run's
        saved.append((ckpt["epoch"], ckpt.get("batches_done", 0)))
    assert proc.returncode == 0, text[-3000:]
    assert not (run_dir / "PREEMPTED").exists()  # the run that continued removed it
    assert len(saved) >= 2 and any(done for _, done in saved), f"stops (epoch, batches done): {saved}"
    assert_same_run(reference(kind), load(run_dir / "weights" / "last.pt"))


@pytest.mark.dist
def test_slurm_warning_signal_to_one_srun_task_saves_and_resumes_exactly(tiny_data, tmp_path, reference):
    """``srun`` style (two plain processes with SLURM's variables, no torchrun): SLURM's USR1 reaches
    one task; both stop at the same step with exit code 75, and the requeued job ends bit-identical
    to an undisturbed 2-process run."""
    def launch(port: int) -> list[subprocess.Popen]:
        env = dict(run_env(), SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="127.0.0.1",
                   MASTER_PORT=str(port))
        return [subprocess.Popen([PYTHON, "train.py", "--data", str(tiny_data), "--project", str(tmp_path),
                                  "--name", "job", *RESUME, "--resume", "auto"], cwd=ROOT,
                                 env=dict(env, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for r in (0, 1)]

    procs = launch(free_port())
    first = procs[0].stdout.readline()
    while first and not first.startswith(f"Training {EPOCHS} epochs"):  # rank 0's start summary ends the set-up
        first = procs[0].stdout.readline()
    time.sleep(1.0)
    procs[1].send_signal(signal.SIGUSR1)
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [75, 75], outs[0][-3000:] + outs[1][-3000:]
    assert "SIGUSR1" in outs[1] and "exiting with code 75" in outs[0]
    ckpt = load(tmp_path / "job" / "weights" / "last.pt")
    assert "optimizer" in ckpt and ckpt["world_size"] == 2

    procs = launch(free_port())  # the requeued job
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "Resuming" in outs[0]
    assert_same_run(reference("2-process"), load(tmp_path / "job" / "weights" / "last.pt"))
