"""torchrun helper for tests/test_engine_gpu.py: val.py whose rank 1 fails (a plain RuntimeError, as a CUDA
out-of-memory would) when its evaluation starts, while rank 0 scores its shard and waits to gather.

usage: crash_val_rank1.py VAL_ARGS...
"""
import os
import sys

from yolotrain.app import val

real_evaluate = val.evaluate_model


def failing_evaluate(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 1:
        raise RuntimeError("simulated out of memory on rank 1")
    return real_evaluate(*args, **kwargs)


val.evaluate_model = failing_evaluate
sys.exit(val.cli(sys.argv[1:]))
