"""Test helper for tests/test_watchdog.py: train.py whose training loader worker stalls (sleeps, as
if wedged) on its third batch, so the main process waits for that batch.
It prints the worker's pid, so the test can check the worker does not outlive its rank.

usage: stall_worker.py TRAIN_ARGS...   (with --workers 1 --batch-size 4)
"""
import os
import sys
import time

import torch.utils.data

from yolotrain.app import train
from yolotrain.utils.data.dataset import LoadImagesAndLabels

real_getitems = LoadImagesAndLabels.__getitems__
batches = 0  # counted in the worker process: its own copy after the fork


def stalling_getitems(self, items):
    global batches
    if self.augment and torch.utils.data.get_worker_info() is not None:  # a training loader's worker
        batches += 1
        if batches == 3:
            print(f"stalling loader worker pid {os.getpid()}", file=sys.stderr, flush=True)
            time.sleep(3600)
    return real_getitems(self, items)


LoadImagesAndLabels.__getitems__ = stalling_getitems
sys.exit(train.cli(sys.argv[1:]))
