"""Test helper: run a training script with every torch.compile call given ``backend`` (e.g. aot_eager),
for tests that must finish where inductor's C++ compilation of the first steps takes minutes.

usage: compile_backend.py BACKEND SCRIPT SCRIPT_ARGS...   (SCRIPT: train.py or another helper)
"""
import functools
import runpy
import sys

import torch

backend, script = sys.argv[1], sys.argv[2]
torch.compile = functools.partial(torch.compile, backend=backend)  # nn.Module.compile calls torch.compile
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
