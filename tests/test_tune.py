"""tune.py on a real Optuna study in SQLite: trials are ordinary training runs, workers share the study through
its storage alone, a killed worker's trial is FAILED and retried, a hopeless trial is PRUNED, a torchrun job is
one worker whose ranks train each trial together, and the search space yaml is validated like a hyp file.
Trials are tiny (16 images, 64 px, 2 epochs)."""
from __future__ import annotations

import csv
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import PYTHON, ROOT, TORCHRUN, run_env
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.hyp import load_hyp
from yolotrain.utils.engine.recipe import RECIPES
from yolotrain.utils.weights.checkpoint import load_checkpoint
from yolotrain.app.search.resume import replay
from yolotrain.app.search.space import load_space
from yolotrain.app.search.study import retried_from
from yolotrain.app.search.worker import Reporter

optuna = pytest.importorskip("optuna")
TrialState = optuna.trial.TrialState

TRAIN = ["--cfg", "models/yolov5n.yaml", "--imgsz", "64", "--epochs", "1", "--batch-size", "4", "--val-batch-size",
         "4", "--workers", "0", "--noplots"]


@pytest.fixture(scope="module")
def data(tiny_data) -> Path:
    """The tiny set generated once, before workers in parallel read it."""
    from yolotrain.utils.data.config import load_data_config, prepare_dataset

    prepare_dataset(load_data_config(tiny_data))
    return tiny_data


def argv(data: Path, project: Path, study: str, trials: int, *extra: str) -> list[str]:
    return ["--data", str(data), *TRAIN, "--project", str(project), "--study", study, "--trials", str(trials),
            "--heartbeat", "1", *extra]


def worker(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "tune.py", *args], cwd=ROOT, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def trials(project: Path, study: str) -> list:
    storage = f"sqlite:///{(project / study / 'study.db').resolve()}"
    return optuna.load_study(study_name=study, storage=storage).get_trials()


