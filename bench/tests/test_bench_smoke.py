"""Every bench/ script run on the CPU at toy sizes, so that a broken bench fails CI instead of the next measurement.

Each test runs one script as a subprocess from the repo root (``python bench/<name>.py ...``) with the smallest
arguments that still go through its main path (64 px, one or two steps, batches or runs, a few generated images),
and checks what it promises to print: its rows are there and their figures parse. The figures themselves are toy
measurements on a busy machine and are not judged, except where a script states an invariant (equal mAPs, a shared
cache, a cache hit, bit-identical runs, byte-identical datasets).

bench/gpu_train.py has its own file (tests/test_bench_gpu_train.py); bench/convert_parity_shims.py is a helper
module, not a script. Scripts that compare with a peer tool run their ours-only mode here; their two-tool mode runs
only where an environment variable names the peer's interpreter (skipped otherwise):

    YOLOTRAIN_ULTRALYTICS_PYTHON   a python that can import ultralytics (8.4.190)
    YOLOTRAIN_YOLOV5_PYTHON        a python that can import yolov5 (7.0.14)

bench/photo_dataset.py fetches Debian packages: only what it does offline is run here (its refusals, and a build
from a filled package cache, YOLOTRAIN_PHOTO_CACHE or /tmp/photo_dataset_cache, when one holds all four packages).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, run_env

pytestmark = pytest.mark.bench  # `pytest bench/tests` (CI's second step), not the product's suite

NUM = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
COVERED = {"cache_memory", "coco128_val", "compare_ultralytics", "compare_yolov5", "convert_parity", "identity", "index_scale",
           "infer_speed", "loader_speed", "metrics_speed", "model_table", "photo_dataset", "scan_speed", "shared_cores", "step_cost", "step_launches", "storage_speed", "train_speed",
           "ultralytics_loader", "val_speed"}
NOT_SCRIPTS = {"convert_parity_shims": "helper module", "cocoeval": "helper module", "gpu_train": "tests/test_bench_gpu_train.py"}


def _bench(name: str, *args: object, python: str | None = None, env: dict | None = None, ok: bool = True,
           timeout: int = 300) -> subprocess.CompletedProcess:
    """``python bench/<name>.py args`` from the repo root; with ``ok`` it must exit 0."""
    p = subprocess.run([python or sys.executable, f"bench/{name}.py", *map(str, args)], cwd=ROOT,
                       env=env or run_env(), capture_output=True, text=True, timeout=timeout)
    if ok:
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def _line(text: str, pattern: str) -> re.Match:
    """The first line of ``text`` matching ``pattern`` (from the line's start)."""
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matches {pattern!r} in:\n{text[-3000:]}")


def _finite(*values: str | float) -> list[float]:
    out = [float(v) for v in values]
    assert all(math.isfinite(v) for v in out), values
    return out


def _peer_python(variable: str, module: str) -> str | None:
    """The interpreter named by ``variable`` when it can import ``module`` (found, not imported)."""
    python = os.environ.get(variable)
    if not python:
        return None
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except OSError:
        return None
    return python if ok else None


ULTRALYTICS_PYTHON = _peer_python("YOLOTRAIN_ULTRALYTICS_PYTHON", "ultralytics")
YOLOV5_PYTHON = _peer_python("YOLOTRAIN_YOLOV5_PYTHON", "yolov5")
needs_ultralytics = pytest.mark.skipif(ULTRALYTICS_PYTHON is None, reason="set YOLOTRAIN_ULTRALYTICS_PYTHON to a "
                                                                          "python that can import ultralytics")
needs_yolov5 = pytest.mark.skipif(YOLOV5_PYTHON is None,
                                  reason="set YOLOTRAIN_YOLOV5_PYTHON to a python that can import yolov5")


@pytest.fixture(scope="module")
def tiny_abs(tiny_data) -> Path:
    """tiny_data's dataset under a yaml with an absolute ``path:``: Ultralytics resolves a relative one against
    its own datasets folder, not the yaml's, so the loader benches that hand it the yaml need this one."""
    from yolotrain.utils.data.config import load_data_config, prepare_dataset

    prepare_dataset(load_data_config(tiny_data))
    text = tiny_data.read_text().replace("path: shapes", f"path: {tiny_data.parent / 'shapes'}")
    out = tiny_data.parent / "tiny_abs.yaml"
    out.write_text(text)
    return out


def test_every_bench_script_has_a_smoke_test():
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__"}
    assert scripts - set(NOT_SCRIPTS) == COVERED, "a bench script was added or removed: smoke it here"


# ---------------------------------------------------------------------------------------------- cache_memory


@pytest.mark.slow
def test_cache_memory_shares_one_mapping_between_ranks_and_workers(tmp_path):
    p = _bench("cache_memory", "--images", 8, "--img-size", 64, "--ranks", 2, "--workers", 1,
               "--root", tmp_path / "shapes")
    out = p.stdout
    m = _line(out, rf"cache file\s+: (\S+) \(({NUM}) MiB, 8 images at 64 px\)")
    assert not Path(m[1]).exists(), "the /dev/shm cache must be removed after the run"
    assert "processes         : 2 ranks x (1 + 1 workers) = 4, each read every image" in out
    pids = re.findall(rf"^\s+(rank|worker)\s+pid\s+\d+: PSS\s+({NUM}) MiB \(of which cache mapping\s+({NUM}) MiB\)",
                      out, re.M)
    assert sorted(k for k, *_ in pids) == ["rank", "rank", "worker", "worker"]
    assert all(v > 0 for _, pss, _ in pids for v in _finite(pss))
    share = _finite(_line(out, rf"cache-mapping PSS : ({NUM}) MiB summed over 4 processes = ({NUM}) x cache size")[2])
    assert share[0] < 1.5, "four processes mapping one file share its pages: about 1 x the cache, not ~4"
    _finite(_line(out, rf"total PSS / cache : ({NUM})  \(per-process copies would be ~4\)")[1])
    m = _line(out, rf"read speed\s+: cache\s+({NUM}) img/s, cv2.imread\+resize\s+({NUM}) img/s \(({NUM})x\)")
    assert all(v > 0 for v in _finite(m[1], m[2], m[3]))


# ---------------------------------------------------------------------------------------------- scan_speed


@pytest.mark.slow
def test_scan_speed_scans_then_hits_the_label_cache(tmp_path):
    p = _bench("scan_speed", "--root", tmp_path / "scan", "--n", 8, "--img-size", 64, "--workers", 1)
    out = p.stdout
    assert f"dataset: {tmp_path / 'scan'} (8 images, 64 px)" in out
    _finite(_line(out, rf"scan with 1 worker\(s\): ({NUM}) s")[1])
    row = _line(out, r"train\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)")  # the split summary: images, backgrounds, boxes, found
    assert int(row[1]) == 8 and int(row[3]) > 0
    m = _line(out, rf"first scan \(no cache\): ({NUM}) s \(({NUM}) images/s")
    assert _finite(m[1], m[2])[1] > 0  # the seconds print as 0.00 for 8 images
    _finite(_line(out, rf"cache load:\s+({NUM}) s \(({NUM}) images/s\)")[1])
    _finite(_line(out, rf"ratio scan / cache:\s+({NUM})x")[1])  # the script itself asserts the second load hit


# ---------------------------------------------------------------------------------------------- index_scale


@pytest.mark.slow
def test_index_scale_opens_a_synthetic_index_in_a_two_node_job(tmp_path):
    out = _bench("index_scale", "--images", 300, "--boxes", 2000, "--root", tmp_path, "--imgsz", 64).stdout
    assert "index: 300 images, 2,000 boxes" in out
    ranks = [_line(out, rf"\s+{r}\s+{r // 2}\s+({NUM})\s+({NUM})\s+({NUM})\s+(\d+)\s+(\d+)\s+(\d+)") for r in range(4)]
    assert all(int(m[4]) > 0 and int(m[5]) > 0 for m in ranks)  # RSS and PSS of each of the four ranks
    _finite(_line(out, rf"slowest rank to its first sample key: ({NUM}) s")[1])
    _line(out, rf"index mappings, PSS of all four ranks together: ({NUM}) MiB")


# ---------------------------------------------------------------------------------------------- step_cost


def test_step_cost_counts_each_rules_steps_from_the_plan():
    p = _bench("step_cost", "--images", 800, "--epochs", 30, "--batch-size", 16, 64, "--rules", "on", "off", 32)
    rows = {(int(m[1]), m[2]): (int(m[3]), int(m[4]), float(m[5]))
            for m in re.finditer(rf"^\s+(\d+)\s+(\w+)\s+(\d+)\s+(\d+)\s+({NUM})\s", p.stdout, re.M)}
    assert {rows[16, r][0] for r in ("on", "off", "32")} == {1500}  # a batch of 16 is one step under every rule
    assert (rows[64, "on"][0], rows[64, "32"][0], rows[64, "off"][0]) == (1500, 750, 390)  # 13 batches an epoch
    assert {v[1] for v in rows.values()} == {24000}  # the same images under every rule
    assert rows[64, "off"][2] < rows[64, "32"][2] < rows[64, "on"][2]


# ---------------------------------------------------------------------------------------------- storage_speed


@pytest.mark.slow
def test_storage_speed_reads_the_same_split_from_a_folder_shards_and_a_local_s3_server(tmp_path):
    pytest.importorskip("s3fs", reason="pip install -r requirements-s3.txt")
    pytest.importorskip("moto.server", reason="moto[server] runs the S3 server the bench reads from")
    out = _bench("storage_speed", "--root", tmp_path, "--imgsz", 64, "--workers", 0, 1, "--batches", 2).stdout
    assert "data: " in out and "(400 images," in out
    _finite(_line(out, rf"conversion: ({NUM}) s, ({NUM}) images/s")[2])
    _finite(*_line(out, rf"index open: local ({NUM}) ms; from the bucket ({NUM}) ms .* ({NUM}) ms")
            .groups())
    for w in (0, 1):
        m = _line(out, rf"\s+{w}" + rf"\s+({NUM}) \(({NUM})x\)" * 4)
        rates = _finite(*m.groups())
        assert all(r > 0 for r in rates) and rates[1] == 1.0  # the folder's ratio to itself


# ---------------------------------------------------------------------------------------------- metrics_speed


def test_metrics_speed_agrees_with_pycocotools():
    pytest.importorskip("pycocotools")
    out = _bench("metrics_speed", "--images", 20, "--classes", 3, "--seed", 1).stdout
    assert _line(out, r"20 images, 3 classes, (\d+) GT \(.*\), (\d+) detections")
    ours = _line(out, rf"ours:\s+match ({NUM})s \+ evaluate ({NUM})s = ({NUM})s\s+mAP50 ({NUM})\s+mAP50-95 ({NUM})")
    coco = _line(out, rf"pycocotools: evaluate\+accumulate ({NUM})s \(loading ({NUM})s not counted\)\s+"
                      rf"mAP50 ({NUM})\s+mAP50-95 ({NUM})")
    _finite(*ours.groups(), *coco.groups())
    assert 0 < float(ours[4]) <= 1 and float(ours[4]) == pytest.approx(float(coco[3]), abs=1e-6)
    assert float(ours[5]) == pytest.approx(float(coco[4]), abs=1e-6)
    diff = _line(out, rf"speed-up ({NUM})x;  \|diff\| mAP50 ({NUM})  mAP50-95 ({NUM})")
    assert max(_finite(diff[2], diff[3])) < 1e-9


# ---------------------------------------------------------------------------------------------- model_table


def _model_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"yolo\S+\s+(yes|no)\s", line)}


