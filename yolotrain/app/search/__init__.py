"""Hyperparameter search on Optuna (tune.py and train.py --evolve, docs/tuning.md): the storage is the only coordination between
workers; each trial is an ordinary training run (on every rank of a torchrun worker, whose rank 0 alone talks
to the storage); a killed worker's trial is retried, never lost or doubled.

space (the search space yaml), study (storage, pruner, the trial table's tally), worker (the trial loop and the
objective), resume (a retried trial continuing its predecessor's run), report (best hyp, trials.csv, pictures).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yolotrain.utils.core import dist
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER, setup_logging
from yolotrain.utils.core.prologue import process_group
from yolotrain.utils.core.watchdog import Watchdog
from yolotrain.utils.engine.config import resolve_model, size_defaults
from yolotrain.app.search.report import write_results
from yolotrain.app.search.space import load_space
from yolotrain.app.search.study import StudySettings
from yolotrain.app.search.worker import Job, Trainer, run_worker

try:
    import optuna
except ModuleNotFoundError:
    optuna = None

OWNED = ("--project", "--name", "--exist-ok", "--resume")  # tune.py sets these for each trial


def require_optuna() -> None:
    if optuna is None:
        raise UserError("tune.py needs the 'optuna' package: pip install -r requirements-tune.txt")


@dataclass(frozen=True)
class SearchOptions:
    """One worker's study: tune.py's flags, or what train.py --evolve fixes (a genetic sampler, no pruning)."""

    trials: int
    study: str
    storage: str | None
    space: str | None
    pruner: str
    pruner_startup: int
    pruner_warmup: int
    heartbeat: int
    retries: int
    project: str
    sampler: str = "tpe"


def tune(opt: SearchOptions, train_argv: list[str], trainer: Trainer, callbacks: Callbacks | None = None,
         report: Callable[[Any, Path, Path], list[Path]] = write_results) -> Path:
    """Run this worker's share of the study, then write the results (``report(study, folder, base hyp)``);
    returns the study's folder. ``callbacks`` (the Python API's) hear every trial's events. The trials train
    through ``trainer``, train.py's parser and main, given by the tool that asked (worker.Trainer)."""
    require_optuna()
    info = dist.dist_info()
    setup_logging(info.rank, info.world_size)
    for flag in OWNED:
        if any(a == flag or a.startswith(flag + "=") for a in train_argv):
            raise UserError(f"tune.py: {flag} is set by tune.py for each trial (trials go to "
                            f"--project/<study>/trial_<number>)")
    train_opt = trainer.parse(train_argv)  # train.py's checks, before the study is touched
    folder = Path(opt.project) / opt.study
    folder.mkdir(parents=True, exist_ok=True)
    recipe = resolve_model(train_opt).recipe if not (train_opt.hyp and opt.space) else None  # the family's defaults
    base = Path(train_opt.hyp) if train_opt.hyp else recipe.hyp
    space_file = Path(opt.space) if opt.space else recipe.space
    epochs = size_defaults(vars(train_opt))["epochs"]  # each trial's: --epochs, else train.py's default for the data
    job = Job(settings=_settings(opt, folder, epochs), folder=folder, train_argv=_without_hyp(train_argv),
              base_hyp=base, space=load_space(space_file), trainer=trainer, callbacks=callbacks)
    LOGGER.info(f"tune: study '{opt.study}' in {job.settings.storage}, {opt.trials} trials, space {space_file}, "
                f"base hyp {base}, pruner {opt.pruner}")
    with worker_group(info, train_opt):
        study = run_worker(job)
    if study is not None:  # rank 0's (the only one under torchrun that talks to the study)
        for path in report(study, folder, base):
            LOGGER.info(f"wrote {path}")
    return folder


@contextmanager
def worker_group(info: dist.DistInfo, train_opt: argparse.Namespace) -> Iterator[None]:
    """A torchrun worker's process group, joined once and left at the end: every trial's train.main trains on it
    (its RunPrologue finds the group there and leaves it). Its collectives wait as long as a trial's would
    (the prologue's rule, with --hang-timeout's watchdog: not started, its limits only)."""
    if not info.distributed:
        yield
        return
    device = dist.select_device(train_opt.device, train_opt.batch_size, info)
    with process_group(info, device, Watchdog(info.rank, train_opt.hang_timeout * 60, peers=True)):
        yield


def _settings(opt: SearchOptions, folder: Path, epochs: int) -> StudySettings:
    storage = opt.storage or f"sqlite:///{(folder / 'study.db').resolve()}"
    return StudySettings(storage=storage, name=opt.study, trials=opt.trials, pruner=opt.pruner,
                         startup=opt.pruner_startup, warmup=opt.pruner_warmup, epochs=epochs,
                         heartbeat=opt.heartbeat, retries=opt.retries, sampler=opt.sampler)


def _without_hyp(argv: list[str]) -> list[str]:
    """train.py's flags less --hyp (the base hyp), which each trial replaces with its own."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--hyp":
            skip = True
        elif not a.startswith("--hyp="):
            out.append(a)
    return out
