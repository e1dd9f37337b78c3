"""One tuning worker: it trains trials of the study until the study holds its total of finished ones.

Each trial is an ordinary training run (train.py's ``main``, handed in as a ``Trainer`` by the tool that runs the
search: this package sits below app/train.py, whose --evolve imports it): its hyp file is the base hyp with the trial's values written over it, kept in
the trial's own run folder (``<project>/<study>/trial_<number>``), and the run reports its fitness each epoch
to the study so the pruner can stop it. Any number of workers, on any number of machines, share one study:
its storage hands out the trials and its heartbeat retries the trial of a worker that died; a retry continues
its predecessor's run from the last.pt it left (resume).

A worker may be a torchrun job: then rank 0 alone talks to the study, and hands every rank its word once per
turn of its loop (an ``Order``: train these flags, wait, or leave); every rank trains each trial together, on
the process group the worker holds. The pruner's decision reaches every rank as a requested stop
(``TrainEvent.request_stop``), taken by all at the same epoch's end.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from yolotrain.utils.core import dist
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import Preempted, UserError
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.hyp import load_hyp
from yolotrain.utils.core.logging import LOGGER
from yolotrain.app.search.resume import continue_run, replay
from yolotrain.app.search.space import Bounds, suggest
from yolotrain.app.search.study import RETRY_OF, StudySettings, fail_stale, has_heartbeat, log_tally, open_study, \
    retried_from, surplus, tally

try:  # optional (requirements-tune.txt): tune.py says what to install when it is missing
    import optuna
except ModuleNotFoundError:
    optuna = None

TRIAL_HYP = "tune_hyp.yaml"  # the trial's hyp, in its run folder, given to train.py as --hyp


class Surplus(Exception):
    """The study filled up while this worker asked: the trial is given back (FAILED, user attr 'surplus')."""


@dataclass(frozen=True)
class Trainer:
    """How a trial trains: train.py's parser and its main, in one typed entry point. The tool that runs the
    search hands it in (yolotrain/app/tune.py, or app/train.py's --evolve): this package sits below app/train,
    which imports it for --evolve, so it cannot import app/train itself."""

    build_parser: Callable[[], argparse.ArgumentParser]
    main: Callable[[argparse.Namespace, Callbacks | None], Any]

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """train.py's flags, with its checks."""
        return self.build_parser().parse_args(argv)

    def train(self, argv: list[str], callbacks: Callbacks | None) -> Any:
        return self.main(self.parse(argv), callbacks)


@dataclass(frozen=True)
class Job:
    """What every trial of this worker trains with."""

    settings: StudySettings
    folder: Path  # <project>/<study>: the trials' run folders and the results
    train_argv: list[str]  # train.py's flags, passed through
    base_hyp: Path  # the hyp the space's values are written over
    space: dict[str, Bounds]
    trainer: Trainer
    callbacks: Callbacks | None = None  # the Python API's, for every trial after the study's own


@dataclass(frozen=True)
class Order:
    """Rank 0's word to the other ranks of a torchrun worker, once per turn of its loop; neither field: wait."""

    argv: tuple[str, ...] | None = None  # train.py's flags of the trial every rank trains now
    done: bool = False  # the study holds its trials, or the rest run elsewhere: leave
    error: str | None = None  # rank 0 could not open the study: every rank stops with this message


def run_worker(job: Job) -> Any:
    """Train trials until the study holds ``settings.trials`` finished ones; returns the study (None on the
    other ranks of a torchrun worker, which train what rank 0 hands them)."""
    if not dist.dist_info().is_main:
        follow(job)
        return None
    try:
        study = open_study(job.settings)
    except UserError as e:
        dist.broadcast_object(Order(error=str(e)))
        raise
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
            dist.broadcast_object(Order())  # the other ranks wait with this one
            time.sleep(job.settings.heartbeat)
            continue
        waiting = False
        with preempted_together():
            study.optimize(lambda trial: objective(job, study, trial), n_trials=1, catch=(Surplus,))
    dist.broadcast_object(Order(done=True))
    log_tally(study, total)
    return study


def follow(job: Job) -> None:
    """The other ranks of a torchrun worker: train each trial rank 0 hands out, beside it, until it says done."""
    while True:
        order = dist.broadcast_object(None)
        if order.error is not None:
            raise UserError(order.error)
        if order.done:
            return
        if order.argv is not None:
            with preempted_together():
                job.trainer.train(list(order.argv), job.callbacks)


@contextmanager
def preempted_together() -> Iterator[None]:
    """A preempted trial's ranks leave once rank 0 has enqueued its retry and failed it: torchrun stops the job
    when its first rank exits, which must not cut rank 0's bookkeeping short."""
    try:
        yield
    except Preempted:
        dist.barrier()
        raise


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
    if best.pruned is None:  # the replay may have pruned it: then it trains no more
        run = ["--resume", str(saved.path)] if saved else ["--hyp", str(hyp_file), "--project", str(job.folder),
                                                            "--name", folder.name, "--exist-ok"]
        result = train_trial(job, study, trial, best, [*job.train_argv, *run])
        if best.pruned is None:
            return float(result.metrics.get("fitness", best.value))
    raise optuna.TrialPruned(best.pruned)  # the pruner's decision, not an error: the trial ends PRUNED


def train_trial(job: Job, study: Any, trial: Any, best: Reporter, argv: list[str]) -> Any:
    """Every rank trains the trial's run (the others hear ``argv`` from this one, rank 0); a preempted trial's
    parameters are enqueued again for the next worker, and it ends FAILED."""
    opt = job.trainer.parse(argv)
    callbacks = Callbacks()
    callbacks.add("on_fit_epoch_end", best)
    dist.broadcast_object(Order(argv=tuple(argv)))
    try:
        return job.trainer.main(opt, callbacks.merged(job.callbacks))
    except Preempted:  # SIGTERM / SIGUSR1: its parameters wait for the next worker
        study.enqueue_trial(trial.params, user_attrs={RETRY_OF: trial.number})
        raise


class Reporter:
    """on_fit_epoch_end: the epoch's fitness to the study, the best epoch's results.csv row as the trial's user
    attribute 'metrics'; when the pruner says so, ``pruned`` holds why and the run is asked to stop after this
    epoch (``request_stop``: every rank of a torchrun worker stops together; rank 0's objective then ends
    the trial PRUNED)."""

    def __init__(self, trial: Any) -> None:
        self.trial, self.value = trial, 0.0
        self.pruned: str | None = None

    def __call__(self, event: Any) -> None:
        if event.fitness is None or self.pruned is not None:
            return
        if event.is_best:
            self.trial.set_user_attr("metrics", {k: float(v) for k, v in event.row.items()})  # evolve.csv's columns
        self.value = max(self.value, float(event.fitness))
        self.trial.report(float(event.fitness), event.epoch)
        if self.trial.should_prune():
            self.pruned = f"trial {self.trial.number} pruned after epoch {event.epoch + 1}: fitness {event.fitness:.5f}"
            LOGGER.info(self.pruned)
            event.request_stop(self.pruned)


def write_trial_hyp(folder: Path, base: Path, values: dict[str, float]) -> Path:
    """The base hyp with the trial's values over it, in the trial's run folder."""
    folder.mkdir(parents=True, exist_ok=True)
    hyp = {**load_hyp(base).as_dict(), **values}
    path = folder / TRIAL_HYP
    with atomic_write(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(hyp, f, sort_keys=False)
    return path