@pytest.mark.slow
def test_model_table_passes_the_reference_figures():
    p = _bench("model_table", "--models", "n,yolov8n,yolo26n")  # 640: the references' size
    rows = _model_rows(p.stdout)
    assert list(rows) == ["yolov5n", "yolov8n", "yolo26n"]
    assert rows["yolov5n"][1] == "yes" and rows["yolov8n"][1] == "no"  # v5: the fused published table
    for cells in rows.values():  # name fused params ref diff gflops ref diff result seconds
        _finite(cells[2], cells[3], cells[4], cells[5], cells[6], cells[7], cells[9])
        assert cells[8] == "PASS" and abs(float(cells[4])) <= 2 and abs(float(cells[7])) <= 2
    assert "all within tolerance" in p.stdout


@pytest.mark.slow
def test_model_table_exits_1_when_a_figure_is_outside_the_tolerance():
    p = _bench("model_table", "--models", "n", "--tol", "0", ok=False)  # yolov5n: -1.72% params, fused
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert _model_rows(p.stdout)["yolov5n"][8] == "FAIL" and "SOME MODELS OUTSIDE TOLERANCE" in p.stdout


def test_model_table_refuses_unknown_models():
    p = _bench("model_table", "--models", "yolov9n", ok=False)
    assert p.returncode == 2 and "unknown model(s) ['yolov9n']" in p.stderr


