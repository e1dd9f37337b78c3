"""Hangs name themselves: a rank that makes no progress for --hang-timeout says which phase it is stuck
in, with its rank, and exits with EXIT_HUNG; progress (phases, beats) keeps it alive."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import PYTHON, RESUME, ROOT, TORCHRUN, run, run_env, run_train, wait_until_gone
from yolotrain.utils.core import watchdog
from yolotrain.utils.core.errors import EXIT_HUNG, EXIT_PREEMPTED
from yolotrain.utils.core.watchdog import Watchdog

SCRIPTS = ROOT / "tests" / "scripts"
HANG_MIN = 0.2  # --hang-timeout in the training runs: above any quiet stretch of a tiny run on a busy CPU
HANG = ["--epochs", "2", "--noplots", "--hang-timeout", str(HANG_MIN)]  # after RESUME: the last --epochs counts


def _python(code: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``code`` in a fresh interpreter (a firing watchdog ends its process); returns it and its seconds."""
    t0 = time.monotonic()
    p = run([PYTHON, "-c", textwrap.dedent(code)], ok=None, timeout=60)
    return p, time.monotonic() - t0


def _report(rank: int, where: str) -> re.Pattern:
    """The watchdog's line for ``rank`` stuck in ``where`` (the idle time varies)."""
    return re.compile(rf"rank {rank}: no progress for [\d.]+ (s|min) in {re.escape(where)}; exiting with code "
                      rf"{EXIT_HUNG}\b")


def test_the_exit_code_is_its_own():
    assert EXIT_HUNG not in (0, 1, 2, EXIT_PREEMPTED)  # 75 asks the scheduler to requeue; a hang is a fault


@pytest.mark.slow  # a subprocess
def test_a_stalled_phase_names_itself_and_its_rank_then_exits():
    p, seconds = _python("""
        import time
        from yolotrain.utils.core.watchdog import Watchdog
        with Watchdog(rank=3, timeout_s=0.5) as watch:
            with watch.phase("step", "epoch 1, batch 2"), watch.phase("loader"):
                time.sleep(30)
        print("not reached")
    """)
    assert p.returncode == EXIT_HUNG, p.stdout + p.stderr
    assert _report(3, "phase 'step > loader' (epoch 1, batch 2)").search(p.stderr), p.stderr
    assert "most recent call first" in p.stderr and 'File "<string>"' in p.stderr  # every thread's stack
    assert "not reached" not in p.stdout
    assert seconds < 20


@pytest.mark.slow  # a subprocess
def test_progress_keeps_it_alive_and_stop_ends_the_thread():
    p, _ = _python("""
        import threading, time
        from yolotrain.utils.core import watchdog
        from yolotrain.utils.core.watchdog import Watchdog
        with Watchdog(rank=0, timeout_s=1.0) as watch:
            for _ in range(20):  # 2 s of beats, twice the timeout
                time.sleep(0.1)
                watch.beat()
            with watch.phase("validation"):
                for _ in watchdog.beats(range(20)):  # what the shared code does: beats the installed watchdog
                    time.sleep(0.1)
            with watch.phase("collective all_gather_object (local rank 0 prepares the data)", patience_s=30):
                time.sleep(2.0)  # a wait allowed to outlast the timeout
        print("alive", threading.active_count())
    """)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no progress" not in p.stderr
    assert p.stdout.split() == ["alive", "1"]  # the watchdog thread is gone


def test_phases_nest_and_the_shared_code_reaches_only_a_started_watchdog():
    watch = Watchdog(rank=0, timeout_s=600)
    with watchdog.phase("collective broadcast_object"):  # not started: the module functions do nothing
        assert watch.where() == "no marked phase"
    with watch:
        with watch.phase("step", "epoch 1, batch 2"), watchdog.phase("collective all_reduce_sum"):
            assert watch.where() == "phase 'step > collective all_reduce_sum' (epoch 1, batch 2)"
        assert watch.where() == "no marked phase"
    assert "hang-watchdog" not in [t.name for t in threading.enumerate()]
    with watchdog.phase("collective barrier"):
        assert watch.where() == "no marked phase"


def test_zero_disables_and_peers_get_a_bounded_grace():
    off = Watchdog(rank=0, timeout_s=0).start()
    with watchdog.phase("scan"):
        assert off.where() == "no marked phase"  # not installed
    off.stop()
    assert "hang-watchdog" not in [t.name for t in threading.enumerate()]
    assert Watchdog(0, 10).grace_s == 0 and Watchdog(0, 10, peers=True).grace_s == 5
    assert Watchdog(0, 1800, peers=True).grace_s == Watchdog.MAX_GRACE_S
    with pytest.raises(ValueError, match="hang timeout"):
        Watchdog(0, float("nan"))


def _gone(pid: int, timeout: float = 10) -> bool:
    """True once ``pid`` has exited (a zombie left for its new parent to reap counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_a_stalled_loader_worker_names_the_loader_and_ends_the_run(tiny_data, tmp_path):
    log = tmp_path / "output.txt"  # a file, not a pipe: a worker left alive must not keep the test waiting
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.run([PYTHON, str(SCRIPTS / "stall_worker.py"), "--data", str(tiny_data), "--project",
                            str(tmp_path), "--name", "stall", *RESUME, *HANG], cwd=ROOT, env=run_env(), stdout=f,
                           stderr=subprocess.STDOUT, timeout=300)
    seconds = time.monotonic() - t0
    out = log.read_text()
    worker = int(re.search(r"stalling loader worker pid (\d+)", out)[1])
    left = not _gone(worker)
    if left:
        os.kill(worker, signal.SIGKILL)
    assert p.returncode == EXIT_HUNG, out[-3000:]
    assert _report(0, "phase 'step > loader' (epoch 1, batch 3)").search(out), out[-3000:]
    assert "most recent call first" in out
    assert seconds < HANG_MIN * 60 + 60  # the run itself takes seconds before the stall
    assert not left, f"the stalled loader worker {worker} outlived its rank"


@pytest.mark.slow
@pytest.mark.dist
def test_a_stalled_rank_and_the_rank_waiting_on_it_both_name_their_phase(tiny_data, tmp_path):
    """Rank 1 stalls in its step before the step's all-reduce; rank 0 waits in that all-reduce. Each
    rank's watchdog names its own phase (rank 1 waits a grace before exiting, so rank 0 reports
    before its connection breaks) and the job ends non-zero, rank 1 with code 124."""
    t0 = time.monotonic()
    p = run_train(TORCHRUN, tiny_data, tmp_path, "stall", *RESUME, *HANG, script=(SCRIPTS / "stall_rank1.py",),
                  ok=False, timeout=300)
    seconds = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert _report(1, "phase 'step' (epoch 1, batch 2)").search(out), out[-4000:]
    assert _report(0, "phase 'step > collective all_reduce_sum' (epoch 1, batch 2)").search(out), out[-4000:]
    stalled = rf"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: {EXIT_HUNG}\b"  # torchrun's failure summary
    assert re.search(stalled, out), out[-2000:]
    assert seconds < HANG_MIN * 60 * 1.5 + 60  # timeout + grace + the seconds the run takes
    wait_until_gone(str(tmp_path / "stall"))
