#!/usr/bin/env python
"""Export a checkpoint to ONNX and/or TorchScript, with its metadata, checked against the checkpoint.

The tool is yolotrain/app/export.py (also `python -m yolotrain export`); this file only runs it.
"""
import sys

from yolotrain.app.export import cli

if __name__ == "__main__":
    sys.exit(cli())
