#!/usr/bin/env python
"""Train a YOLO detector on a YOLO-format dataset, on one CPU or many GPUs.

The tool is yolotrain/app/train.py (also `python -m yolotrain train`); this file only runs it.
"""
import sys

from yolotrain.app.train import cli

if __name__ == "__main__":
    sys.exit(cli())
