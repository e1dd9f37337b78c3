"""The Python API (yolotrain/): options checked as the CLIs check them, the run's events, results of val,
predict and export, data-parallel launches, and the same weights as train.py."""
from __future__ import annotations

import json
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import PYTHON, ROOT, TORCHRUN, run, run_env
from yolotrain.utils.core.callbacks import EVENTS, CallbackError, Callbacks
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.weights.checkpoint import load_checkpoint
from yolotrain import YOLO
from yolotrain.options import to_argv

TINY = dict(epochs=1, imgsz=64, batch=4, val_batch_size=4, workers=0, seed=3, noplots=True)
TINY_FLAGS = ["--epochs", "1", "--imgsz", "64", "--batch-size", "4", "--val-batch-size", "4", "--workers", "0",
              "--seed", "3", "--noplots"]


def test_an_unknown_option_is_named_with_a_suggestion():
    with pytest.raises(UserError, match=r"train.py: unknown option 'epoch'\. Did you mean 'epochs'\?"):
        YOLO("yolov8n.yaml").train(epoch=3)


def test_values_are_refused_with_the_cli_message():
    with pytest.raises(UserError, match=r"^argument --epochs: must be an integer >= 1, got '0'$"):
        YOLO("yolov8n.yaml").train(epochs=0)
    with pytest.raises(UserError, match=r"option 'rect' is a switch: give True or False, got 'yes'"):
        YOLO("yolov8n.yaml").train(rect="yes")
    with pytest.raises(UserError, match=r"nproc must be a positive integer, got 0"):
        YOLO("yolov8n.yaml").train(nproc=0)


def test_options_become_the_flags_of_the_cli():
    from yolotrain.app import train

    argv = to_argv(train.build_parser(), {"batch": 8, "multi-scale": True, "rect": False, "amp": False,
                                          "freeze": [0, 1], "cache": True, "resume": False, "device": None,
                                          "data": Path("d.yaml")}, "train.py")
    assert argv == ["--batch-size", "8", "--multi-scale", "--no-amp", "--freeze", "0", "1", "--cache", "--data",
                    "d.yaml"]


def test_sources_are_checked_when_made(tmp_path):
    with pytest.raises(UserError, match="nope.yaml"):
        YOLO("nope.yaml")
    with pytest.raises(UserError, match="x.pt: no such file"):
        YOLO(tmp_path / "x.pt")
    exported = tmp_path / "m.onnx"
    exported.write_bytes(b"")
    with pytest.raises(UserError, match="an exported model predicts and validates"):
        YOLO(exported).train()
    with pytest.raises(UserError, match="val needs a checkpoint, and this is a model yaml"):
        YOLO("yolov8n.yaml").val()
    with pytest.raises(UserError, match="unknown callback event 'on_epoch_end'"):
        YOLO("yolov8n.yaml").add_callback("on_epoch_end", print)


@pytest.mark.slow
def test_callbacks_hear_the_run_in_order_and_a_failing_one_stops_it(tiny_data, tmp_path, one_thread, restore_logger):
    model, heard = YOLO("yolov8n.yaml"), []
    for event in EVENTS:
        model.add_callback(event, heard.append)
    run = model.train(data=str(tiny_data), project=str(tmp_path), name="a", **{**TINY, "epochs": 2})
    names = [e.event for e in heard]
    assert names[0] == "on_train_start" and names[-1] == "on_train_end"
    assert names.count("on_train_epoch_start") == names.count("on_fit_epoch_end") == 2
    batches = [e for e in heard if e.event == "on_train_batch_end"]
    assert len(batches) == 2 * heard[0].batches and [e.iteration for e in batches] == list(range(len(batches)))
    assert set(batches[-1].losses) == {"box", "cls", "dfl"} and batches[-1].stepped
    fit = [e for e in heard if e.event == "on_fit_epoch_end"]
    header = (run.save_dir / "results.csv").read_text().splitlines()[0].split(",")[1:]
    assert all(list(e.row) == header for e in fit)
    assert all(set(e.metrics) == {"mp", "mr", "map50", "map", "fitness"} for e in fit)  # ValResult's names
    saved = {e.path.name for e in heard if e.event == "on_model_save"}
    assert {"last.pt", "best.pt"} <= saved
    assert [e.event for e in heard if e.event == "on_val_end"] == ["on_val_end"] * 2
    assert heard[-1].path == run.best and model.path == run.best and run.best.exists()
    assert run.epochs == 2 and run.stop == "finished" and "map" in run.metrics

    def boom(event):
        raise ZeroDivisionError("no")

    failing = YOLO("yolov8n.yaml")
    failing.add_callback("on_train_epoch_end", boom)
    with pytest.raises(CallbackError, match=r"boom on on_train_epoch_end raised ZeroDivisionError: no"):
        failing.train(data=str(tiny_data), project=str(tmp_path), name="b", **TINY)


@pytest.fixture(scope="module")
def val_folder(tiny_data) -> Path:
    from yolotrain.utils.data.config import load_data_config, prepare_dataset

    data = load_data_config(tiny_data)
    prepare_dataset(data)
    return Path(data.val[0])


