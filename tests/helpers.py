"""What the tests share: the repo root, how a tool runs (a subprocess, or its ``main`` in this process), the tiny
run's flags, and checks of a finished run.

A subprocess is for what only a process shows (an exit code, a signal, a kill, torchrun, what an import pulls in);
a test that reads a run's outputs calls the tool's ``main`` here instead (``train_here``, ``val_here``), which skips
a Python start and its torch import.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what pkgutil lists in the yolotrain package, in a checkout and installed: its library modules, nothing else
LIBRARY_MODULES = {"__main__", "app", "convert", "launch", "model", "models", "options", "results", "utils"}
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
LAUNCHERS = {"1-process": [PYTHON], "2-process": TORCHRUN}

# The tiny run: 64 px, batches of 4 (two per rank under torchrun), on conftest's tiny_data (16 train, 8 val images).
TINY = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0", "--seed", "3"]
# The resume runs: 4 epochs with a loader worker, so a kill, a stop or a checkpoint mid-run has room to land.
RESUME_EPOCHS = 4
RESUME = ["--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "1", "--seed", "5",
          "--epochs", str(RESUME_EPOCHS)]
DIE_AFTER_SAVE = str(ROOT / "tests" / "scripts" / "die_after_save.py")
NAN_GRAD = str(ROOT / "tests" / "scripts" / "nan_grad.py")


def run_env(**extra: str) -> dict:
    """Environment for subprocess runs: repo importable, one thread per process on the 2-core CI box."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    env.update(extra)
    return env


def run(cmd: Sequence[object], *, ok: bool | None = True, timeout: float = 600, env: dict | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repo root and capture its output; with ``ok`` it must exit 0 (the output's tail is the
    failure message), with ``ok=False`` it must not, with ``ok=None`` either is fine. A run still going after
    ``timeout`` seconds fails the test with the command and its last output."""
    import pytest

    try:
        p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or run_env(), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tails = [(x.decode(errors="replace") if isinstance(x, bytes) else x or "")[-2000:] for x in (e.stdout, e.stderr)]
        pytest.fail(f"still running after {timeout} s: {' '.join(map(str, cmd))}\n" + "\n".join(tails))
    if ok is not None:
        assert (p.returncode == 0) == ok, f"exit {p.returncode}\n" + p.stdout[-3000:] + p.stderr[-3000:]
    return p


def out(p: subprocess.CompletedProcess) -> str:
    """stdout and stderr of a finished run, in one string."""
    return p.stdout + p.stderr


def run_train(launcher: Sequence[str], data: Path, project: Path, name: str, *flags: object,
          script: Sequence[str] = ("train.py",), ok: bool | None = True, env: dict | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    """``launcher script --data D --project P --name N flags...``; flags come last, so they override earlier ones."""
    return run([*launcher, *script, "--data", data, "--project", project, "--name", name, *flags], ok=ok, env=env,
               timeout=timeout)


def train_here(*argv: object, callbacks=None):
    """train.py's ``main`` in this process (ask for the ``restore_logger`` fixture): its TrainResult."""
    from yolotrain.app import train as tool
    return tool.main(tool.parse_opt([str(a) for a in argv]), callbacks)


def val_here(*argv: object):
    """val.py's ``main`` in this process (ask for the ``restore_logger`` fixture): one EvalResult per weights."""
    from yolotrain.app import val as tool
    return tool.main(tool.build_parser().parse_args([str(a) for a in argv]))


@dataclass(frozen=True)
class Run:
    """A finished run made by conftest's ``reference_run``: its folder and what it printed (stdout, then stderr)."""
    dir: Path

    @property
    def last(self) -> Path:
        return self.dir / "weights" / "last.pt"

    @property
    def best(self) -> Path:
        return self.dir / "weights" / "best.pt"

    @property
    def output(self) -> str:
        return (self.dir.parent / "output.txt").read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_gone(marker: str, timeout: float = 60) -> None:
    """Block until no process has ``marker`` on its command line (a killed run's workers)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        alive.append(pid)
            except OSError:
                continue
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of {marker} still running after {timeout}s")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def load(path: Path) -> dict:
    """A checkpoint, read as users read them (weights_only)."""
    import torch
    return torch.load(path, weights_only=True)


def assert_same_run(a: dict | Path, b: dict | Path, epochs: int | None = RESUME_EPOCHS) -> None:
    """Two checkpoints of one run: the same final epoch, the same model and EMA tensors bit for bit, the same
    metrics."""
    import torch
    a, b = (load(x) if isinstance(x, Path) else x for x in (a, b))
    if epochs is not None:
        assert a["epoch"] == b["epoch"] == epochs - 1
    for key in ("model", "ema"):
        different = [k for k in a[key] if not torch.equal(a[key][k], b[key][k])]
        assert not different, f"{key}: {len(different)} tensors differ, e.g. {different[:3]}"
    assert a["metrics"] == b["metrics"]


def results_epochs(run_dir: Path) -> list[int]:
    """The epoch column of a run's results.csv."""
    return [int(r.split(",")[0]) for r in (run_dir / "results.csv").read_text().splitlines()[1:]]


def write_val_split(root: Path, n: int, hw: tuple[int, int], shade) -> Path:
    """``root``/images/val with ``n`` flat-grey jpgs (image k has pixel value ``shade(k)``), each with one centred
    box in ``root``/labels/val; returns the images folder."""
    import cv2
    import numpy as np

    imgs, lbls = root / "images" / "val", root / "labels" / "val"
    imgs.mkdir(parents=True)
    lbls.mkdir(parents=True)
    for k in range(n):
        cv2.imwrite(str(imgs / f"{k}.jpg"), np.full((*hw, 3), shade(k), np.uint8))
        (lbls / f"{k}.txt").write_text("0 0.5 0.5 0.4 0.4\n")
    return imgs


# ---------------------------------------------------------------- model tests (the four model families' files)
def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def write_cfg(tmp_path: Path, d: dict | str, name: str = "bad.yaml") -> Path:
    """A model yaml (a dict dumped, or text as it is) in ``tmp_path``."""
    import yaml
    p = tmp_path / name
    p.write_text(d if isinstance(d, str) else yaml.safe_dump(d))
    return p


def raises_user_error(cfg: Path | dict | str, *fragments: str) -> str:
    """Building ``cfg`` is refused with a UserError naming every fragment; returns its message."""
    import pytest

    from yolotrain.models.yolo import Model
    from yolotrain.utils.core.errors import UserError
    with pytest.raises(UserError) as e:
        Model(cfg)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def randomize_bn(model):
    """Non-trivial BN statistics and affine terms, so fusing has something to fold; returns the model."""
    from torch import nn
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 2.0)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.uniform_(-0.2, 0.2)
    return model


