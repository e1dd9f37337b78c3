"""``train.py --evolve N``, YOLOv5's habit on Optuna: a local study of N trials drawn by a genetic sampler
(NSGA-II on the one objective), no pruning, in ``<project>/<name>`` (default runs/evolve/exp), with YOLOv5's
two files beside the study's own results: evolve.csv (metrics, val losses and every hyperparameter of each
trial) and hyp_evolve.yaml (the best trial's hyp, its generation and metrics in the header comments)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from yolotrain.utils.core.fileio import RUNS, atomic_write
from yolotrain.utils.core.hyp import load_hyp
from yolotrain.app.search import SearchOptions, Trainer, tune
from yolotrain.app.search.report import write_results

try:  # optional (requirements-tune.txt): tune.py says what to install when it is missing
    from optuna.trial import TrialState
except ModuleNotFoundError:
    TrialState = None

EVOLVE_PROJECT = RUNS / "evolve"
RUN_FLAGS = ("--project", "--name", "--exist-ok", "--evolve")  # the study's folder, set here


def evolve(train_opt: argparse.Namespace, train_argv: list[str], trainer: Trainer) -> Path:
    """Train ``--evolve`` trials in the local study ``<project>/<name>/study.db`` (a re-run continues it); the
    project is runs/evolve unless --project names another."""
    given = train_opt.project != trainer.build_parser().get_default("project")
    project = train_opt.project if given else str(EVOLVE_PROJECT)
    opt = SearchOptions(trials=train_opt.evolve, study=train_opt.name, storage=None, space=None, pruner="none",
                        pruner_startup=0, pruner_warmup=0, heartbeat=60, retries=3, project=project, sampler="genetic")
    return tune(opt, without_run_flags(train_argv), trainer, report=write_evolve)


def write_evolve(study: Any, folder: Path, base: Path) -> list[Path]:
    return [*write_results(study, folder, base), *write_yolov5_files(study, folder, base)]


def write_yolov5_files(study: Any, folder: Path, base: Path) -> list[Path]:
    """evolve.csv and hyp_evolve.yaml as YOLOv5 writes them (its column widths, its header comments)."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("metrics")]
    if not done:
        return []
    base_hyp = load_hyp(base).as_dict()
    names = [k for k in done[0].user_attrs["metrics"] if k.startswith(("metrics/", "val/"))]
    keys = names + list(base_hyp)
    rows = [[t.user_attrs["metrics"].get(k, 0.0) for k in names] + list({**base_hyp, **t.params}.values())
            for t in done]
    csv_path = folder / "evolve.csv"
    with atomic_write(csv_path, "w", encoding="utf-8") as f:
        f.write(("%20s," * len(keys) % tuple(keys)).rstrip(",") + "\n")
        for row in rows:
            f.write(("%20.5g," * len(row) % tuple(row)).rstrip(",") + "\n")
    best = max(range(len(done)), key=lambda i: done[i].value)
    hyp_path = folder / "hyp_evolve.yaml"
    with atomic_write(hyp_path, "w", encoding="utf-8") as f:
        f.write("# YOLOv5-style Hyperparameter Evolution Results (yolotrain, Optuna NSGA-II)\n"
                f"# Best generation: {best}\n# Last generation: {len(done) - 1}\n"
                "# " + ", ".join(f"{k.strip():>20s}" for k in names) + "\n"
                "# " + ", ".join(f"{v:>20.5g}" for v in rows[best][:len(names)]) + "\n\n")
        yaml.safe_dump({k: round(float(v), 5) for k, v in zip(keys[len(names):], rows[best][len(names):])}, f,
                       sort_keys=False)
    return [csv_path, hyp_path]


def without_run_flags(argv: list[str]) -> list[str]:
    """train.py's flags less those naming the run folder and --evolve (each with its value)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in RUN_FLAGS:
            takes = flag != "--exist-ok" and "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            skip = takes
            continue
        out.append(a)
    return out
