"""Data-parallel training from Python: the ranks are started by torch's own elastic launcher (what
torchrun runs), each one ``python train.py`` (a checkout) or ``python -m yolotrain train`` (an installed package)
with the same arguments, so a run from the API is the torchrun run, its failures included. No script is written
anywhere.

Rank 0 hands its TrainResult back through a json file named in the ranks' environment
(utils/engine/state.RESULT_FILE_ENV); a rank's UserError reaches the launcher through torchelastic's
error file (utils/core/errors.run_entry_point) and is raised here with the same message.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from yolotrain.utils.core.errors import EXIT_PREEMPTED, Preempted, UserError
from yolotrain.utils.core.fileio import CHECKOUT, TOP
from yolotrain.utils.engine.state import RESULT_FILE_ENV, TrainResult

# what each rank runs: the checkout's script (found wherever the caller's sys.path came from), or the package's
TRAIN_ENTRY = (str(TOP / "train.py"),) if CHECKOUT else ("-m", "yolotrain", "train")


def launch_training(argv: list[str], nproc: int) -> TrainResult:
    """``torchrun --standalone --nproc_per_node nproc train.py *argv`` in-process (``-m yolotrain train`` when
    installed); returns rank 0's result."""
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"yolotrain-{uuid.uuid4()}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    with tempfile.TemporaryDirectory(prefix="yolotrain-result-") as tmp, _env(RESULT_FILE_ENV, str(Path(tmp) / "r.json")):
        try:
            elastic_launch(config, sys.executable)(*TRAIN_ENTRY, *argv)
        except ChildFailedError as e:
            raise _as_user_error(e) from None
        result = Path(tmp) / "r.json"
        if not result.exists():
            raise UserError(f"training ranks finished but rank 0 left no result in {result}")
        return TrainResult.from_dict(json.loads(result.read_text()))


def _as_user_error(e: ChildFailedError) -> Exception:
    """A rank's own message (UserError: exit 1, preemption: exit 75; run_entry_point writes it as a bare string) as
    the exception the in-process run would raise; a crash (torch's error record, a dict) stays torch's
    ChildFailedError, with every rank's exit code and traceback."""
    for failure in sorted(e.failures.values(), key=lambda f: f.timestamp):
        recorded = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
        if not isinstance(recorded, str) or not recorded or failure.error_file == "<N/A>":
            continue  # no record of ours: no error file, or torch's own (a dict with the traceback)
        if failure.exitcode == 1:
            return UserError(recorded)
        if failure.exitcode == EXIT_PREEMPTED:
            return Preempted(recorded)
    return e


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Set one variable for the ranks (they inherit this process's environment), then restore it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
