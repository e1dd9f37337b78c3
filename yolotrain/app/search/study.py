"""The study in its storage, the only thing workers share: opening it, and deciding from its trial table
whether this worker trains another trial.

Storage URLs: ``sqlite:///study.db``, ``postgresql+psycopg://user:pw@host/db``, ``mysql+pymysql://...`` (Optuna's
RDBStorage, with a heartbeat: a trial whose worker stopped beating for the grace period is marked FAILED and
enqueued again with the same parameters), or ``journal:path/to/study.log`` (Optuna's journal file, for a
shared filesystem; it has no heartbeat, so a killed worker's trial stays RUNNING).
"""
from __future__ import annotations

import inspect
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER

try:  # optional (requirements-tune.txt): tune.py says what to install when it is missing
    import optuna
    from optuna.storages import RDBStorage
    from optuna.storages.journal import JournalFileBackend, JournalStorage
    from optuna.trial import TrialState
    try:
        from optuna.storages import RetryHeartbeatStaleTrialCallback as RetryCallback  # Optuna >= 4.9
    except ImportError:
        from optuna.storages import RetryFailedTrialCallback as RetryCallback
except ModuleNotFoundError:
    optuna = None

JOURNAL = "journal:"
RETRY_OF = "retry_of"  # user attribute of a preempted trial's retry: the preempted trial's number
PRUNERS = ("median", "hyperband", "none")


@dataclass(frozen=True)
class StudySettings:
    storage: str  # URL
    name: str
    trials: int  # the study's total of finished (complete or pruned) trials
    pruner: str = "median"
    startup: int = 5  # median: complete trials before any is pruned
    warmup: int = 0  # median: epochs of each trial never pruned
    epochs: int = 1  # the trials' length, Hyperband's largest resource
    heartbeat: int = 60  # seconds between a running trial's beats (RDB storages)
    retries: int = 3  # retries of a trial whose worker died
    sampler: str = "tpe"  # tpe (tune.py) or genetic (train.py --evolve: NSGA-II on one objective)


def open_study(s: StudySettings) -> Any:
    """The study, created by the first worker and loaded by the others (maximizing fitness)."""
    optuna.logging.set_verbosity(logging.ERROR)  # the worker logs its own lines; a failed trial's error propagates
    storage = _storage(s)
    sampler = optuna.samplers.NSGAIISampler() if s.sampler == "genetic" else None  # None: Optuna's TPE
    return optuna.create_study(storage=storage, study_name=s.name, direction="maximize", load_if_exists=True,
                               pruner=_pruner(s), sampler=sampler)


def _storage(s: StudySettings) -> Any:
    if s.storage.startswith(JOURNAL):
        return JournalStorage(JournalFileBackend(s.storage[len(JOURNAL):]))
    if "://" not in s.storage:
        raise UserError(f"--storage {s.storage!r}: give a database URL (sqlite:///study.db, "
                        f"postgresql+psycopg://user:pw@host/db) or journal:path/to/study.log")
    for attempt in range(3):
        try:
            return _rdb_storage(s)
        except (ImportError, ValueError) as e:
            raise UserError(f"--storage {s.storage!r}: {e}") from e
        except Exception as e:  # sqlalchemy's OperationalError and kin: a server not there, a bad password
            if attempt < 2:  # or workers started together, both creating the tables: the second try finds them
                time.sleep(1 + attempt)
                continue
            raise UserError(f"--storage {s.storage!r}: cannot open it: {type(e).__name__}: {e}") from e


def _rdb_storage(s: StudySettings) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeat, retry callback
        return RDBStorage(s.storage, heartbeat_interval=s.heartbeat, grace_period=2 * s.heartbeat + 1,
                          **{_STALE_CALLBACK: RetryCallback(max_retry=s.retries)})


# Optuna 4.9 renamed failed_trial_callback and RetryFailedTrialCallback (the old names warn until 6.0)
_STALE_CALLBACK = ("heartbeat_stale_trial_callback" if optuna and "heartbeat_stale_trial_callback" in
                   inspect.signature(RDBStorage).parameters else "failed_trial_callback")


def _pruner(s: StudySettings) -> Any:
    if s.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=s.startup, n_warmup_steps=s.warmup)
    if s.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(s.epochs, 1))
    return optuna.pruners.NopPruner()


def has_heartbeat(s: StudySettings) -> bool:
    """Database storages beat; a journal file does not."""
    return not s.storage.startswith(JOURNAL)


def fail_stale(study: Any) -> None:
    """Mark trials whose worker stopped beating FAILED; the retry callback enqueues each again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)  # nothing where the storage has no heartbeat


@dataclass(frozen=True)
class Tally:
    finished: int  # complete + pruned
    running: int
    failed: int


def tally(study: Any) -> Tally:
    states = [t.state for t in study.get_trials(deepcopy=False)]
    return Tally(finished=sum(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states),
                 running=sum(s is TrialState.RUNNING for s in states),
                 failed=sum(s is TrialState.FAIL for s in states))


def surplus(study: Any, number: int, total: int) -> bool:
    """Whether trial ``number`` is one too many: more than ``total`` trials that finished or run have a number up
    to it. Trial numbers are handed out by the storage one by one, so when workers race for the last place, the
    lower number wins and every worker agrees."""
    alive = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(t.state in alive and t.number <= number for t in study.get_trials(deepcopy=False)) > total


def retried_from(trial: Any) -> int | None:
    """The number of the failed trial that this one retries, its immediate predecessor: a dead worker's (the
    heartbeat's retry; the last of the retry history its callback records, where ``retried_trial_number`` gives
    the first) or a preempted one's (user attribute ``retry_of``); None for a fresh trial. A heartbeat retry
    carries its predecessor's user attributes, so its history is read first."""
    history = trial.system_attrs.get("retry_history")
    return history[-1] if history else trial.user_attrs.get(RETRY_OF)


def log_tally(study: Any, total: int) -> None:
    n = tally(study)
    LOGGER.info(f"study '{study.study_name}': {n.finished}/{total} finished, {n.running} running, {n.failed} failed")
