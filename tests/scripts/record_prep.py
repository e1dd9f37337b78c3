"""Test helper: train.py that appends one json line per dataset generation, label scan and
checkpoint write to LOG, with the process's node (GROUP_RANK), local rank and global rank.

usage: record_prep.py LOG TRAIN_ARGS...
"""
import json
import os
import sys

import yolotrain.utils.data.shapes
from yolotrain.app import train
import yolotrain.utils.data.labelcache
import yolotrain.utils.engine.hooks

log_file = sys.argv[1]


def _record(event: str, **extra) -> None:
    row = {"event": event, "node": int(os.environ.get("GROUP_RANK", 0)),
           "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "rank": int(os.environ.get("RANK", 0)), **extra}
    with open(log_file, "a") as f:
        f.write(json.dumps(row) + "\n")


def _wrap(event, fn, describe=lambda *a, **k: {}):
    def wrapped(*args, **kwargs):
        _record(event, **describe(*args, **kwargs))
        return fn(*args, **kwargs)
    return wrapped


yolotrain.utils.data.shapes._swap_in = _wrap("generate", yolotrain.utils.data.shapes._swap_in)  # called only when a dataset was generated
# load_or_scan looks scan_labels up in its own module
yolotrain.utils.data.labelcache.scan_labels = _wrap("scan", yolotrain.utils.data.labelcache.scan_labels,
                                          lambda files, *a, **k: {"n": len(files)})
yolotrain.utils.engine.hooks.save_checkpoint = _wrap("save", yolotrain.utils.engine.hooks.save_checkpoint, lambda ckpt, path: {"path": os.path.basename(path)})
sys.exit(train.cli(sys.argv[2:]))