def assert_fused_copy_matches(model):
    """A fused copy of an end-to-end model gives its detections and both branches' raw levels; returns the copy."""
    import copy

    import torch
    x = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    fused = copy.deepcopy(model).fuse()
    with torch.no_grad():
        (a, ra), (b, rb) = model(x), fused(x)
    # the same detections, in any order among equal scores: an untrained head scores neighbouring anchors
    # alike, and rounding (fused or not, per CPU) can swap two such rows in the top-k
    for p, q in zip(a, b):
        gap = (p[:, None, :] - q[None, :, :]).abs().amax(-1)  # every row of one against every row of the other
        assert len(p) == len(q) and (gap.amin(1) < 1e-4).all() and (gap.amin(0) < 1e-4).all()
    for key in ("one2many", "one2one"):
        for p, q in zip(ra[key], rb[key]):
            assert torch.allclose(p, q, atol=1e-4)
    return fused


# ---------------------------------------------------------------- every CLI's flags (test_cli.py and each tool's tests)
def _flag_name(action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


def _numbers(value: object) -> list:
    """The int/float values in a default (a number, or a list/tuple for nargs flags); bools are not numbers."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]


def check_numeric_flags(parser) -> list[str]:
    """Names of flags that take a number but are not range-checked (want: []), so none skips the check.

    Numeric: ``type`` int or float, or a default that is (or lists) an int or float.
    """
    from yolotrain.utils.core.cli import Range

    unchecked = []
    for action in parser._actions:
        if action.nargs == 0 or isinstance(action.type, Range):  # switches, -h, or already checked
            continue
        if action.type in (int, float) or _numbers(action.default):
            unchecked.append(_flag_name(action))
    return unchecked


def check_defaults(parser) -> list[str]:
    """Names of range-checked flags whose default is outside the range (want: []); None means 'unset'."""
    from yolotrain.utils.core.cli import Range

    bad = []
    for action in parser._actions:
        if isinstance(action.type, Range) and action.default is not None:
            values = action.default if isinstance(action.default, (list, tuple)) else [action.default]
            if not all(action.type.contains(v) for v in values):
                bad.append(_flag_name(action))
    return bad


def global_indices(sampler) -> list[int]:
    """A TrainSampler's epoch order across all ranks, padded (or truncated) to its total size: its permutation
    repeated from the start, which the ranks' positions index into."""
    import numpy as np
    if not sampler.n:
        return []
    return sampler.permutation()[np.arange(sampler.total_size) % sampler.n].tolist()
