#!/usr/bin/env python
"""Score a detector on a YOLO-format split: P, R, mAP50 and COCO mAP50-95.

The tool is yolotrain/app/val.py (also `python -m yolotrain val`); this file only runs it.
"""
import sys

from yolotrain.app.val import cli

if __name__ == "__main__":
    sys.exit(cli())
