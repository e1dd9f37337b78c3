"""Training from S3-compatible object storage (utils/data/remote.py): shards and an index in a bucket of a real
S3 server (moto's, started here on 127.0.0.1), read through fsspec/s3fs as on a cloud GPU node."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.helpers import PYTHON, RESUME, RESUME_EPOCHS, ROOT, children, free_port, load, run_env
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data import remote
from yolotrain.utils.data.shardcache import BUDGET_ENV
from yolotrain.utils.data.shards import ShardIndex
from yolotrain.app import shards

s3fs = pytest.importorskip("s3fs", reason="pip install -r requirements-s3.txt")
pytest.importorskip("moto.server", reason="moto[server] runs the S3 server these tests talk to")
pytest.importorskip("flask", reason="moto[server] runs the S3 server these tests talk to")


class Server:
    """moto's S3 server on 127.0.0.1, and the environment a client needs to reach it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "test",
                    "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        self.start()

    def start(self) -> None:
        """Serve on this server's port (an empty store: moto keeps objects in memory)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("moto's S3 server did not start")

    def fs(self):
        return s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": self.env["AWS_ENDPOINT_URL"]},
                                 skip_instance_cache=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture
def server(monkeypatch, tmp_path):
    s = Server()
    for k, v in s.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(Path(os.environ.get("TMPDIR", "/tmp"))))  # no ~/.aws of the machine's
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the node's index and shard copies by default
    yield s
    s.stop()


def _upload(server: Server, src: Path, bucket: str, prefix: str) -> str:
    fs = server.fs()
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    fs.put(str(src) + "/", f"{bucket}/{prefix}/", recursive=True)
    return f"s3://{bucket}/{prefix}"


def test_an_index_in_a_bucket_reads_as_the_local_one(server, tiny_data, tmp_path, restore_logger):
    out = tmp_path / "shards"
    shards.main(shards.build_parser().parse_args([str(tiny_data), str(out)]))
    url = _upload(server, out, "data", "tiny")
    local, there = ShardIndex.open(out / "train.index"), ShardIndex.open(f"{url}/train.index", nc=6)
    assert len(there) == len(local) and there.meta == local.meta
    assert all(there.read(i) == local.read(i) for i in range(len(local)))
    assert there.member(3) == f"{url}/train-000000.tar/000000003.jpg"
    with pytest.raises(UserError, match=rf"s3://nobucket/x/train.index/index.json: no such object at "
                                        rf"http://127.0.0.1:{server.port}"):
        ShardIndex.open("s3://nobucket/x/train.index")


def test_a_node_fetches_a_remote_index_once_and_maps_it(server, tiny_data, tmp_path, restore_logger):
    out = tmp_path / "shards"
    shards.main(shards.build_parser().parse_args([str(tiny_data), str(out)]))
    url, cache = _upload(server, out, "data", "tiny"), tmp_path / "node-disk"
    first = ShardIndex.open(f"{url}/train.index", cache_dir=cache)
    copy = cache / "yolotrain-indexes" / first.meta["id"]
    assert isinstance(first.arrays["labels"], np.memmap) and Path(first.arrays["labels"].filename) == (
        copy / "labels.npy").resolve()
    server.fs().rm("data/tiny/train.index/labels.npy")  # a second rank of the node never reads the arrays again
    second = ShardIndex.open(f"{url}/train.index", cache_dir=cache)
    local = ShardIndex.open(out / "train.index")
    assert all(np.array_equal(second.arrays[k], local.arrays[k]) for k in local.arrays)
    assert sorted(p.name for p in (cache / "yolotrain-indexes").iterdir()) == [first.meta["id"]]  # no temp left


def test_a_node_copies_the_shards_it_reads_and_then_reads_them_locally(server, tiny_data, tmp_path, monkeypatch,
                                                                         restore_logger):
    out = tmp_path / "shards"
    shards.main(shards.build_parser().parse_args([str(tiny_data), str(out), "--shard-size", "1"]))
    url, local = _upload(server, out, "data", "tiny"), ShardIndex.open(out / "train.index")
    monkeypatch.setenv(BUDGET_ENV, "1")  # a budget, so the copies do not hang on this disk's free space
    index = ShardIndex.open(f"{url}/train.index", cache_dir=tmp_path / "node")
    assert all(index.read(i) == local.read(i) for i in range(len(local)))  # by range while the copies run
    index.cache.wait()
    copies = sorted((tmp_path / "node" / "yolotrain-shards" / index.meta["id"]).iterdir())
    assert [p.name for p in copies if not p.name.startswith(".")] == index.meta["shards"]
    assert all(p.read_bytes() == (out / p.name).read_bytes() for p in copies if p.suffix == ".tar")
    server.fs().rm("data/tiny", recursive=True)  # the store's copy gone: the node's copies serve every read
    assert all(index.read(i) == local.read(i) for i in range(len(local)))
    monkeypatch.setenv(BUDGET_ENV, "0")  # no copies: every read by range
    none = ShardIndex.open(f"{_upload(server, out, 'data', 'again')}/train.index", cache_dir=tmp_path / "node2")
    assert all(none.read(i) == local.read(i) for i in range(len(local)))
    none.cache.wait()
    assert not list((tmp_path / "node2" / "yolotrain-shards").glob("*/*.tar"))
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(UserError, match=f"{BUDGET_ENV}='lots': expected GiB"):
        ShardIndex.open(f"{url.replace('tiny', 'again')}/train.index")


def test_shards_are_written_to_a_bucket_and_read_back(server, tiny_data, tmp_path, restore_logger):
    server.fs().mkdir("made")
    url = shards.main(shards.build_parser().parse_args([str(tiny_data), "s3://made/tiny"]))
    local = shards.main(shards.build_parser().parse_args([str(tiny_data), str(tmp_path / "here")]))
    for split in ("train", "val"):
        there, here = ShardIndex.open(f"{url}/{split}.index"), ShardIndex.open(local / f"{split}.index")
        assert there.meta == here.meta and all(there.read(i) == here.read(i) for i in range(len(here)))
    assert yaml.safe_load(server.fs().cat_file("made/tiny/data.yaml"))["path"] == "s3://made/tiny"
    with pytest.raises(UserError, match="s3://made/tiny: holds objects already"):
        shards.main(shards.build_parser().parse_args([str(tiny_data), "s3://made/tiny"]))


def test_a_data_yaml_in_a_bucket_trains_as_a_local_one(server, tiny_data, tmp_path, restore_logger, one_thread):
    """--data s3://.../data.yaml: the yaml shards writes (path: the URL), and one with relative splits, which
    resolve against the yaml's folder in the store; an image folder in a bucket is named with how to make shards."""
    from tests.helpers import TINY, train_here
    from yolotrain.utils.data.config import load_data_config

    server.fs().mkdir("made")
    url = shards.main(shards.build_parser().parse_args([str(tiny_data), "s3://made/tiny"]))
    names = yaml.safe_load(tiny_data.read_text())["names"]
    server.fs().pipe_file("made/tiny/yamls/relative.yaml", yaml.safe_dump(
        {"train": "../train.index", "val": "../val.index", "names": names}).encode())
    relative = load_data_config(f"{url}/yamls/relative.yaml")
    assert (relative.train, relative.val) == ([f"{url}/train.index"], [f"{url}/val.index"])
    run = train_here("--data", f"{url}/data.yaml", "--cfg", "yolov5n.yaml", "--epochs", "1", *TINY,
                     "--project", tmp_path, "--name", "s3yaml", "--cache-dir", tmp_path / "node")
    assert run.last.is_file()
    _upload(server, tiny_data.parent / "shapes", "made", "folder")
    server.fs().pipe_file("made/folder/data.yaml", b"train: images/train\nval: images/val\nnames: [a]\n")
    with pytest.raises(UserError) as e:
        train_here("--data", "s3://made/folder/data.yaml", *TINY, "--project", tmp_path, "--name", "no")
    assert str(e.value).startswith("s3://made/folder/data.yaml: 'train' is s3://made/folder/images/train: only "
                                   "shard indexes (<split>.index) are read from object storage")
    assert "yolotrain shards DATA.yaml s3://BUCKET/PREFIX" in str(e.value)
    with pytest.raises(UserError, match="s3://made/none.yaml: no such object"):
        load_data_config("s3://made/none.yaml")


