"""torchrun helper for tests/test_resume.py: rank 1 raises a plain RuntimeError (a bug, not bad
input) in its second epoch while rank 0 carries on into the next collectives. Only on the job's
first attempt: a restart by torchrun --max-restarts (TORCHELASTIC_RESTART_COUNT > 0) runs clean.

usage: crash_rank1.py TRAIN_ARGS...
"""
import os
import sys

from yolotrain.app import train
from yolotrain.utils.engine import loop

real_epoch = loop.train_one_epoch


def failing_epoch(t, *args, **kwargs):
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
    if first_attempt and t.info.rank == 1 and t.state.epoch == 1:
        raise RuntimeError("simulated worker failure on rank 1")
    return real_epoch(t, *args, **kwargs)


loop.train_one_epoch = failing_epoch
sys.exit(train.cli(sys.argv[1:]))
