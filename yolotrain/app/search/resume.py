"""A retried trial continues its predecessor's run instead of training from the start.

A trial whose worker died (kill -9, a lost node: the heartbeat's retry) or was preempted (SIGTERM / SIGUSR1,
exit 75) leaves its run folder behind, with the ``weights/last.pt`` its run last saved (each epoch's end, a
mid-epoch save on a stop signal or --save-interval). Its retry, a new trial with the same parameters, copies
that folder into its own and trains with ``--resume`` on the copy: the run goes on from the saved epoch and
batch exactly as the undisturbed run would have (train.py's resume is exact), and the predecessor's folder
stays as it was. Before training, the epochs the copy already holds are reported to the new trial from its
results.csv rows, so the pruner sees every epoch's fitness of the trial once and may stop it there.

A predecessor with no last.pt (killed before its first save), or one whose last.pt holds no training state
(the run had finished and stripped its optimizer), gives nothing to continue: the retry trains from the start.
"""
from __future__ import annotations

import csv
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.core.runs import ResultsCSV
from yolotrain.utils.engine.state import SavedRun

LAST = Path("weights") / "last.pt"


def saved_run(folder: Path) -> SavedRun | None:
    """``folder``'s last.pt when it can be resumed (it holds an optimizer); None otherwise."""
    last = folder / LAST
    if not last.is_file():
        return None
    try:
        return SavedRun.load(last)
    except UserError as e:  # a finished run (optimizer stripped), a truncated file
        LOGGER.info(f"{last}: not resumed ({e})")
        return None


def continue_run(predecessor: Path, folder: Path) -> SavedRun | None:
    """Copy the predecessor's run folder into ``folder`` when its last.pt can be resumed; returns the copy's
    saved run (None: nothing to continue, ``folder`` untouched)."""
    saved = saved_run(predecessor) if predecessor.resolve() != folder.resolve() else None
    if saved is None:
        return None
    shutil.copytree(predecessor, folder, dirs_exist_ok=True)
    return SavedRun(folder / LAST, saved.ckpt)


def replay(report: Callable[[Any], None], saved: SavedRun, results: Path) -> int:
    """Hand the epochs ``saved`` holds to ``report`` (the trial's on_fit_epoch_end listener) as the run would
    have: each epoch's results.csv row, its fitness (0.1 mAP50 + 0.9 mAP50-95, from the row's 5 significant
    digits) and whether it is the best so far; no fitness for epochs a --noval run did not validate. Returns
    the number of epochs handed over: ``report`` may ask to stop (``event.request_stop``, the pruner), and the
    replay ends at that epoch as the run would have."""
    rows = _rows(results, saved.epochs_done)
    map50, map50_95 = ResultsCSV.METRICS[2:]
    best, asked = 0.0, []
    for n, (epoch, row) in enumerate(rows, start=1):
        fitness = None if saved.args.get("noval") else 0.1 * row[map50] + 0.9 * row[map50_95]
        is_best = fitness is not None and fitness >= best
        best = max(best, fitness or 0.0)
        report(SimpleNamespace(epoch=epoch, fitness=fitness, is_best=is_best, row=row, request_stop=asked.append))
        if asked:
            return n
    return len(rows)


def _rows(results: Path, epochs: int) -> list[tuple[int, dict[str, float]]]:
    """results.csv's rows of the first ``epochs`` epochs (a row written after the last save is not the run's)."""
    if not results.is_file():
        return []
    with open(results, newline="") as f:
        out = {}
        for r in csv.DictReader(f):
            epoch = int(r.pop("epoch"))
            if epoch < epochs:
                out[epoch] = {k: float(v) for k, v in r.items()}
    return sorted(out.items())