def finished(ts: list) -> list:
    return [t for t in ts if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


@pytest.mark.slow
def test_one_worker_three_trials_and_results(data, tmp_path, one_thread):
    from yolotrain.app import tune

    assert tune.cli(argv(data, tmp_path, "one", 3)) == 0
    ts = trials(tmp_path, "one")
    assert [t.state for t in ts] == [TrialState.COMPLETE] * 3
    folder = tmp_path / "one"
    hyp = load_hyp(folder / "best_hyp.yaml")  # ready for --hyp
    best = max(ts, key=lambda t: t.value)
    assert all(getattr(hyp, k) == pytest.approx(v) for k, v in best.params.items())
    assert set(best.params) == set(load_space(RECIPES["anchor-based"].space))  # the anchor family's default space
    with open(folder / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["number"] for r in rows] == ["0", "1", "2"] and {r["state"] for r in rows} == {"COMPLETE"}
    assert [float(r["fitness"]) for r in rows] == pytest.approx([t.value for t in ts])
    for t in ts:  # each trial an ordinary run in its own folder, trained with its own hyp
        run = folder / f"trial_{t.number}"
        assert (run / "weights" / "last.pt").is_file()
        assert load_hyp(run / "tune_hyp.yaml").lr0 == pytest.approx(t.params["lr0"])
    assert (folder / "history.png").is_file()


@pytest.mark.slow
def test_two_workers_share_one_study(data, tmp_path):
    procs = [worker(argv(data, tmp_path, "two", 4)) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    ts = trials(tmp_path, "two")
    done = finished(ts)
    assert len(done) == 4 and len({t.number for t in done}) == 4
    assert all(t.user_attrs.get("surplus") for t in ts if t not in done)  # a lost race for the last place
    folders = [t.user_attrs["run_dir"] for t in done]
    assert len(set(folders)) == 4 and all((Path(f) / "weights" / "last.pt").is_file() for f in folders)


def twin_study(data: Path, project: Path, study: str) -> list[str]:
    """A study of two trials enqueued with the same lr0 (the only parameter), 2 epochs each: trial 0 is the one
    disturbed, trial 1 trains undisturbed and gives the figures its retry must repeat. Returns the command."""
    space = project / "space.yaml"
    space.write_text("lr0: {low: 1.0e-4, high: 0.1, log: true}\n")
    (project / study).mkdir(parents=True)
    created = optuna.create_study(study_name=study, storage=f"sqlite:///{(project / study / 'study.db').resolve()}",
                                  direction="maximize")
    for _ in range(2):
        created.enqueue_trial({"lr0": 0.01})
    return [*argv(data, project, study, 2, "--space", str(space)), "--epochs", "2"]


def wait_for(p: subprocess.Popen, path: Path) -> None:
    deadline = time.time() + 120
    while not path.is_file():
        assert p.poll() is None and time.time() < deadline, p.stdout.read()[-3000:]
        time.sleep(0.02)


def freeze_once_beating(p: subprocess.Popen, db: Path) -> None:
    """Stop the worker the moment its trial's first heartbeat is in the study database: the heartbeat thread
    records it asynchronously, so the worker is let run in millisecond steps until the row is there."""
    deadline = time.time() + 30
    while True:
        p.send_signal(signal.SIGSTOP)
        try:
            with sqlite3.connect(db, timeout=0.1) as con:  # frozen mid-commit, it holds the lock: not yet
                if con.execute("SELECT count(*) FROM trial_heartbeats").fetchone()[0]:
                    return
        except sqlite3.OperationalError:
            pass
        assert time.time() < deadline, "the trial never recorded a heartbeat"
        p.send_signal(signal.SIGCONT)
        time.sleep(0.002)


def rerun(args: list[str]) -> str:
    """The same command again, to its end; its log."""
    again = subprocess.run([PYTHON, "tune.py", *args], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                           timeout=300)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    return out


def assert_retry_continued(project: Path, study: str, out: str) -> None:
    """Trial 0 FAILED; its retry (trial 2) continued its last.pt and ends as the undisturbed twin (trial 1)."""
    assert "trial 2 (retrying trial 0)" in out and "continuing trial 0's run from its last.pt" in out, out[-3000:]
    assert f"Resuming {project / study / 'trial_2' / 'weights' / 'last.pt'} from epoch" in out, out[-3000:]
    ts = trials(project, study)
    assert [t.state for t in ts] == [TrialState.FAIL] + [TrialState.COMPLETE] * 2
    twin, retry = ts[1], ts[2]
    assert retried_from(retry) == 0 and retry.params == ts[0].params == twin.params
    assert retry.value == twin.value  # train.py's resume is exact on CPU
    assert list(retry.intermediate_values) == list(twin.intermediate_values) == [0, 1]  # each epoch once
    assert list(retry.intermediate_values.values()) == pytest.approx(list(twin.intermediate_values.values()),
                                                                     rel=1e-4)  # replayed from results.csv
    weights = [load_checkpoint(project / study / f"trial_{n}" / "weights" / "last.pt")["model"] for n in (1, 2)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    with open(project / study / "trial_2" / "results.csv", newline="") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["0", "1"]
    with open(project / study / "trials.csv", newline="") as f:
        table = {r["number"]: r for r in csv.DictReader(f)}
    assert table["0"]["state"] == "FAIL" and table["2"]["retried_from"] == "0"


@pytest.mark.slow
def test_killed_worker_trial_failed_retried_and_continued(data, tmp_path):
    args = twin_study(data, tmp_path, "kill")
    p = worker(args)
    wait_for(p, tmp_path / "kill" / "trial_0" / "weights" / "last.pt")  # its first epoch saved
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert trials(tmp_path, "kill")[0].state is TrialState.RUNNING  # killed mid-trial
    out = rerun(args)
    assert_retry_continued(tmp_path, "kill", out)


@pytest.mark.slow
def test_killed_before_its_first_save_the_retry_starts_again(data, tmp_path):
    args = argv(data, tmp_path, "kill0", 2)
    p = worker(args)
    wait_for(p, tmp_path / "kill0" / "trial_0" / "tune_hyp.yaml")
    freeze_once_beating(p, tmp_path / "kill0" / "study.db")  # the run is still building
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert trials(tmp_path, "kill0")[0].state is TrialState.RUNNING  # killed mid-trial
    assert not (tmp_path / "kill0" / "trial_0" / "weights" / "last.pt").exists()
    out = rerun(args)
    ts = trials(tmp_path, "kill0")
    assert [t.state for t in ts] == [TrialState.FAIL] + [TrialState.COMPLETE] * 2
    retry = [t for t in ts if retried_from(t) == 0]
    assert len(retry) == 1 and retry[0].params == ts[0].params and "continuing" not in out


@pytest.mark.slow
def test_preempted_worker_exits_75_and_its_trial_continues(data, tmp_path):
    args = twin_study(data, tmp_path, "term")
    p = worker(args)
    wait_for(p, tmp_path / "term" / "trial_0" / "opt.yaml")  # the run is built, its stop handler on
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 75, out[-3000:]
    assert (tmp_path / "term" / "trial_0" / "weights" / "last.pt").is_file()  # saved on the signal
    ts = trials(tmp_path, "term")
    assert [t.state for t in ts] == [TrialState.FAIL, TrialState.WAITING, TrialState.WAITING]
    assert retried_from(ts[2]) == 0
    out = rerun(args)
    assert_retry_continued(tmp_path, "term", out)


def add_high_scorer(study) -> None:
    """An earlier search's trial, added through Optuna's API: lr0 0.01, fitness 0.9 at epochs 0 and 1."""
    lr0 = optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)
    study.add_trial(optuna.trial.create_trial(params={"lr0": 0.01}, distributions={"lr0": lr0}, value=0.9,
                                              intermediate_values={0: 0.9, 1: 0.9}))


def hopeless_study(data: Path, project: Path) -> tuple[str, list[str]]:
    """The study 'prune' holding add_high_scorer's trial, and tune.py's flags for 2 trials of 2 tiny epochs with
    the median pruner after 1 complete trial: the second trial is pruned after its first epoch. Returns the
    storage URL and the flags."""
    space = project / "space.yaml"
    space.write_text("lr0: {low: 1.0e-4, high: 0.1, log: true}\n")
    storage = f"sqlite:///{project / 'prune.db'}"
    add_high_scorer(optuna.create_study(study_name="prune", storage=storage, direction="maximize"))
    return storage, ["--data", str(data), *TRAIN, "--epochs", "2", "--project", str(project), "--study", "prune",
                     "--trials", "2", "--storage", storage, "--space", str(space), "--pruner", "median",
                     "--pruner-startup", "1"]


def test_replay_reports_the_saved_epochs_and_may_prune(tmp_path):
    """A retry's epochs taken over go to its trial from results.csv: the saved epochs only (a row written after
    the last save is not the run's), each once; the median pruner may stop the retry there, before it trains."""
    rows = ["epoch,metrics/mAP_0.5,metrics/mAP_0.5:0.95,train/box_loss"] + [
        f"{e},{0.1 * (e + 1)},{0.05 * (e + 1)},1.5" for e in range(3)]
    (tmp_path / "results.csv").write_text("\n".join(rows) + "\n")
    saved = SimpleNamespace(epochs_done=2, args={"noval": False})
    heard = []
    assert replay(heard.append, saved, tmp_path / "results.csv") == 2
    assert [e.epoch for e in heard] == [0, 1] and [e.is_best for e in heard] == [True, True]
    assert [e.fitness for e in heard] == pytest.approx([0.055, 0.11])
    assert heard[1].row == {"metrics/mAP_0.5": 0.2, "metrics/mAP_0.5:0.95": 0.1, "train/box_loss": 1.5}
    assert replay(heard.append, SimpleNamespace(epochs_done=2, args={"noval": True}), tmp_path / "results.csv") == 2
    assert [e.fitness for e in heard[2:]] == [None, None]  # not validated: nothing for the pruner
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    add_high_scorer(study)
    reporter = Reporter(study.ask())
    assert replay(reporter, saved, tmp_path / "results.csv") == 1  # stopped where the pruner said
    assert "pruned after epoch 1" in reporter.pruned
    assert study.trials[1].intermediate_values == pytest.approx({0: 0.055})


@pytest.mark.slow
def test_median_pruner_prunes_a_hopeless_trial(data, tmp_path, one_thread):
    """An earlier search's trial (added through Optuna's API) scored 0.9 at every epoch; a 2-epoch tiny trial
    scores far less at its first epoch, so the median pruner stops it there."""
    from yolotrain.app import tune

    storage, args = hopeless_study(data, tmp_path)
    code = tune.cli(args)
    assert code == 0
    ts = optuna.load_study(study_name="prune", storage=storage).get_trials()
    assert [t.state for t in ts] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert list(ts[1].intermediate_values) == [0]  # stopped after its first epoch
    assert load_hyp(tmp_path / "prune" / "best_hyp.yaml").lr0 == pytest.approx(0.01)


TUNE_TORCHRUN = [*TORCHRUN, "tune.py"]


def torchrun(args: list[str]) -> str:
    """``torchrun --nproc_per_node 2 tune.py`` (gloo on CPU) to its end, every rank exiting 0 (a hang fails the
    test at the timeout); its log."""
    p = subprocess.run([*TUNE_TORCHRUN, *args], cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_worker_prunes_on_every_rank(data, tmp_path):
    """The pruner speaks on rank 0; both ranks stop after the same epoch and exit 0, and the trial ends PRUNED
    (as in test_median_pruner_prunes_a_hopeless_trial)."""
    storage, args = hopeless_study(data, tmp_path)
    out = torchrun(args)
    ts = optuna.load_study(study_name="prune", storage=storage).get_trials()
    assert [t.state for t in ts] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert list(ts[1].intermediate_values) == [0] and "trial 1 pruned after epoch 1" in out
    with open(tmp_path / "prune" / "trial_1" / "results.csv", newline="") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["0"]  # the run ended after that epoch


@pytest.mark.slow
@pytest.mark.dist
def test_preempted_torchrun_worker_exits_75_then_completes_the_study(data, tmp_path):
    """A torchrun job is one worker: rank 0 alone talks to the study, every rank trains each trial. SIGTERM to the
    job: both ranks save and exit 75, rank 0 alone enqueues the trial again; the same command then completes the
    study of 2 trials, each trained by both ranks, the retry continuing its last.pt as a single process's does."""
    args = twin_study(data, tmp_path, "term")
    p = subprocess.Popen([*TUNE_TORCHRUN, *args], cwd=ROOT, env=run_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for(p, tmp_path / "term" / "trial_0" / "opt.yaml")
    os.killpg(p.pid, signal.SIGTERM)  # a scheduler's stop: torchrun forwards it to its workers
    out = p.communicate(timeout=120)[0]
    assert p.returncode != 0 and out.count("exiting with code 75") == 2, out[-3000:]  # rank 0's and rank 1's
    ts = trials(tmp_path, "term")
    assert [t.state for t in ts] == [TrialState.FAIL, TrialState.WAITING, TrialState.WAITING]  # enqueued once
    assert retried_from(ts[2]) == 0
    out = torchrun(args)
    assert_retry_continued(tmp_path, "term", out)  # FAIL, then 2 COMPLETE: none trained twice
    assert out.count("Devices: CPU x 2 rank(s)") == 2  # each trial's start summary, from rank 0 alone
    for n in (1, 2):
        run = tmp_path / "term" / f"trial_{n}"
        assert trials(tmp_path, "term")[n].user_attrs["run_dir"] == str(run)
        assert load_checkpoint(run / "weights" / "last.pt")["world_size"] == 2  # trained by both ranks


def test_default_spaces_load():
    assert {"lr0", "obj", "box", "cls", "mosaic"} <= set(load_space(RECIPES["anchor-based"].space))
    assert {"lr0", "dfl", "box", "cls", "mosaic"} <= set(load_space(RECIPES["anchor-free"].space))
    assert load_space(RECIPES["anchor-based"].space)["lr0"].log and not load_space(RECIPES["anchor-based"].space)["momentum"].log


@pytest.mark.parametrize("text, words", [
    ("lr00: {low: 0.001, high: 0.1}\n", ["unknown hyperparameter 'lr00'", "Did you mean 'lr0'?"]),
    ("lr0: {low: 0.1, high: 0.01}\n", ["'lr0' needs low < high"]),
    ("lr0: {low: 0.0, high: 0.1, log: true}\n", ["'lr0' is log-scaled"]),
    ("lr0: {low: 0.001}\n", ["'lr0' needs high"]),
    ("lr0: {low: 0.001, hihg: 0.1}\n", ["unknown field 'hihg'", "Did you mean 'high'?"]),
    ("lr0: [0.001, 0.1]\n", ["'lr0' must be a mapping"]),
    ("lr0: {low: 0.001, high: .inf}\n", ["'lr0' high must be a finite number"]),
    ("lr0: {low: 0.001, high: 0.1, log: yes please}\n", ["'lr0' log must be true or false"]),
    ("anchors: {low: 2, high: 5}\n", ["unknown hyperparameter 'anchors'"]),
    ("{}\n", ["the search space is empty"]),
])
def test_space_refusals_name_file_and_key(tmp_path, text, words):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_space(path)
    assert str(path) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.slow  # a subprocess
def test_missing_optuna_is_one_line(data, tmp_path):
    code = "import sys; sys.modules['optuna'] = None; import tune; sys.exit(tune.cli(sys.argv[1:]))"
    p = subprocess.run([PYTHON, "-c", code, "--data", str(data), "--project", str(tmp_path)], cwd=ROOT,
                       env=run_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    lines = (p.stdout + p.stderr).strip().splitlines()
    assert lines == ["ERROR: tune.py needs the 'optuna' package: pip install -r requirements-tune.txt"]


def test_flags_tune_sets_itself_are_refused(data, tmp_path):
    from yolotrain.app import tune

    with pytest.raises(UserError, match="--name is set by tune.py"):
        tune.main(*tune.parse_opt(["--data", str(data), "--project", str(tmp_path), "--name", "x"]))


@pytest.mark.slow
def test_python_api_tune(data, tmp_path, one_thread):
    """YOLO.tune: tune.py's options and train.py's in one call; the added callbacks hear every trial."""
    from yolotrain import YOLO

    heard = []
    model = YOLO("yolov5n.yaml")
    model.add_callback("on_fit_epoch_end", lambda e: heard.append(e.save_dir.name))
    folder = model.tune(data=str(data), imgsz=64, epochs=1, batch=4, val_batch_size=4, workers=0, noplots=True,
                        trials=2, study="api", project=str(tmp_path), heartbeat=1)
    assert folder == tmp_path / "api" and (folder / "best_hyp.yaml").is_file()
    assert heard == ["trial_0", "trial_1"]
    with pytest.raises(UserError, match="unknown option 'trails'. Did you mean 'trials'?"):
        model.tune(data=str(data), trails=2)


@pytest.mark.slow
def test_train_evolve_writes_yolov5_files(data, tmp_path, one_thread):
    from yolotrain.app import train

    assert train.cli(["--data", str(data), *TRAIN, "--project", str(tmp_path), "--name", "ev", "--evolve", "2"]) == 0
    folder = tmp_path / "ev"
    lines = (folder / "evolve.csv").read_text().splitlines()
    header = [k.strip() for k in lines[0].split(",")]
    assert header[:4] == ["metrics/precision", "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95"]
    assert header[4:7] == ["val/box_loss", "val/obj_loss", "val/cls_loss"] and "lr0" in header and len(lines) == 3
    assert all(len(k) == 20 for k in lines[0].split(","))  # YOLOv5's %20s columns
    text = (folder / "hyp_evolve.yaml").read_text()
    assert text.startswith("# YOLOv5") and "# Last generation: 1" in text
    assert load_hyp(folder / "hyp_evolve.yaml").lr0 > 0
    study = optuna.load_study(study_name="ev", storage=f"sqlite:///{folder / 'study.db'}")
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE] * 2
