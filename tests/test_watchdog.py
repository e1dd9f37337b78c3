"""Hangs name themselves: a rank that makes no progress for --hang-timeout says which phase it is stuck
in, with its rank, and exits with EXIT_HUNG; progress (phases, beats) keeps it alive."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.conftest import ROOT, run_env
from utils.core import watchdog
from utils.core.errors import EXIT_HUNG, EXIT_PREEMPTED
from utils.core.watchdog import Watchdog


def _python(code: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``code`` in a fresh interpreter (a firing watchdog ends its process); returns it and its seconds."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=run_env(), capture_output=True,
                       text=True, timeout=60)
    return p, time.monotonic() - t0


def _report(rank: int, where: str) -> re.Pattern:
    """The watchdog's line for ``rank`` stuck in ``where`` (the idle time varies)."""
    return re.compile(rf"rank {rank}: no progress for [\d.]+ (s|min) in {re.escape(where)}; exiting with code "
                      rf"{EXIT_HUNG}\b")


def test_the_exit_code_is_its_own():
    assert EXIT_HUNG not in (0, 1, 2, EXIT_PREEMPTED)  # 75 asks the scheduler to requeue; a hang is a fault


def test_a_stalled_phase_names_itself_and_its_rank_then_exits():
    p, seconds = _python("""
        import time
        from utils.core.watchdog import Watchdog
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


def test_progress_keeps_it_alive_and_stop_ends_the_thread():
    p, _ = _python("""
        import threading, time
        from utils.core import watchdog
        from utils.core.watchdog import Watchdog
        with Watchdog(rank=0, timeout_s=1.0) as watch:
            for _ in range(20):  # 2 s of beats, twice the timeout
                time.sleep(0.1)
                watch.beat()
            with watch.phase("validation"):
                for _ in watchdog.beats(range(20)):  # what the shared code does: beats the installed watchdog
                    time.sleep(0.1)
            with watch.phase("collective all_reduce (local rank 0 prepares the data)", patience_s=30):
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
