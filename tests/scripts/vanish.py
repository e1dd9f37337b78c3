"""Test helper: train.py whose rank 0 moves the train split's images away, as a shared filesystem being cleaned
does: the folder ``FOLDER`` renamed to ``FOLDER.gone``, or with ``:half`` every other file of it moved into
``FOLDER.gone``. BATCH 0: when training starts (after the scan); else once batch BATCH of epoch EPOCH (1-based)
has trained. On the job's first attempt only.

usage: vanish.py --vanish-at EPOCH:BATCH[:half] FOLDER TRAIN_ARGS...
"""
import os
import sys
from pathlib import Path

from yolotrain.app import train
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import run_entry_point

epoch, batch, *mode = sys.argv[2].split(":")
epoch, batch = int(epoch), int(batch)
folder = Path(sys.argv[3])
gone = folder.with_name(folder.name + ".gone")


def vanish_now() -> None:
    if mode == ["half"]:
        gone.mkdir(exist_ok=True)
        for path in sorted(folder.iterdir())[::2]:
            path.rename(gone / path.name)
    elif folder.exists():
        folder.rename(gone)


def vanish(event) -> None:
    if (event.epoch + 1, event.batch) == (epoch, batch):
        vanish_now()


callbacks = Callbacks()
if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
    callbacks.add("on_train_start" if batch == 0 else "on_train_batch_end",
                  (lambda event: vanish_now()) if batch == 0 else vanish)
sys.exit(run_entry_point(lambda: train.main(train.parse_opt(sys.argv[4:]), callbacks)))
