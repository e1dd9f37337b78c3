#!/usr/bin/env python
"""Search hyperparameters with Optuna: each trial is a training run, any number of workers share one study.

The tool is yolotrain/app/tune.py (also `python -m yolotrain tune`); this file only runs it.
"""
import sys

from yolotrain.app.tune import cli

if __name__ == "__main__":
    sys.exit(cli())