SRUN = """#!{python}
# srun as the SLURM tests launch: SLURM_NTASKS tasks of one command on this node, signals passed to every task
import os, signal, subprocess, sys
tasks = [subprocess.Popen(sys.argv[1:], env=dict(os.environ, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)))
         for r in range(int(os.environ["SLURM_NTASKS"]))]
for s in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(s, lambda sig, frame: [t.send_signal(sig) for t in tasks])
sys.exit(max(t.wait() for t in tasks))
"""


@pytest.mark.slow
@pytest.mark.dist
def test_the_slurm_batch_script_trains_from_the_bucket_and_requeues_a_stopped_job(server, tiny_data, tmp_path,
                                                                                  restore_logger):
    """examples/slurm/train-s3.sbatch as SLURM runs it (two srun-style tasks): data from the bucket, each node's
    copies in its --cache-dir, the run in the shared folder; SLURM's USR1 stops the job, the script requeues it,
    and the requeued job resumes and finishes without asking again. The run folder is the job's own (name and job
    id: a requeue keeps the id), and the run saves mid-epoch (--save-interval)."""
    server.fs().mkdir("made")
    url = shards.main(shards.build_parser().parse_args([str(tiny_data), "s3://made/tiny"]))
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "srun").write_text(SRUN.format(python=PYTHON))
    (tools / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    shared = tmp_path / "shared"

    def job(*flags: str) -> subprocess.Popen:
        env = run_env(**server.env, PATH=f"{tools}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NAME="job",
                      SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="127.0.0.1",
                      MASTER_PORT=str(free_port()), DATA=f"{url}/data.yaml", PROJECT=str(shared),
                      CACHE_DIR=str(tmp_path / "node"), BATCH="4", YOLOTRAIN=f"{PYTHON} train.py")
        return subprocess.Popen(["bash", str(ROOT / "examples" / "slurm" / "train-s3.sbatch"), *flags], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = job(*RESUME)
    line = first.stdout.readline()
    while line and not line.startswith(f"Training {RESUME_EPOCHS} epochs"):  # rank 0's start summary ends the set-up
        line = first.stdout.readline()
    time.sleep(1.0)
    os.kill(children(first.pid)[0], signal.SIGUSR1)  # SLURM's warning before the time limit, through srun
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 75, out[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    run_folder = shared / "job-4242"  # $SLURM_JOB_NAME-$SLURM_JOB_ID
    assert (run_folder / "PREEMPTED").is_file() and list((tmp_path / "node").glob("yolotrain-indexes/*"))
    again = job(*RESUME)  # the requeued job
    out = again.communicate(timeout=600)[0]
    assert again.returncode == 0, out[-3000:]
    assert "Resuming" in out and not (run_folder / "PREEMPTED").exists()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # finished: not requeued again
    ckpt = load(run_folder / "weights" / "last.pt")
    assert ckpt["epoch"] == RESUME_EPOCHS - 1 and ckpt["world_size"] == 2
    assert ckpt["args"]["save_interval"] == 30 and ckpt["args"]["name"] == "job-4242"
    assert sorted(p.name for p in shared.iterdir()) == ["job-4242"]  # one folder, the job's


def test_missing_credentials_fail_at_the_start(server, monkeypatch):
    server.fs().mkdir("empty")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    with pytest.raises(UserError, match="check the credentials"):
        remote.read("s3://empty/train.index/index.json")


def test_a_shard_cut_short_in_the_bucket_is_named_at_once(server, tiny_data, tmp_path, monkeypatch, restore_logger):
    """A byte range past a shard's end is no outage: the member and the bytes it lacks are named at once, as for
    a shard cut short on a local disk, with the store's patience long and no copy to fall back on."""
    out = tmp_path / "shards"
    shards.main(shards.build_parser().parse_args([str(tiny_data), str(out)]))
    url = _upload(server, out, "data", "tiny")
    tar = out / "train-000000.tar"
    server.fs().pipe_file("data/tiny/train-000000.tar", tar.read_bytes()[:tar.stat().st_size // 2])
    monkeypatch.setenv(remote.PATIENCE_ENV, "120")
    monkeypatch.setenv(BUDGET_ENV, "0")  # every read a range request to the store
    index, local = ShardIndex.open(f"{url}/train.index"), ShardIndex.open(out / "train.index")
    last = len(index) - 1  # its bytes lie past the cut
    started = time.monotonic()
    with pytest.raises(UserError) as e:
        index.read(last)
    assert time.monotonic() - started < 30  # not the patience
    size = int(local.arrays["size"][last])
    assert str(e.value) == f"{url}/train-000000.tar/{Path(local.member(last)).name}: the shard ends {size} bytes " \
                           "early (truncated)"
    assert index.read(0) == local.read(0)  # the part before the cut reads as before


@pytest.mark.slow  # waits out a store's patience
def test_a_store_gone_stops_with_the_object_and_the_endpoint(server, tiny_data, tmp_path, monkeypatch, capsys,
                                                             restore_logger):
    out = tmp_path / "shards"
    shards.main(shards.build_parser().parse_args([str(tiny_data), str(out)]))
    index = ShardIndex.open(f"{_upload(server, out, 'data', 'tiny')}/val.index")
    server.stop()  # gone mid-run
    monkeypatch.setenv(remote.PATIENCE_ENV, "2")
    started = time.monotonic()
    with pytest.raises(UserError, match=rf"s3://data/tiny/val-000000.tar: the store at http://127.0.0.1:"
                                        rf"{server.port} failed for 2 s"):
        index.read(0)
    assert 1.0 < time.monotonic() - started < 60  # retried with backoff until the patience ran out
    assert capsys.readouterr().out.count("retrying with backoff") == 1  # logged once


class Endpoint:
    """A TCP relay on its own port in front of the server: closing it is the store going away (connections
    refused, those open cut), opening it again the same store coming back with its objects (moto keeps them in
    memory, so restarting moto itself would bring back an empty store)."""

    def __init__(self, target: int) -> None:
        self.target, self.port, self.open_sockets = target, free_port(), []
        self.listener: socket.socket | None = None

    def open(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def close(self) -> None:
        for sock in [self.listener, *self.open_sockets]:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept or recv, which close alone does not
                sock.close()
            except OSError:
                pass
        self.open_sockets = []

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.open_sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass


@pytest.mark.slow  # waits for a store to come back
def test_a_store_back_within_the_patience_serves_the_read(server, tiny_data, tmp_path, monkeypatch, capsys,
                                                         restore_logger):
    out = tmp_path / "shards"
    shards.main(shards.build_parser().parse_args([str(tiny_data), str(out)]))
    url = _upload(server, out, "data", "tiny")
    endpoint = Endpoint(server.port)
    endpoint.open()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{endpoint.port}")
    monkeypatch.setenv(BUDGET_ENV, "0")  # every read a range request to the store
    monkeypatch.setenv(remote.PATIENCE_ENV, "120")
    index = ShardIndex.open(f"{url}/val.index")
    assert index.read(0) == ShardIndex.open(out / "val.index").read(0)
    endpoint.close()  # gone mid-epoch, back with its objects a few seconds later
    back, started = threading.Timer(4, endpoint.open), time.monotonic()
    back.start()
    try:
        assert index.read(1) == ShardIndex.open(out / "val.index").read(1)
        assert time.monotonic() - started > 3.5  # served once the store was back, not before
    finally:
        back.join()
        endpoint.close()
    assert capsys.readouterr().out.count("retrying with backoff") <= 1  # s3fs's own retries may cover a short outage


def _bucket_training(server: Server, tiny_data: Path, tmp_path: Path, workers: int) -> tuple[str, Path, list, dict]:
    """The tiny set as shards in the bucket: (its URL, a data yaml naming it, train.py's flags, the environment)."""
    out = tmp_path / "shards"
    shards.main(shards.build_parser().parse_args([str(tiny_data), str(out)]))
    url = _upload(server, out, "data", "tiny")
    yaml_file = tmp_path / "s3.yaml"
    yaml_file.write_text(f"path: {url}\ntrain: train.index\nval: val.index\n"
                         "names: {0: circle, 1: square, 2: triangle, 3: star, 4: cross, 5: ring}\n")
    flags = ["--cfg", "models/yolov8n.yaml", "--epochs", "1", "--imgsz", "64", "--batch-size", "4", "--val-batch-size",
             "4", "--workers", str(workers), "--seed", "3", "--noplots", "--project", str(tmp_path / "runs")]
    return url, yaml_file, flags, {**run_env(), **server.env, "HOME": os.environ["HOME"]}


def _assert_same_weights(runs: Path, a: str, b: str) -> dict:
    ca, cb = (torch.load(runs / n / "weights" / "last.pt", weights_only=True) for n in (a, b))
    for part in ("model", "ema"):
        assert all(torch.equal(ca[part][k], cb[part][k]) for k in ca[part])
    assert ca["metrics"] == cb["metrics"]
    return ca


@pytest.mark.slow
def test_training_from_a_bucket_is_training_from_the_folder(server, tiny_data, tmp_path, restore_logger):
    url, yaml_file, flags, env = _bucket_training(server, tiny_data, tmp_path, workers=1)
    flags += ["--cache-dir", str(tmp_path / "node-disk")]  # the label cache's and the index copy's node-local folder
    for name, data in (("folder", tiny_data), ("s3", yaml_file)):
        p = subprocess.run([PYTHON, "train.py", "--data", str(data), *flags, "--name", name], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"Scanning {url}/train.index" in p.stdout and "(from the shard index)" in p.stdout
    assert len(list((tmp_path / "node-disk" / "yolotrain-indexes").iterdir())) == 2  # train's and val's, mapped
    _assert_same_weights(tmp_path / "runs", "folder", "s3")


@pytest.mark.slow
def test_a_two_node_job_from_a_bucket_is_the_two_rank_folder_run(server, tiny_data, tmp_path, restore_logger):
    """Two torchrun agents on this machine as two nodes of one rank each, each with its own node disk, train from
    the bucket: the same last.pt as two ranks on one node from the folder, and each node fetched its own copy."""
    _, yaml_file, flags, env = _bucket_training(server, tiny_data, tmp_path, workers=0)
    run, port = [sys.executable, "-m", "torch.distributed.run"], free_port()
    p = subprocess.run([*run, "--standalone", "--nproc_per_node", "2", "train.py", "--data", str(tiny_data), *flags,
                        "--name", "folder"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    jobs = [subprocess.Popen([*run, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr",
                              "127.0.0.1", "--master_port", str(port), "train.py", "--data", str(yaml_file), *flags,
                              "--name", "s3", "--cache-dir", str(tmp_path / f"node{node}")], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in jobs]
    assert [p.returncode for p in jobs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for node in (0, 1):
        assert len(list((tmp_path / f"node{node}" / "yolotrain-indexes").iterdir())) == 2  # train's and val's
    assert _assert_same_weights(tmp_path / "runs", "folder", "s3")["world_size"] == 2
