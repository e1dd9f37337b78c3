"""--mlflow: parameters at the start, the results.csv row every epoch, the run's files at the end, to an
MLflow tracking server or a local database, through ``MlflowClient`` (no global state: one process may
train several runs). Every call goes through a background Sender, so a server that is down, slow or fails
mid-run never stops or slows training; what it never got is written to ``mlflow_unsent.jsonl`` in the run
folder, and a --resume of the run sends it. The MLflow run id lives in the run state (checkpoints), so a
resumed run continues the same MLflow run.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.engine.setup import Training
from yolotrain.utils.engine.track.base import RunEnd, Tracker, metric_name, run_params
from yolotrain.utils.engine.track.sender import Rejected, Sender

UNSENT = "mlflow_unsent.jsonl"
FLUSH_S = {RunEnd.FINISHED: 30.0, RunEnd.KILLED: 10.0, RunEnd.FAILED: 10.0}  # a requeue's grace is short
PARAM_CHARS = 500  # the oldest servers' limit on a parameter value
PARAMS_PER_CALL = 100  # MLflow's limit per log_batch
ARTIFACTS = ("weights/best.pt", "results.csv", "opt.yaml", "hyp.yaml")


def tracking_uri(flag: Any, saved: dict[str, str], project: Path) -> str:
    """--mlflow URI, else the URI a resumed run used, else $MLFLOW_TRACKING_URI, else a SQLite database in the
    run's project folder (MLflow's own default, and its file store is refused by MLflow 3)."""
    if isinstance(flag, str) and flag:
        return flag
    return (saved.get("mlflow_uri") or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(project / 'mlflow.db').resolve()}")


class MLflowTracker(Tracker):
    name = "MLflow"
    EVENTS = ("on_fit_epoch_end", "on_train_end")

    def __init__(self, t: Training) -> None:
        super().__init__()
        # Sender retries on its own: MLflow's retries (minutes of backoff) would only delay the queue. Process-wide
        # (MLflow reads its environment per request); a value the user set wins.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient  # lazily: only a run that asked for --mlflow imports it

        self.t, self.state, project = t, t.state, t.save_dir.parent
        self.uri = tracking_uri(t.cfg.mlflow, t.state.tracking, project)
        same = t.state.tracking.get("mlflow_uri") == self.uri
        self.run_id: str | None = t.state.tracking.get("mlflow_run_id") if same else None
        self.local = self.uri.startswith("sqlite:") or "://" not in self.uri
        self.experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or project.name or "yolotrain"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.unsent = t.save_dir / UNSENT
        self.sender = Sender(f"MLflow server {self.uri}", self._deliver)
        self.sender.put({"op": "start", "resume": self.run_id is not None})
        self._replay()
        self.sender.put({"op": "params", "params": run_params(t)})
        LOGGER.info(f"MLflow: run '{t.save_dir.name}' in experiment '{self.experiment}' at {self.uri}")

    def _replay(self) -> None:
        """Queue what a previous process of this run could not deliver (its start and end are this run's own)."""
        if self.unsent.is_file():
            lines = self.unsent.read_text().splitlines()[1:]
            records = [r for r in map(json.loads, filter(None, lines)) if r.get("op") not in ("start", "end")]
            for r in records:
                self.sender.put(r)
            self.unsent.unlink()
            LOGGER.info(f"MLflow: {len(records)} records kept in {self.unsent} are queued again")

    def on_fit_epoch_end(self, e) -> None:
        self.sender.put({"op": "metrics", "step": e.epoch, "time_ms": int(time.time() * 1000),
                         "metrics": {metric_name(k): float(v) for k, v in e.row.items()}})

    def on_train_end(self, e) -> None:
        d = self.t.save_dir
        files = [d / f for f in ARTIFACTS] + sorted(d.glob("*.png")) + sorted(d.glob("*.jpg"))
        for f in files:
            if f.is_file():
                self.sender.put({"op": "artifact", "path": str(f), "dir": f.parent.relative_to(d).as_posix()})

    def close(self, end: RunEnd) -> None:
        self.sender.put({"op": "end", "status": end.value})
        left = self.sender.close(FLUSH_S[end])
        if left:
            header = {"run_id": self.run_id, "tracking_uri": self.uri, "experiment": self.experiment,
                      "run_name": self.t.save_dir.name}
            self.unsent.write_text("".join(json.dumps(r) + "\n" for r in [header, *left]))
            LOGGER.warning(f"MLflow: {len(left)} records not delivered to {self.uri}; kept in {self.unsent} "
                           f"(run id {self.run_id}); a --resume of this run sends them")

    # --- on the sender's thread only -------------------------------------------------------------------
    def _deliver(self, r: dict[str, Any]) -> None:
        from mlflow.exceptions import MlflowException

        try:
            getattr(self, f"_send_{r['op']}")(r)
        except MlflowException as e:
            code = e.get_http_status_code()
            if 400 <= code < 500 and code != 429:  # the server answered no: retrying would not help
                raise Rejected(f"{e.error_code}: {str(e)[:200]}") from e
            raise

    def _send_start(self, r: dict[str, Any]) -> None:
        if self.run_id is not None and r["resume"]:
            try:
                self.client.update_run(self.run_id, status="RUNNING")
                return
            except Exception as e:  # noqa: BLE001
                if getattr(e, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                    raise
                LOGGER.warning(f"MLflow: run {self.run_id} is not on {self.uri}; starting a new one")
        run = self.client.create_run(self._experiment_id(), run_name=self.t.save_dir.name,
                                     tags={"yolotrain.save_dir": str(self.t.save_dir)})
        self.run_id = run.info.run_id
        self.state.tracking.update(mlflow_run_id=self.run_id, mlflow_uri=self.uri)  # saved in the next checkpoint

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        where = str((self.t.save_dir.parent / "mlruns").resolve()) if self.local else None
        try:
            return self.client.create_experiment(self.experiment, artifact_location=where)
        except Exception:  # noqa: BLE001 -- another run created it meanwhile
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _run(self) -> str:
        if self.run_id is None:
            raise Rejected("no MLflow run was created")
        return self.run_id

    def _send_params(self, r: dict[str, Any]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self._run()).data.params  # a resumed run keeps the values it started with
        params = [Param(k[:250], str(v)[:PARAM_CHARS]) for k, v in r["params"].items() if k[:250] not in have]
        for i in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self._run(), params=params[i:i + PARAMS_PER_CALL])

    def _send_metrics(self, r: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, r["time_ms"], r["step"]) for k, v in r["metrics"].items()]
        self.client.log_batch(self._run(), metrics=metrics)

    def _send_artifact(self, r: dict[str, Any]) -> None:
        self.client.log_artifact(self._run(), r["path"], artifact_path=None if r["dir"] == "." else r["dir"])

    def _send_end(self, r: dict[str, Any]) -> None:
        self.client.set_terminated(self._run(), status=r["status"])
