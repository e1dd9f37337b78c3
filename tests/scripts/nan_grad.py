"""Wraps train.py for tests/test_stop_conditions.py: at the listed backward calls (1-based, counted
per process) of the highest rank, the loss gets a term that is 0 in value but NaN in its gradient.
The optimizer step then writes NaN weights on every rank (DDP averages the gradient), and the next
batch's loss is NaN everywhere: a real divergence, for --nan-recover to roll back.

usage: nan_grad.py CALLS TRAIN_ARGS...   (CALLS: comma-separated, e.g. 3 or 3,9; 0: none)
With NAN_GRAD_USR1_AT=K in the environment the process also sends itself SIGUSR1 at backward call K.
"""
import os
import signal
import sys

import torch

from yolotrain.app import train
from yolotrain.utils.engine.step import Step

calls = {int(c) for c in sys.argv[1].split(",")}
real_backward = Step.backward
count = 0
usr1_at = int(os.environ.get("NAN_GRAD_USR1_AT", "0"))


def poisoned_backward(step, loss):
    global count
    count += 1
    if count == usr1_at:
        os.kill(os.getpid(), signal.SIGUSR1)
    if count in calls and step.info.rank == step.info.world_size - 1:
        p = next(q for q in step.model.parameters() if q.requires_grad)
        loss = loss + (p.sum() * 0).sqrt()  # value 0, gradient 0 * inf = NaN
    real_backward(step, loss)


Step.backward = poisoned_backward
sys.exit(train.cli(sys.argv[2:]))
