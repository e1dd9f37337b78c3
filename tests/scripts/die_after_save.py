"""Test helper: train.py whose global rank 0 dies (os._exit, like kill -9) right after writing a
last.pt for ``--die-at EPOCH:BATCH`` (where a resume starts, 1-based; BATCH 0: the checkpoint at the end of
the epoch before), on the job's first attempt only, so a
restart by torchrun --max-restarts or a later --resume runs clean.

usage: die_after_save.py --die-at 2:3 TRAIN_ARGS...
"""
import os
import sys

from yolotrain.app import train
from yolotrain.utils.engine import hooks

die_epoch, die_batch = (int(v) for v in sys.argv[2].split(":"))
real_save = hooks.save_checkpoint  # every checkpoint write goes through the Checkpointer


def save_then_die(ckpt, path):
    real_save(ckpt, path)
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    if first_attempt and int(os.environ.get("RANK", 0)) == 0 and (ckpt["epoch"] + 2, ckpt.get("batches_done", 0)) == (die_epoch, die_batch):
        os._exit(137)


hooks.save_checkpoint = save_then_die
sys.exit(train.cli(sys.argv[3:]))
