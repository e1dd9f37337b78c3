"""torchrun helper for tests/test_engine_gpu.py: before every in-training validation each rank hashes its EMA's
state, rank 0 gathers the hashes and appends them to EMA_HASHES (one json list per validation).
With EMA_NO_SYNC=1 the ranks' EMAs are not made rank 0's first (the control that shows they drift).

usage: ema_ranks.py TRAIN_ARGS...
"""
import hashlib
import json
import os
import sys

import torch

from yolotrain.app import train
from yolotrain.utils.core import dist
from yolotrain.utils.engine import loop
from yolotrain.utils.engine.optim import ModelEMA

real_evaluate = loop.evaluate_model


def hashing_evaluate(model, *args, **kwargs):
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    hashes = dist.all_gather_object(h.hexdigest())
    if int(os.environ.get("RANK", 0)) == 0:
        with open(os.environ["EMA_HASHES"], "a") as f:
            f.write(json.dumps(hashes) + "\n")
    return real_evaluate(model, *args, **kwargs)


loop.evaluate_model = hashing_evaluate
if os.environ.get("EMA_NO_SYNC") == "1":
    ModelEMA.sync_buffers = lambda self: None
sys.exit(train.cli(sys.argv[1:]))
