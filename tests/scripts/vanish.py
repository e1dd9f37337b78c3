"""Test helper: train.py whose rank 0 moves the train split's images folder away (``FOLDER`` renamed to
``FOLDER.gone``, as a shared filesystem being cleaned does) once batch BATCH of epoch EPOCH (1-based) has trained,
on the job's first attempt only.

usage: vanish.py --vanish-at EPOCH:BATCH FOLDER TRAIN_ARGS...
"""
import os
import sys
from pathlib import Path

from yolotrain.app import train
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import run_entry_point

epoch, batch = (int(v) for v in sys.argv[2].split(":"))
folder = Path(sys.argv[3])


def vanish(event) -> None:
    if (event.epoch + 1, event.batch) == (epoch, batch) and folder.exists():
        folder.rename(folder.with_name(folder.name + ".gone"))


callbacks = Callbacks()
if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
    callbacks.add("on_train_batch_end", vanish)
sys.exit(run_entry_point(lambda: train.main(train.parse_opt(sys.argv[4:]), callbacks)))
