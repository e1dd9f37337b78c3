"""torchrun helper for tests/test_dist.py: exercises torch_distributed_zero_first, object collectives and leaving
the process group (a DDP wrapper held in a reference cycle is collected).

usage: zero_first.py OUT_DIR MODE   (MODE: ok | fail)
"""
import contextlib
import sys
import time
import weakref
from pathlib import Path

import torch

from yolotrain.utils.core import dist
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import setup_logging

out, mode = Path(sys.argv[1]), sys.argv[2]
info = dist.dist_info()
setup_logging(info.rank, info.world_size)
group = contextlib.ExitStack()
group.enter_context(dist.process_group(info, torch.device("cpu")))
try:
    with dist.torch_distributed_zero_first(info.local_rank):
        if info.local_rank == 0:
            time.sleep(2)  # a slow scan: the other rank must wait, not race ahead
            if mode == "fail":
                raise UserError("data.yaml: simulated scan failure")
            (out / "made").write_text("by rank 0")
        # every rank reads what the local master made
        (out / f"read{info.rank}").write_text((out / "made").read_text())
    gathered = dist.all_gather_object(info.rank * 10)
    decided = dist.broadcast_object(f"decision from rank {info.rank}")
    (out / f"result{info.rank}").write_text(f"{gathered} {decided}")
    state = {"model": dist.smart_DDP(torch.nn.Linear(2, 2), torch.device("cpu"))}
    state["self"] = state  # a run's state in a reference cycle, holding a DDP wrapper
    wrapper = weakref.ref(state["model"])
    del state
except UserError as e:
    print(f"ERROR rank {info.rank}: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
finally:
    group.close()
(out / f"released{info.rank}").write_text(str(wrapper() is None))  # collected on leaving the group