# ---------------------------------------------------------------------------------------------- infer_speed


@pytest.fixture(scope="module")
def fresh_weights(tmp_path_factory, one_thread) -> list[Path]:
    """Untrained checkpoints, no training: an end-to-end head (yolo26n) and an NMS one (yolov8n), 6 classes."""
    import torch

    from yolotrain.models.yolo import Model
    from yolotrain.utils.weights.checkpoint import fp32_state_dict, save_checkpoint, to_plain

    folder, paths = tmp_path_factory.mktemp("fresh"), []
    for name in ("yolo26n", "yolov8n"):
        torch.manual_seed(0)
        model = Model(ROOT / "models" / f"{name}.yaml", nc=6)
        paths.append(folder / f"{name}.pt")
        save_checkpoint({"model_yaml": to_plain(model.yaml), "model": fp32_state_dict(model), "args": {"imgsz": 64},
                         "names": [str(c) for c in range(6)]}, paths[-1])
    return paths


@pytest.mark.slow
def test_infer_speed_times_pytorch_and_onnx_runtime_end_to_end(fresh_weights):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    p = _bench("infer_speed", "--weights", *fresh_weights, "--imgsz", 64, "--warmup", 0, "--runs", 2, "--rounds", 1,
               "--threads", 1, "--end-to-end")
    out = p.stdout
    assert _line(out, r"CPU: .+; 1 torch threads; native bf16: (yes|no)$")
    assert "batch 1, median of 2 runs after 0 warmup, in 1 interleaved rounds, ms per image; image 480x640 " \
           "(synthetic, seed 0)" in out
    rows = re.findall(rf"^(yolo26n|yolov8n) (PyTorch|ONNX Runtime)\s+(e2e|NMS)\s+64\s+({NUM})\s+({NUM})\s+(\d+)"
                      rf"\s+({NUM})x\s+({NUM})x$", out, re.M)
    assert [(r[0], r[1], r[2]) for r in rows] == [("yolo26n", "PyTorch", "e2e"), ("yolo26n", "ONNX Runtime", "e2e"),
                                                  ("yolov8n", "PyTorch", "NMS"), ("yolov8n", "ONNX Runtime", "NMS")]
    for model, backend, _, fwd, e2e, _dets, ratio, speed in rows:
        assert min(_finite(fwd, e2e, ratio, speed)) > 0
        assert model != "yolo26n" or float(ratio) == 1.0  # the first --weights is the ratios' base
        assert backend != "PyTorch" or float(speed) == 1.0


# ---------------------------------------------------------------------------------------------- loader_speed


LOADERS = ["ours", "ours, device path (workers read)", "ours, --cache ram",
           "ours, device path (workers read), --cache ram"]
STAGES = ["read+decode", "plan", "placement", "warp", "colour", "flip", "assembly", "total",
          "device path: workers (plan, read, pack)", "device path: render on cpu"]
HANDOVER = ["worker -> main (reused memory)", "worker -> main (fresh memory)"]


