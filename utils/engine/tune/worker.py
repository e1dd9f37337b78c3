"""One tuning worker: it trains trials of the study until the study holds its total of finished ones.

Each trial is an ordinary training run of the engine (train.py's ``main``, handed in by tune.py since the
engine sits below the CLIs): its hyp file is the base hyp with the trial's values written over it, kept in
the trial's own run folder (``<project>/<study>/trial_<number>``), and the run reports its fitness each epoch
to the study so the pruner can stop it. Any number of workers, on any number of machines, share one study:
its storage hands out the trials and its heartbeat retries the trial of a worker that died; a retry continues
its predecessor's run from the last.pt it left (resume).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from utils.core.callbacks import CallbackError, Callbacks
from utils.core.errors import Preempted
from utils.core.fileio import atomic_write
from utils.core.hyp import load_hyp
from utils.core.logging import LOGGER
from utils.engine.tune.resume import continue_run, replay
from utils.engine.tune.space import Bounds, suggest
from utils.engine.tune.study import RETRY_OF, StudySettings, fail_stale, has_heartbeat, log_tally, open_study, \
    retried_from, surplus, tally

try:  # optional (requirements-tune.txt): tune.py says what to install when it is missing
    import optuna
except ModuleNotFoundError:
    optuna = None

TRIAL_HYP = "tune_hyp.yaml"  # the trial's hyp, in its run folder, given to train.py as --hyp


class Surplus(Exception):
    """The study filled up while this worker asked: the trial is given back (FAILED, user attr 'surplus')."""


@dataclass(frozen=True)
class Job:
    """What every trial of this worker trains with."""

    settings: StudySettings
    folder: Path  # <project>/<study>: the trials' run folders and the results
    train_argv: list[str]  # train.py's flags, passed through
    base_hyp: Path  # the hyp the space's values are written over
    space: dict[str, Bounds]
    train_main: Callable[[argparse.Namespace, Callbacks], Any]  # train.main
    train_parser: Callable[[], argparse.ArgumentParser]  # train.build_parser
    callbacks: Callbacks | None = None  # the Python API's, for every trial after the study's own


def run_worker(job: Job) -> Any:
    """Train trials until the study holds ``settings.trials`` finished ones; returns the study."""
    study = open_study(job.settings)
    total = job.settings.trials
    waiting = False
    while True:
        fail_stale(study)  # a dead worker's trial: FAILED, and enqueued again with its parameters
        n = tally(study)
        if n.finished >= total:
            break
        if n.finished + n.running >= total:  # the rest are running elsewhere: wait, one may die and be retried
            if not has_heartbeat(job.settings):
                LOGGER.info("the study's remaining trials run on other workers; this worker is done")
                break
            if not waiting:
                LOGGER.info(f"{n.running} trial(s) running on other workers; waiting for them to finish or fail")
            waiting = True
            time.sleep(job.settings.heartbeat)
            continue
        waiting = False
        study.optimize(lambda trial: objective(job, study, trial), n_trials=1, catch=(Surplus,))
    log_tally(study, total)
    return study


def objective(job: Job, study: Any, trial: Any) -> float:
    """Train one trial; its fitness (0.1 mAP50 + 0.9 mAP50-95, best epoch) is the value."""
    if surplus(study, trial.number, job.settings.trials):
        trial.set_user_attr("surplus", True)
        LOGGER.info(f"trial {trial.number}: another worker took the study's last place; given back untrained")
        raise Surplus(f"trial {trial.number}: the study holds its {job.settings.trials} trials")
    values = suggest(trial, job.space)
    folder = job.folder / f"trial_{trial.number}"
    trial.set_user_attr("run_dir", str(folder))
    hyp_file = write_trial_hyp(folder, job.base_hyp, values)
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    again = retried_from(frozen)
    saved = continue_run(job.folder / f"trial_{again}", folder) if again is not None else None
    LOGGER.info(f"trial {trial.number}" + (f" (retrying trial {again})" if again is not None else "") +
                f": {folder}" + (f", continuing trial {again}'s run from its last.pt" if saved else ""))
    best = Reporter(trial)
    if saved:  # the epochs it holds, to the pruner and the trial's best, before the run goes on
        replay(best, saved, folder / "results.csv")
    run = ["--resume", str(saved.path)] if saved else ["--hyp", str(hyp_file), "--project", str(job.folder),
                                                        "--name", folder.name, "--exist-ok"]
    opt = job.train_parser().parse_args([*job.train_argv, *run])
    callbacks = Callbacks()
    callbacks.add("on_fit_epoch_end", best)
    try:
        result = job.train_main(opt, callbacks.merged(job.callbacks))
    except CallbackError as e:
        if optuna is not None and isinstance(e.__cause__, optuna.TrialPruned):
            raise e.__cause__ from None  # the pruner's decision, not an error: the trial ends PRUNED
        raise
    except Preempted:  # SIGTERM / SIGUSR1: this trial ends FAILED, its parameters wait for the next worker
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
        raise
    return float(result.metrics.get("fitness", best.value))


class Reporter:
    """on_fit_epoch_end: the epoch's fitness to the study, the best epoch's results.csv row as the trial's user
    attribute 'metrics'; raises TrialPruned when the pruner says so."""

    def __init__(self, trial: Any) -> None:
        self.trial, self.value = trial, 0.0

    def __call__(self, event: Any) -> None:
        if event.fitness is None:
            return
        if event.is_best:
            self.trial.set_user_attr("metrics", {k: float(v) for k, v in event.metrics.items()})
        self.value = max(self.value, float(event.fitness))
        self.trial.report(float(event.fitness), event.epoch)
        if self.trial.should_prune():
            why = f"trial {self.trial.number} pruned after epoch {event.epoch + 1}: fitness {event.fitness:.5f}"
            LOGGER.info(why)
            raise optuna.TrialPruned(why)


def write_trial_hyp(folder: Path, base: Path, values: dict[str, float]) -> Path:
    """The base hyp with the trial's values over it, in the trial's run folder."""
    folder.mkdir(parents=True, exist_ok=True)
    hyp = {**load_hyp(base).as_dict(), **values}
    path = folder / TRIAL_HYP
    with atomic_write(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(hyp, f, sort_keys=False)
    return path
