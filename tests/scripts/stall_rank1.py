"""torchrun helper for tests/test_watchdog.py: rank 1 stalls (sleeps, as if wedged) in the step of
the second optimizer step, after its backward pass and just before the step's all-reduce; rank 0 reaches that
all-reduce a few seconds later (as a slower rank would) and waits in it. The hang watchdog must end
both, each naming its own phase.

usage: stall_rank1.py TRAIN_ARGS...
"""
import sys
import time

from yolotrain.app import train
from yolotrain.utils.engine import step

LATE_S = 1.0  # rank 0's lag: its watchdog fires this much after rank 1's, within rank 1's grace

real_check_step = step.check_step
calls = 0


def stalling_check_step(window_bad, mloss, info, *args, **kwargs):
    global calls
    calls += 1
    if calls == 2:  # the second optimizer step of a fresh run
        time.sleep(3600 if info.rank == 1 else LATE_S)
    return real_check_step(window_bad, mloss, info, *args, **kwargs)


step.check_step = stalling_check_step
sys.exit(train.cli(sys.argv[1:]))