@pytest.mark.slow
def test_val_predict_and_export_give_what_the_clis_give(tiny_v8n, tiny_data, val_folder, tmp_path, one_thread,
                                                         restore_logger):
    from yolotrain.app import detect
    from yolotrain.app import val

    model = YOLO(tiny_v8n)
    scores = model.val(data=str(tiny_data), imgsz=64, batch_size=4, workers=0, noplots=True)
    cli = val.main(val.parse_opt(["--weights", str(tiny_v8n), "--data", str(tiny_data), "--imgsz", "64",
                                  "--batch-size", "4", "--workers", "0", "--noplots"]))[0]
    assert (scores.map50, scores.map, scores.mp, scores.mr) == (cli.metrics.map50, cli.metrics.map, cli.metrics.mp,
                                                                cli.metrics.mr)
    assert set(scores.per_class) <= {"circle", "square", "triangle", "star", "cross", "ring"}
    assert set(scores.speed_ms) == {"preprocess", "inference", "nms"}

    streamed = model.predict(val_folder, imgsz=64)
    assert isinstance(streamed, types.GeneratorType)
    results = list(streamed)
    assert len(results) == len(list(val_folder.glob("*.jpg"))) and sum(len(r) for r in results) > 0
    heard = Callbacks()
    heard.add("on_predict_batch_end", lambda e: heard_batches.append((e.batch, [(r.path, len(r)) for r in e.results])))
    heard_batches: list = []
    detect.main(detect.parse_opt(["--weights", str(tiny_v8n), "--source", str(val_folder), "--imgsz", "64",
                                  "--save-txt", "--save-conf", "--nosave", "--project", str(tmp_path), "--name", "cli"]),
                heard)
    assert [k for k, _ in heard_batches] == list(range(len(heard_batches)))  # the CLI's tool emits its own events
    assert [pair for _, batch in heard_batches for pair in batch] == [(r.path, len(r)) for r in results]
    for r in results:
        cli_txt = tmp_path / "cli" / "labels" / f"{Path(r.path).stem}.txt"
        ours = r.save_txt(tmp_path / "api" / f"{Path(r.path).stem}.txt", save_conf=True).read_text()
        assert ours == (cli_txt.read_text() if cli_txt.exists() else "")
        assert isinstance(r.boxes.xyxy, torch.Tensor) and isinstance(r.boxes.numpy().conf, np.ndarray)
        np.testing.assert_array_equal(r.boxes.numpy().data, r.boxes.data.numpy())
        assert r.plot().shape == r.orig_img.shape and len(json.loads(r.to_json())) == len(r)

    one = sorted(val_folder.glob("*.jpg"))[:2]
    listed = model.predict(one, imgsz=64, save=True, project=str(tmp_path), name="saved")
    assert isinstance(listed, list) and [r.path for r in listed] == [str(p) for p in one]
    assert sorted(p.name for p in (tmp_path / "saved").glob("*.jpg")) == [p.name for p in one]
    assert [len(r) for r in listed] == [len(r) for r in results[:2]]

    kept: list = []
    model.add_callback("on_export_end", lambda e: kept.append((e.format, e.path, all(r.passed for r in e.reports))))
    exported = model.export("torchscript", imgsz=64)
    assert exported.suffix == ".torchscript" and exported.exists()
    assert kept == [("torchscript", exported, True)]
    assert [len(r) for r in YOLO(exported).predict(one, imgsz=64)] == [len(r) for r in listed]


@pytest.mark.slow
def test_api_training_gives_the_weights_train_py_gives(tiny_data, tmp_path):
    cli = subprocess.run([PYTHON, "train.py", "--data", str(tiny_data), "--cfg", "models/yolov8n.yaml", *TINY_FLAGS,
                          "--project", str(tmp_path), "--name", "cli"], cwd=ROOT, env=run_env(), capture_output=True,
                         text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from yolotrain import YOLO; "
              f"YOLO('yolov8n.yaml').train(data={str(tiny_data)!r}, project={str(tmp_path)!r}, name='api', **{TINY!r})")
    api = subprocess.run([PYTHON, "-c", script], cwd=tmp_path, env=run_env(), capture_output=True, text=True,
                         timeout=600)
    assert api.returncode == 0, api.stderr[-3000:]
    a, b = (load_checkpoint(tmp_path / name / "weights" / "last.pt") for name in ("cli", "api"))
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys()
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key


@pytest.mark.slow
@pytest.mark.dist
def test_quickstart_script_runs_top_to_bottom(tiny_data, tmp_path):
    p = subprocess.run([PYTHON, "examples/quickstart.py", "--data", str(tiny_data), "--epochs", "1", "--imgsz", "64",
                        "--batch", "4", "--workers", "0", "--device", "cpu", "--project", str(tmp_path)],
                       cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for line in ("[callback] epoch 1/1", "trained: ", "trained on 2 ranks: ", "val: mAP50", "predict: ", "exported: "):
        assert line in p.stdout, line
    assert "CPU x 2 rank(s)" in p.stdout
    assert (tmp_path / "two-processes" / "weights" / "best.pt").exists()


@pytest.mark.slow
@pytest.mark.dist
def test_a_rank_s_error_is_raised_with_its_message(tmp_path, restore_logger):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(UserError, match=f"^{missing}: file not found$"):
        YOLO("yolov8n.yaml").train(data=str(missing), nproc=2, project=str(tmp_path))


@pytest.mark.slow
@pytest.mark.dist
def test_inside_torchrun_the_api_trains_on_that_group(tiny_data, tmp_path):
    p = run([*TORCHRUN, "tests/scripts/api_torchrun.py", tiny_data, tmp_path, tmp_path])
    assert "CPU x 2 rank(s)" in p.stdout
    best = tmp_path / "torchrun" / "weights" / "best.pt"
    assert [(tmp_path / f"result{r}").read_text() for r in (0, 1)] == [str(best)] * 2
    assert (tmp_path / "callback0").read_text() == str(best) and not (tmp_path / "callback1").exists()


def test_every_event_and_method_is_documented():
    text = (ROOT / "docs" / "python.md").read_text()
    assert [e for e in EVENTS if f"`{e}`" not in text] == []
    public = [m for m in vars(YOLO) if not m.startswith("_")]
    assert [m for m in public if f"`{m}" not in text] == []
