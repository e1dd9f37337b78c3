"""Experiment tracking (--tensorboard, --mlflow) against the real things: a real `mlflow server` started here,
TensorBoard's own event reader, and tiny in-process training runs. A tracking server that dies mid-run must
neither stop nor slow training; a resumed run continues its MLflow run."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from yolotrain.app import train
from tests.helpers import ROOT, run_env
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.errors import Preempted, UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.track import attach_trackers, check_packages
from yolotrain.utils.engine.track.mlflow import UNSENT
from yolotrain.utils.engine.track.sender import Rejected, Sender

mlflow = pytest.importorskip("mlflow")  # requirements-track.txt (CI installs it)
pytest.importorskip("tensorboard")
from mlflow.tracking import MlflowClient  # noqa: E402

ARGS = ["--epochs", "2", "--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0", "--seed", "1"]
MLFLOW = Path(sys.executable).parent / "mlflow"


class Server:
    """`mlflow server` on a free port, its database and artifacts under ``root``; restartable on the same DB."""

    def __init__(self, root: Path) -> None:
        self.root, self.proc = root, None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        cmd = [str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True, env=run_env())
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("mlflow server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its workers: a crash, not a shutdown
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("mlflow")).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tracked_run(tiny_data, server, tmp_path_factory, one_thread):
    """One tiny run with both trackers: its folder and TrainResult."""
    saved = list(LOGGER.handlers), LOGGER.level, LOGGER.propagate
    project = tmp_path_factory.mktemp("tracked")
    opt = train.parse_opt(["--data", str(tiny_data), "--project", str(project), "--name", "both", *ARGS,
                           "--tensorboard", "--mlflow", server.uri])
    try:
        return train.main(opt)
    finally:  # train.main attached its own handler; later tests must not write to this one's capture
        LOGGER.handlers[:] = saved[0]
        LOGGER.setLevel(saved[1])
        LOGGER.propagate = saved[2]


def _run_of(client: MlflowClient, name: str):
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.info.run_name == name]
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return runs[0]


@pytest.mark.slow
def test_mlflow_gets_params_metrics_per_epoch_and_artifacts(tracked_run, server):
    client = MlflowClient(server.uri)
    run = _run_of(client, "both")
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["epochs"] == "2" and params["imgsz"] == "64" and float(params["lr0"]) > 0  # arguments and hyp
    for key in ("metrics/mAP_0.5:0.95", "train/box_loss", "val/cls_loss", "x/lr0"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 1], key
    top = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.csv", "opt.yaml", "hyp.yaml", "PR_curve.png", "confusion_matrix.png", "weights"} <= top
    assert [a.path for a in client.list_artifacts(run.info.run_id, "weights")] == ["weights/best.pt"]
    assert not (tracked_run.save_dir / UNSENT).exists()


@pytest.mark.slow
def test_tensorboard_event_files_hold_steps_epochs_pictures_and_hparams(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked_run.save_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    for name in ("box", "cls", "dfl"):
        assert len(acc.Scalars(f"train_step/{name}_loss")) >= 2  # a point per optimizer step
        assert [s.step for s in acc.Scalars(f"train/{name}_loss")] == [0, 1]  # a point per epoch
    assert acc.Scalars("train_step/lr0") and [s.step for s in acc.Scalars("metrics/mAP_0.5:0.95")] == [0, 1]
    assert {"train_batch0", "PR_curve", "confusion_matrix"} <= set(tags["images"])
    hp = acc.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in hp and b"lr0" in hp["_hparams_/session_start_info"]
    assert [s.value for s in acc.Scalars("hparam/fitness")] == [pytest.approx(tracked_run.metrics["fitness"])]


@pytest.mark.slow
def test_a_server_killed_mid_run_neither_stops_nor_slows_training(tiny_data, tmp_path, restore_logger, one_thread):
    s = Server(tmp_path / "server")
    s.root.mkdir()
    s.start()
    seen, times = [], {}

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    def on_start(e):
        LOGGER.addHandler(Capture())  # train.main set up its own handlers

    def on_epoch(e):
        if e.epoch == 0:
            s.stop()

    cb = Callbacks()
    cb.add("on_train_start", on_start)
    cb.add("on_fit_epoch_end", on_epoch)
    cb.add("on_train_end", lambda e: times.setdefault("end", time.monotonic()))
    opt = train.parse_opt(["--data", str(tiny_data), "--project", str(tmp_path), "--name", "down", *ARGS,
                           "--mlflow", s.uri])
    result = train.main(opt, cb)
    closing = time.monotonic() - times["end"]
    assert result.epochs == 2 and result.stop == "finished"
    assert len((result.save_dir / "results.csv").read_text().splitlines()) == 3  # header + every epoch
    assert closing < 10, f"closing waited {closing:.1f}s for a dead server"
    warned = [m for m in seen if "did not answer" in m]
    assert len(warned) == 1 and s.uri in warned[0]
    unsent = result.save_dir / UNSENT
    assert any(str(unsent) in m for m in seen)
    header, *records = [json.loads(line) for line in unsent.read_text().splitlines()]
    steps = {r["step"] for r in records if r["op"] == "metrics"}
    assert {r["op"] for r in records} >= {"metrics", "artifact", "end"} and header["tracking_uri"] == s.uri
    s.start()  # the same database: what was delivered before the kill, plus the file, is every epoch
    try:
        client = MlflowClient(s.uri)
        run = client.get_run(header["run_id"]) if header["run_id"] else None
        if run is not None:
            steps |= {m.step for m in client.get_metric_history(run.info.run_id, "metrics/mAP_0.5")}
    finally:
        s.stop()
    assert steps == {0, 1}


@pytest.mark.slow
def test_a_preempted_run_resumes_into_the_same_mlflow_run(tiny_data, server, tmp_path, restore_logger, one_thread):
    def preempt(e):
        if e.epoch == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop: saved at the next step, exit for a requeue

    cb = Callbacks()
    cb.add("on_fit_epoch_end", preempt)
    opt = train.parse_opt(["--data", str(tiny_data), "--project", str(tmp_path), "--name", "pre", *ARGS,
                           "--mlflow", server.uri])
    with pytest.raises(Preempted):
        train.main(opt, cb)
    import torch

    last = tmp_path / "pre" / "weights" / "last.pt"
    run_id = torch.load(last, weights_only=True)["tracking"]["mlflow_run_id"]
    client = MlflowClient(server.uri)
    assert client.get_run(run_id).info.status == "KILLED"
    result = train.main(train.parse_opt(["--resume", str(last)]))  # --mlflow comes back with the saved arguments
    assert result.epochs >= 1
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "pre"
    assert {m.step for m in client.get_metric_history(run_id, "metrics/mAP_0.5")} == {0, 1}
    assert len([r for r in client.search_runs([run.info.experiment_id]) if r.info.run_name == "pre"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("flag, package", [("--mlflow", "mlflow"), ("--tensorboard", "tensorboard")])
def test_a_missing_package_is_one_line_before_training(tiny_data, tmp_path, flag, package):
    code = (f"import sys; sys.modules[{package!r}] = None; import train; "
            f"sys.exit(train.cli(['--data', {str(tiny_data)!r}, '--project', {str(tmp_path)!r}, '--epochs', '1', "
            f"{flag!r}]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and f"'{package}'" in out and "pip install -r requirements-track.txt" in out, out
    assert "Traceback" not in out and not list(tmp_path.iterdir())  # nothing started


def test_no_tracker_turns_itself_on(monkeypatch):
    t = type("T", (), {"info": DistInfo(), "cfg": train.parse_opt([])})()
    assert attach_trackers(t, Callbacks()) == []  # both packages are installed here
    check_packages(train.parse_opt([]))
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(UserError, match=r"--mlflow needs the 'mlflow' package: pip install -r requirements-track.txt"):
        check_packages(train.parse_opt(["--mlflow"]))


def test_the_sender_keeps_records_through_an_outage_and_warns_once(restore_logger):
    seen, failures, got = [], {"n": 2}, []

    class Capture(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    LOGGER.addHandler(Capture())
    LOGGER.setLevel(logging.INFO)

    def deliver(r):
        if r.get("bad"):
            raise Rejected("bad value")
        if failures["n"]:
            failures["n"] -= 1
            raise ConnectionError("refused")
        got.append(r["i"])

    s = Sender("test server", deliver)
    for i in range(4):
        s.put({"op": "metrics", "i": i})
    s.put({"op": "params", "bad": True})
    s.put({"op": "metrics", "i": 4})
    assert s.close(timeout_s=30, down_s=30) == []
    assert got == [0, 1, 2, 3, 4] and s.rejected == 1
    assert len([m for m in seen if "did not answer" in m]) == 1 and any("answers again" in m for m in seen)

    dead = Sender("dead server", lambda r: (_ for _ in ()).throw(ConnectionError("refused")))
    dead.put({"op": "metrics", "i": 0})
    start = time.monotonic()
    assert dead.close(timeout_s=30, down_s=0.5) == [{"op": "metrics", "i": 0}]
    assert time.monotonic() - start < 3


def test_the_run_state_saves_the_tracker_ids_only_when_set():
    import torch

    from yolotrain.utils.data.loader import TrainSampler
    from yolotrain.utils.engine.budget import TimeBudget
    from yolotrain.utils.engine.optim import EarlyStopping
    from yolotrain.utils.engine.state import RunState

    def fresh() -> RunState:
        return RunState(epochs=2, device=torch.device("cpu"), sampler=TrainSampler(8),
                        stopper=EarlyStopping(patience=3), clock=TimeBudget(0))

    state = fresh()
    assert "tracking" not in state.state_dict(mid_epoch=False)
    state.tracking["mlflow_run_id"] = "abc"
    saved = state.state_dict(mid_epoch=False)
    assert saved["tracking"] == {"mlflow_run_id": "abc"}
    resumed = fresh()
    resumed.load_state_dict(saved, restore_mosaic=False)
    assert resumed.tracking == {"mlflow_run_id": "abc"}
    del saved["tracking"]  # a checkpoint from before tracking loads
    resumed.load_state_dict(saved, restore_mosaic=False)
    assert resumed.tracking == {}
