#!/usr/bin/env python
"""Run a detector on images, folders, globs, .txt lists and videos; save annotated files and labels.

The tool is yolotrain/app/detect.py (also `python -m yolotrain detect`); this file only runs it.
"""
import sys

from yolotrain.app.detect import cli

if __name__ == "__main__":
    sys.exit(cli())
