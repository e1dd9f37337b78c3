"""Test helper: train.py with one more stateful step part, a second EMA of the weights with a shorter horizon
(decay 0.99), checkpointed under its own key ``ema_slow``: the class below plus its line in the builder's list
(setup.STEP_EXTRAS), nothing in the run state or the Training context. With ``--die-at EPOCH:BATCH`` first,
global rank 0 dies right after that checkpoint, as tests/scripts/die_after_save.py does.

usage: slow_ema.py [--die-at 2:2] TRAIN_ARGS...
"""
import os
import sys

from torch import nn

from yolotrain.app import train
from yolotrain.utils.engine import hooks, setup
from yolotrain.utils.engine.optim import ModelEMA


class SlowEMA:
    """A second EMA (a StepExtra): updated after every optimizer step, saved and resumed with the run."""

    key = "ema_slow"

    def __init__(self, model: nn.Module) -> None:
        self.average = ModelEMA(model, decay=0.99, tau=20)

    def after_step(self, module: nn.Module) -> None:
        self.average.update(module)

    def state_dict(self) -> dict:
        return self.average.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.average.load_state_dict(state)


setup.STEP_EXTRAS.append(SlowEMA)
argv = sys.argv[1:]
if argv[:1] == ["--die-at"]:
    die_epoch, die_batch = (int(v) for v in argv[1].split(":"))
    argv, real_save = argv[2:], hooks.save_checkpoint

    def save_then_die(ckpt, path):
        real_save(ckpt, path)
        if int(os.environ.get("RANK", 0)) == 0 and (ckpt["epoch"] + 2, ckpt.get("batches_done", 0)) == (die_epoch,
                                                                                                       die_batch):
            os._exit(137)

    hooks.save_checkpoint = save_then_die
sys.exit(train.cli(argv))