def _loader_speed(data: Path, tmp_path: Path, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "loader.json"
    p = _bench("loader_speed", "--data", data, "--imgsz", 64, "--batch", 4, "--batches", 1, "--workers", 0, 1,
               "--cache", "none", "ram", "--json", out, *extra)
    return p.stdout, json.loads(out.read_text())


def _check_loader_report(out: str, report: dict, peer: bool) -> None:
    assert "64 px, batch 4" in out
    rates = re.findall(rf"^  (ours.*?)\s+([01])\s+({NUM})\s+(-|{NUM})\s*({NUM}x)?$", out, re.M)
    assert sorted((name, int(w)) for name, w, *_ in rates) == sorted((n, w) for n in LOADERS for w in (0, 1))
    for _, _, img_s, ultra, ratio in rates:
        assert _finite(img_s)[0] > 0
        assert (ultra != "-" and ratio) if peer else (ultra == "-" and not ratio)
    for label in STAGES + HANDOVER:
        assert _finite(_line(out, rf"  {re.escape(label)}\s+({NUM})$")[1])[0] >= 0, label
    (res,) = report["results"]
    assert (res["imgsz"], res["batch"]) == (64, 4) and len(res["rates"]) == 8
    assert set(res["stages_ms"]) == set(STAGES) and set(res["handover_ms"]) == set(HANDOVER)
    assert all((r["ultralytics_img_s"] is not None) == peer for r in res["rates"])


@pytest.mark.slow
def test_loader_speed_ours_every_loader_stage_and_hand_over(tiny_data, tmp_path):
    out, report = _loader_speed(tiny_data, tmp_path)
    _check_loader_report(out, report, peer=False)
    assert "ultralytics:" not in out


@pytest.mark.slow
@needs_ultralytics
def test_loader_speed_beside_ultralytics_loader(tiny_abs, tmp_path):
    out, report = _loader_speed(tiny_abs, tmp_path, "--ultralytics-python", ULTRALYTICS_PYTHON)
    _check_loader_report(out, report, peer=True)
    for stage in ("imread", "Mosaic.placement", "RandomPerspective", "RandomHSV", "collate", "total.loader"):
        assert _line(out, rf"  ultralytics: {re.escape(stage)}\S*\s+({NUM})$"), stage
    assert _line(out, rf"  ultralytics: decodes per sample ({NUM}); ours: 1 read per image")


# ---------------------------------------------------------------------------------------------- ultralytics_loader


@pytest.mark.slow
@needs_ultralytics
def test_ultralytics_loader_measures_rates_stages_and_decodes(tiny_abs, tmp_path):
    env = run_env()
    env.pop("PYTHONPATH")  # Ultralytics' interpreter, never this repo on its path
    out_json = tmp_path / "ul.json"
    p = _bench("ultralytics_loader", "--data", tiny_abs, "--imgsz", 64, "--batch", 4, "--workers", 0, 1,
               "--batches", 1, "--warmup", 1, "--sim-epochs", 1, "--workdir", tmp_path / "scratch", "--json", out_json,
               python=ULTRALYTICS_PYTHON, env=env)
    out, res = p.stdout, json.loads(out_json.read_text())
    assert _line(out, r"Ultralytics 8\.\S+ training loader: imgsz 64, batch 4, device cpu")
    rows = re.findall(rf"^\s+([01])\s+(\d+)\s+({NUM})\s+({NUM})\s+(True|False)", out, re.M)
    assert [r[0] for r in rows] == ["0", "1"] and all(_finite(r[2])[0] > 0 for r in rows)
    assert set(res["rates"]) == {"0", "1"} and all(v > 0 for v in res["rates"].values())
    assert res["effective_workers"]["0"] == 0
    for stage in ("imread", "Mosaic.placement", "RandomPerspective", "RandomHSV", "Format", "collate",
                  "preprocess_batch"):
        assert res["stages_ms"][stage] >= 0 and _line(out, rf"  {re.escape(stage)}\s+({NUM}) ms"), stage
    assert res["decodes_per_sample"] > 0 and set(res["decodes_sim"]) == {"0", "1"}
    assert _line(out, r"simulated decodes per sample, epochs 1\.\.1: W=0: \S+, W=1: \S+")
    assert not list((tiny_abs.parent / "shapes" / "labels").glob("*.cache")), "it must mirror the split, not write " \
                                                                              "Ultralytics' label cache into it"


# ---------------------------------------------------------------------------------------------- step_launches
def _launch_rows(text: str, model: str, tools: int) -> dict[str, list[int]]:
    rows = {}
    for phase in ("forward", "loss", "backward", "optimizer", "total"):
        m = _line(text, rf"{model}\s+{phase}\s+" + r"\s+".join([r"(\d+)"] * tools))
        rows[phase] = [int(v) for v in m.groups()]
    return rows


def test_step_launches_counts_every_phase_of_a_step(tmp_path):
    p = _bench("step_launches", "--models", "yolov8n", "--batch", 2, "--json", tmp_path / "l.json")
    rows = _launch_rows(p.stdout, "yolov8n", 1)
    assert all(rows[phase][0] > 0 for phase in rows)
    assert rows["total"][0] == sum(rows[phase][0] for phase in ("forward", "loss", "backward", "optimizer"))
    assert json.loads((tmp_path / "l.json").read_text())["results"]["ours"]["yolov8n"]["loss"]["launches"] == \
        rows["loss"][0]


@needs_ultralytics
def test_step_launches_beside_ultralytics():
    p = _bench("step_launches", "--models", "yolov8n", "--batch", 2, "--ultralytics-python", ULTRALYTICS_PYTHON)
    rows = _launch_rows(p.stdout, "yolov8n", 2)
    assert all(ours > 0 and theirs > 0 for ours, theirs in rows.values())


# ---------------------------------------------------------------------------------------------- train_speed

PHASES = ["data", "prep", "forward", "loss", "nan-check", "backward", "optim"]


@pytest.mark.slow
def test_train_speed_times_both_families_in_both_layouts(tiny_data, tmp_path):
    out_json = tmp_path / "train.json"
    p = _bench("train_speed", "--models", "n", "yolov8n", "--imgsz", 64, "--batch-size", 4, "--warmup", 1, "--steps",
               1, "--accumulate", 1, "--device", "cpu", "--workers", 0, "--threads", 1, "--data", tiny_data,
               "--ref-seconds", 0.05, "--both-layouts", "--json", out_json)
    out = p.stdout
    configs = re.findall(rf"^(yolov5n|yolov8n) 64px (NCHW|NHWC) (fp32|bf16): ({NUM}) img/s; reference \(1 threads x 1 "
                         rf"rank\(s\), fp32\): matmul ({NUM}) GFLOP/s, 3x3 conv ({NUM}) GFLOP/s$", out, re.M)
    assert [c[:2] for c in configs] == [("yolov5n", "NCHW"), ("yolov5n", "NHWC"), ("yolov8n", "NCHW"),
                                        ("yolov8n", "NHWC")]
    assert all(min(_finite(*c[3:])) > 0 for c in configs)
    assert "batch 4 global, accumulate 1, 1 timed steps after warm-up" in out
    table = re.findall(rf"^(yolov5n|yolov8n)\s+(NCHW|NHWC)\s+\S+\s+64\s+1\s+1\s+0\s+({NUM}) \|((?:\s+{NUM}ms){{8}}) \|"
                       rf"\s+({NUM})\s+({NUM})\s+({NUM})%\s+({NUM})%\s+({NUM})$", out, re.M)
    assert len(table) == 4
    assert len(re.findall(r"^\s+share \|(?:\s+[\d.]+%){7}$", out, re.M)) == 4
    speedups = re.findall(rf"^  (yolov5n|yolov8n) 64px x1 NHWC \S+: ({NUM})x$", out, re.M)
    assert "NHWC (channels-last) speed-up over NCHW, same run:" in out and len(speedups) == 2
    results = json.loads(out_json.read_text())
    assert [(r["model"], r["layout"]) for r in results] == [c[:2] for c in configs]
    for r in results:
        assert (r["steps"], r["accumulate"], r["batch"], r["workers"], r["threads"]) == (1, 1, 4, 0, 1)
        assert list(r["ms"]) == PHASES and all(v >= 0 for v in r["ms"].values())
        assert r["img_s"] > 0 and r["train_gflops_per_img"] > 0 and 0 < r["mfu_matmul"] and 0 < r["mfu_conv"]


# ---------------------------------------------------------------------------------------------- val_speed

VAL_PARTS = ["set-up", "data wait", "pre-process", "inference", "NMS", "matching", "evaluate", "other", "plots"]


def test_shared_cores_times_two_runs_beside_one_alone(tiny_data):
    out = _bench("shared_cores", "--data", tiny_data, "--imgsz", 64, "--batch-size", 4, "--epochs", 1,
                 "--stagger", 0, "--modes", "alone", "default", "--extra", "--workers", 0).stdout
    _finite(_line(out, rf"alone +({NUM}) s$")[1])
    m = _line(out, rf"default +({NUM}) s first, +({NUM}) s second +\(({NUM})x, ({NUM})x alone\)$")
    assert all(v > 0 for v in _finite(*m.groups()))


@pytest.mark.slow
def test_val_speed_times_every_part_of_val_py(tiny_data):
    p = _bench("val_speed", "--data", tiny_data, "--imgsz", 64, "--batch-size", 4, "--workers", 0, "--device", "cpu",
               "--runs", 2)
    out = p.stdout
    assert _line(out, r"val\.py --weights \S+fresh_yolov5n\.pt --data ")
    for k in (1, 2):
        m = _line(out, rf"run {k}: 8 images, end-to-end ({NUM})s = ({NUM}) img/s "
                       rf"\(evaluate_model alone ({NUM}) img/s\); mAP50 ({NUM}) mAP50-95 ({NUM})$")
        assert min(_finite(m[1], m[2], m[3])) > 0 and 0 <= float(m[5]) <= float(m[4]) <= 1
    for part in VAL_PARTS:  # n/a would mean val.py no longer calls a name the bench wraps
        rows = re.findall(rf"^  {re.escape(part)}\s+({NUM})s\s+({NUM}) ms/img\s+({NUM})%$", out, re.M)
        assert len(rows) == 2, f"{part}: {rows}"
        _finite(*(v for r in rows for v in r))
    assert "n/a" not in out
    assert all(float(v) > 0 for v in re.findall(rf"^  plots\s+({NUM})s", out, re.M))  # plots on: timed


# ---------------------------------------------------------------------------------------------- compare_ultralytics

ULTRA_TIME_ROWS = ["train s/epoch (steady)", "val s/epoch (steady)", "set-up s (start -> epoch 1)",
                   "whole training run s", "val.py ms/img pre-process", "val.py ms/img inference", "val.py ms/img NMS"]
ULTRA_OTHER_ROWS = ["train img/s (steady)", "peak RSS train MiB", "peak RSS val MiB", "mAP50-95 (own validator)",
                    "mAP50 (own validator)", "mAP50-95 (COCOeval, both)", "mAP50 (COCOeval, both)", "detections scored",
                    "parameters", "epochs with mosaic"]
ULTRA_ARGS = ["--epochs", 1, "--imgsz", 64, "--batch-size", 4, "--val-batch-size", 4, "--threads", 1, "--n-train", 8,
              "--n-val", 4]


def _table(out: str, labels: list[str], width: int) -> dict[str, list[str]]:
    """Each labelled row's cells (``width``: the label column), the label itself left out."""
    rows = {}
    for line in out.splitlines():
        for label in labels:
            if line.startswith(label) and line[len(label):width].strip() == "":
                rows[label] = line[width:].split()
    assert set(rows) == set(labels), set(labels) - set(rows)
    return rows


def _check_compare_ultralytics(out: str, peer: bool) -> None:
    assert _line(out, r"yolov8n, \S+: 8 train / 4 val images, 64px, batch 4, 1 epoch\(s\), seed 0, 1 threads, CPU; "
                      r"best of 1 round\(s\)(; ours with \S.*)?$")
    rows = _table(out, ULTRA_TIME_ROWS + ULTRA_OTHER_ROWS, 31)
    for label, cells in rows.items():
        ours = _finite(cells[0].replace(",", ""))[0]
        assert ours >= 0, label
        if peer:
            assert _finite(cells[1].replace(",", ""))[0] >= 0, label
        else:
            assert cells[1:] == ["-"], label
    for label in ULTRA_TIME_ROWS[:2] + ["train img/s (steady)", "peak RSS train MiB"]:
        assert float(rows[label][0]) > 0
    for label in ULTRA_OTHER_ROWS[3:7]:
        assert 0 <= float(rows[label][0]) <= 1
    if peer:
        assert rows["parameters"][0] == rows["parameters"][1]  # the same architecture in both tools
        for label in ULTRA_TIME_ROWS[:2] + ["peak RSS train MiB"]:
            assert re.fullmatch(rf"{NUM}x", rows[label][2]), label
    workers = _table(out, ["workers (train, val, val.py)", "torch threads (train, val.py)"], 31)
    assert " ".join(workers["workers (train, val, val.py)"]).startswith("0, 0, 0")
    assert " ".join(workers["torch threads (train, val.py)"]).startswith("1, 1")
    tools = ["ours", "ultralytics"] if peer else ["ours"]
    for tool in tools:
        assert _line(out, rf"{tool}: optimizer \S+ lr \S+ momentum/beta1 \S+; train s \[{NUM}\], val s \[{NUM}\]")
    assert ("ultralytics: optimizer" in out) == peer


@pytest.mark.slow
def test_compare_ultralytics_ours_only(tiny_data, tmp_path):
    # --ultralytics-python is required even with --only ours: any existing file does
    p = _bench("compare_ultralytics", "--ultralytics-python", sys.executable, "--only", "ours", "--data", tiny_data,
               *ULTRA_ARGS, "--workdir", tmp_path / "work", "--ours-args=--cos-lr")
    _check_compare_ultralytics(p.stdout, peer=False)
    runs = json.loads((tmp_path / "work" / "results.json").read_text())
    assert list(runs) == ["ours"] and len(runs["ours"]) == 1 and runs["ours"][0]["n_train"] == 8
    assert "; ours with --cos-lr" in p.stdout  # the extra flags reach train.py and the report says so
    run_opt = yaml.safe_load((tmp_path / "work" / "ours" / "round0" / "runs" / "train" / "opt.yaml").read_text())
    assert run_opt["cos_lr"] is True


@pytest.mark.slow
@needs_ultralytics
def test_compare_ultralytics_both_tools(tiny_data, tmp_path):
    p = _bench("compare_ultralytics", "--ultralytics-python", ULTRALYTICS_PYTHON, "--data", tiny_data, *ULTRA_ARGS,
               "--workdir", tmp_path / "work")
    _check_compare_ultralytics(p.stdout, peer=True)
    runs = json.loads((tmp_path / "work" / "results.json").read_text())
    assert list(runs) == ["ours", "ultralytics"]


# ---------------------------------------------------------------------------------------------- compare_yolov5

V5_ROWS = ["train s/epoch (steady)", "train img/s (steady)", "val s/epoch (steady)", "val img/s (in training)",
           "set-up s (start -> epoch 1)", "whole training run s", "val.py s (load -> results)", "val.py img/s",
           "val.py ms/img pre-process", "val.py ms/img inference", "val.py ms/img NMS", "val.py mAP50-95 (sanity)"]
V5_ARGS = ["--epochs", 1, "--imgsz", 64, "--batch-size", 4, "--val-batch-size", 4, "--workers", 0, "--n-train", 8,
           "--n-val", 4]


def _check_compare_yolov5(out: str, peer: bool) -> None:
    assert "yolov5n, 8 train / 4 val images, 64px, batch 4, 1 epoch(s), workers 0, seed 0, CPU; best of 1 round(s)" \
        in out
    rows = _table(out, V5_ROWS, 31)
    for label, cells in rows.items():
        assert _finite(cells[0])[0] >= 0, label
        if peer:
            assert _finite(cells[1])[0] >= 0, label
        else:
            assert cells[1:] == ["-"], label
    for label in ("train s/epoch (steady)", "train img/s (steady)", "val.py s (load -> results)"):
        assert float(rows[label][0]) > 0
    assert 0 <= float(rows["val.py mAP50-95 (sanity)"][0]) <= 1
    threads = _table(out, ["torch threads (train, val.py)"], 31)["torch threads (train, val.py)"]
    assert re.fullmatch(r"\d+, \d+", " ".join(threads[:2]))
    assert _line(out, rf"ours \(best per epoch\): train s \[{NUM}\], val s \[{NUM}\], validation after training {NUM}s")
    assert ("yolov5 (best per epoch)" in out) == peer


@pytest.mark.slow
def test_compare_yolov5_ours_only(tmp_path):
    # the built-in shapes set (data/shapes.yaml, generated into datasets/ on first use) is its only dataset;
    # --yolov5-python is required even with --only ours: any existing file does
    p = _bench("compare_yolov5", "--yolov5-python", sys.executable, "--only", "ours", *V5_ARGS,
               "--work-dir", tmp_path / "work")
    _check_compare_yolov5(p.stdout, peer=False)
    assert list(json.loads((tmp_path / "work" / "results.json").read_text())) == ["ours"]


@pytest.mark.slow
@needs_yolov5
def test_compare_yolov5_both_tools(tmp_path):
    p = _bench("compare_yolov5", "--yolov5-python", YOLOV5_PYTHON, *V5_ARGS, "--work-dir", tmp_path / "work")
    _check_compare_yolov5(p.stdout, peer=True)


# ---------------------------------------------------------------------------------------------- convert_parity

PARITY_ARGS = ["--epochs", 1, "--imgsz", 64, "--batch-size", 4, "--n-train", 8, "--n-val", 4]


@pytest.mark.slow
def test_convert_parity_needs_the_package_of_every_model(tmp_path):
    # no ours-only mode: every checkpoint it compares is made by the package; a missing interpreter stops it first
    missing = tmp_path / "no-venv" / "python"
    p = _bench("convert_parity", "--models", "yolov8n", "--ultralytics-python", missing, ok=False)
    assert p.returncode == 1 and f"--ultralytics-python {missing}: not found" in p.stderr
    p = _bench("convert_parity", "--models", "yolov5n", "--yolov5-python", missing, ok=False)
    assert p.returncode == 1 and f"--yolov5-python {missing}: not found" in p.stderr


def _check_parity(out: str, model: str, tools: tuple[str, str]) -> None:
    rows = re.findall(rf"^{model}\s+(epoch\d+\.pt|last\.pt)\s+(ema|model)\s+(\d+)\s+({NUM})\s+({NUM})\s+({NUM})"
                      rf"\s+({NUM})\s+(ok|DIFFERENT)$", out, re.M)
    assert [r[0] for r in rows] == ["epoch0.pt", "last.pt"], out[-3000:]
    for _, weights, tensors, *diffs, verdict in rows:
        assert int(tensors) > 0 and max(_finite(*diffs)) <= 1e-4 and verdict == "ok"
    for tool in tools:
        m = _line(out, rf"(?:{model})?\s+{tool}\s+({NUM})\s+({NUM})\s+({NUM})\s+({NUM})$")
        assert all(0 <= v <= 1 for v in _finite(*m.groups())), tool
    assert _line(out, rf"\s+difference\s+({NUM})\s+({NUM})\s+({NUM})\s+({NUM})$")


@pytest.mark.slow
@needs_ultralytics
def test_convert_parity_ultralytics_checkpoints(tmp_path):
    p = _bench("convert_parity", "--models", "yolov8n", *PARITY_ARGS, "--ultralytics-python", ULTRALYTICS_PYTHON,
               "--work-dir", tmp_path / "work")
    assert "2 checkpoint files, trained 1 epoch(s) from scratch on 8 shapes images at 64 px" in p.stdout
    _check_parity(p.stdout, "yolov8n", ("ultralytics", "yolotrain"))


@pytest.mark.slow
@needs_yolov5
def test_convert_parity_yolov5_checkpoints(tmp_path):
    p = _bench("convert_parity", "--models", "yolov5n", *PARITY_ARGS, "--yolov5-python", YOLOV5_PYTHON,
               "--work-dir", tmp_path / "work")
    _check_parity(p.stdout, "yolov5n", ("yolov5", "yolotrain"))


# ---------------------------------------------------------------------------------------------- coco128_val

COCO128 = ROOT.parent / "shared" / "data" / "coco128" / "coco128.yaml"
YOLOV5N = ROOT.parent / "shared" / "weights" / "yolov5n.pt"


def test_coco128_val_needs_its_files(tmp_path):
    data = tmp_path / "none.yaml"
    p = _bench("coco128_val", "--data", data, "--weights", tmp_path / "w.pt", "--yolov5-python", tmp_path / "python",
               ok=False)
    assert p.returncode == 1 and f"{data}: not found" in p.stderr


@pytest.mark.slow
@needs_yolov5
def test_coco128_val_both_validators_agree(tmp_path):
    if not (COCO128.is_file() and YOLOV5N.is_file()):
        pytest.skip(f"no COCO128 and yolov5n.pt in {ROOT.parent / 'shared'} (real data and weights are not shipped)")
    out = tmp_path / "figures.json"
    _bench("coco128_val", "--data", COCO128, "--weights", YOLOV5N, "--yolov5-python", YOLOV5_PYTHON, "--work-dir",
           tmp_path / "work", "--out", out, timeout=1200)
    figures = json.loads(out.read_text())
    assert figures["images"] == 128 and figures["boxes"] == 898
    ours, theirs = figures["yolotrain"], figures["yolov5"]
    assert abs(ours["coco_map"] - theirs["coco_map"]) < 1e-3 and abs(ours["coco_map50"] - theirs["coco_map50"]) < 1e-3
    assert abs(ours["detections"] - theirs["detections"]) < 0.01 * theirs["detections"]


# ---------------------------------------------------------------------------------------------- identity


@pytest.mark.slow
def test_identity_one_run_twice_is_identical_and_compare_reports_differences(tmp_path):
    # --only v8n-time: the cheapest of its six runs (the --time budget ends it after one epoch)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        p = _bench("identity", "--only", "v8n-time", "--out", out)
        assert p.stdout.strip() == "v8n-time: done"
    digests = json.loads(a.read_text())
    assert list(digests) == ["v8n-time"]
    run = digests["v8n-time"]
    assert set(run) == {"results.csv", "last.pt", "best.pt"} and run["results.csv"].startswith("epoch,")
    for name in ("last.pt", "best.pt"):
        assert run[name]["epoch"] == 0 and run[name]["metrics"]["n_images"] == 8
        tensors = run[name]["tensors"]
        assert any(k.startswith("/model/") for k in tensors) and any(k.startswith("/ema/") for k in tensors)
        assert all(re.fullmatch(r"[0-9a-f]{64}", v) for v in tensors.values())

    p = _bench("identity", "--compare", a, b)  # the same checkout twice: bit-identical
    assert p.stdout.startswith("identical: v8n-time")

    changed = json.loads(a.read_text())
    key = sorted(changed["v8n-time"]["last.pt"]["tensors"])[0]
    changed["v8n-time"]["last.pt"]["tensors"][key] = "0" * 64
    changed["v8n-time"]["results.csv"] += "1,\n"
    changed["v8n-other"] = changed["v8n-time"]
    c = tmp_path / "c.json"
    c.write_text(json.dumps(changed))
    p = _bench("identity", "--compare", a, c, ok=False)
    assert p.returncode == 1
    n = len(run["last.pt"]["tensors"])
    assert p.stdout.splitlines() == ["v8n-other: only in the second", "v8n-time: results.csv differs",
                                     f"v8n-time last.pt: 1 of {n} tensors differ, e.g. ['{key}']"]


# ---------------------------------------------------------------------------------------------- photo_dataset

PHOTO_PACKAGES = ("tuxpaint-stamps-default", "tuxpaint-data", "mate-backgrounds", "plasma-workspace-wallpapers")


def _photo_cache() -> Path | None:
    """A package cache holding all four .debs (nothing to fetch), else None."""
    cache = Path(os.environ.get("YOLOTRAIN_PHOTO_CACHE", Path(tempfile.gettempdir()) / "photo_dataset_cache"))
    ok = all(list((cache / "debs").glob(f"{p}_*.deb")) for p in PHOTO_PACKAGES)
    return cache if ok else None


@pytest.mark.parametrize("args, message", [
    (["--n-train", "0"], "--n-train"),
    (["--imgsz", "32"], "--imgsz"),
])
def test_photo_dataset_refuses_bad_flags(args, message, tmp_path):
    p = _bench("photo_dataset", "--out", tmp_path / "out", *args, ok=False)
    assert p.returncode == 2 and message in p.stderr and not (tmp_path / "out").exists()


def test_photo_dataset_needs_an_out_folder():
    p = _bench("photo_dataset", ok=False)
    assert p.returncode == 2 and "--out" in p.stderr


def test_photo_dataset_never_replaces_a_folder_it_did_not_make(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    p = _bench("photo_dataset", "--out", out, "--cache", tmp_path / "empty-cache", ok=False)
    assert p.returncode == 1 and "exists and was not made by bench/photo_dataset.py" in p.stderr
    assert [f.name for f in out.iterdir()] == ["keep.txt"] and not (tmp_path / "empty-cache").exists()


def test_photo_dataset_reads_its_cache_before_fetching(tmp_path):
    # a cached .deb is used as it is, no apt-get: a broken one is reported, offline
    debs = tmp_path / "cache" / "debs"
    debs.mkdir(parents=True)
    (debs / "tuxpaint-stamps-default_1.0_all.deb").write_bytes(b"not an ar archive")
    p = _bench("photo_dataset", "--out", tmp_path / "out", "--cache", tmp_path / "cache", ok=False)
    assert p.returncode == 1 and "tuxpaint-stamps-default_1.0_all.deb: not a .deb archive" in p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(_photo_cache() is None, reason="no filled package cache (YOLOTRAIN_PHOTO_CACHE or "
                                                   "/tmp/photo_dataset_cache with all four .debs); building needs one "
                                                   "or the network")
@pytest.mark.parametrize("object_set, head, tail", [("1", "0:bird, 1:fish", "10:instrument"),
                                                     ("2", "0:mammal, 1:hoofed", "10:small_tool")])
def test_photo_dataset_builds_from_its_cache_byte_identically(object_set, head, tail, tmp_path):
    out = tmp_path / "photo"
    args = ["--out", out, "--n-train", 2, "--n-val", 2, "--imgsz", 64, "--seed", 3, "--cache", _photo_cache(),
            "--object-set", object_set]

    def files() -> dict[str, str]:
        return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(out.rglob("*")) if f.is_file()}

    p = _bench("photo_dataset", *args)
    first = files()
    text = p.stdout
    assert _line(text, rf"wrote {re.escape(str(out))} in {NUM} s \(2 train \+ 2 val images, imgsz 64, seed 3\)$")
    assert f"object set {object_set}, classes: {head}" in text and tail in text
    per_class = re.findall(r"^  (\w+)\s+(\d+) / (\d+)$", text, re.M)  # photos per class: train / val instances
    assert len(per_class) == 11 and all(int(t) > 0 and int(v) > 0 for _, t, v in per_class)
    assert _line(text, r"background photos: [1-9]\d* train / [1-9]\d* val$")
    for split in ("train", "val"):
        m = _line(text, rf"{split}: 2 images, (\d+) boxes; boxes/image mean ({NUM})")
        assert len(list((out / "images" / split).glob("*.jpg"))) == 2 and len(list((out / "labels" / split).glob(
            "*.txt"))) == 2
        _finite(m[2])
    assert _line(text, r"packages: mate-backgrounds \S+ \(GPL-2\+\), plasma-workspace-wallpapers")
    assert f"data yaml: {out / 'data.yaml'}" in text
    manifest = json.loads((out / "photo_dataset.json").read_text())
    assert (manifest["generator"], manifest["seed"], manifest["n_train"], manifest["n_val"], manifest["imgsz"]) == \
        ("bench/photo_dataset.py", 3, 2, 2, 64) and set(manifest["packages"]) == set(PHOTO_PACKAGES)

    _bench("photo_dataset", *args)  # its own folder: replaced, and the same seed gives the same bytes
    assert files() == first
