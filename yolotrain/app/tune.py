#!/usr/bin/env python
"""Search hyperparameters with Optuna: each trial is a training run, any number of workers share one study.

    python tune.py --data my.yaml --cfg models/yolov5s.yaml --epochs 30 --trials 100 --storage sqlite:///s.db --study s1
    torchrun --nproc_per_node 8 tune.py ...           # one worker whose trials each train on 8 GPUs

Every flag that is not tune.py's own is train.py's and is passed to each trial (--hyp gives the base hyp the
search space's values are written over). Run the same command on more machines against one database to add
workers; run it again to continue the study. The story: yolotrain/app/search (docs/tuning.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.cli import ArgumentParser, Range, tool_command
from yolotrain.utils.core.errors import run_entry_point
from yolotrain.utils.core.fileio import RUNS
from yolotrain.app import train
from yolotrain.app.search import SearchOptions, Trainer, tune
from yolotrain.app.search.study import PRUNERS


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.splitlines()[1], allow_abbrev=False,
                       epilog=f"Any other flag is train's ({tool_command('train')} --help), given to every trial.")
    p.add_argument("--trials", type=Range(int, min=1), default=20,
                   help="the study's total of finished (complete or pruned) trials, counting every worker's")
    p.add_argument("--study", default="study", help="study name: workers with the same name and storage share it")
    p.add_argument("--storage", default=None,
                   help="Optuna storage URL: sqlite:///study.db, postgresql+psycopg://user:pw@host/db, mysql+pymysql://"
                        "..., or journal:path/to/study.log (default: sqlite <project>/<study>/study.db)")
    p.add_argument("--space", default=None,
                   help="search space yaml (default: hyps/tune-space.yaml for anchor heads, hyps/tune-space.v8.yaml "
                        "for anchor-free ones)")
    p.add_argument("--pruner", default="median", choices=PRUNERS,
                   help="stop hopeless trials early from their per-epoch fitness: median (below the median of earlier "
                        "trials at the same epoch), hyperband, none")
    p.add_argument("--pruner-startup", type=Range(int, min=0), default=5,
                   help="median pruner: complete trials before any trial is pruned")
    p.add_argument("--pruner-warmup", type=Range(int, min=0), default=0,
                   help="median pruner: first epochs of each trial that are never pruned")
    p.add_argument("--heartbeat", type=Range(int, min=1), default=60,
                   help="seconds between a running trial's heartbeats in a database storage; a trial silent for "
                        "twice this (+1 s) is marked FAILED and enqueued again with its parameters")
    p.add_argument("--retries", type=Range(int, min=0), default=3,
                   help="how many times a trial whose worker died is enqueued again")
    p.add_argument("--project", default=str(RUNS / "tune"),
                   help="the study's folder is <project>/<study>: trial_<number> run folders and the results")
    return p


def parse_opt(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """tune.py's own flags, and the rest for train.py."""
    return build_parser().parse_known_args(argv)


def main(opt: argparse.Namespace, train_argv: list[str], callbacks: Callbacks | None = None) -> Path:
    """This worker's share of the study and its results; returns the study's folder (``YOLO.tune`` calls it)."""
    return tune(SearchOptions(**vars(opt)), train_argv, Trainer(train.build_parser, train.main), callbacks)


def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(*parse_opt(argv)))


if __name__ == "__main__":
    sys.exit(cli())
