"""YOLOv5 / Ultralytics checkpoints: converted exactly, and read without running anything in them.

The checkpoints are crafted here, without either package: stand-in classes at the packages' real
module and class paths are written to a temp folder and a separate process (tests/scripts/
craft_foreign.py) pickles models built from them with torch.save, as the packages do. Every
stand-in module records its import and every class its ``__setstate__`` in a marker folder, so
the tests can prove the reader used none of them; the hostile files carry payloads that would
create a file if anything ran them.
"""
from __future__ import annotations

import collections
import copy
import io
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from yolotrain.models.heads.base import Head
from yolotrain.models.yolo import Model
from tests.helpers import PYTHON, ROOT, run_env
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.weights.checkpoint import load_checkpoint, load_model
from yolotrain.utils.weights.convert.foreign import ULTRALYTICS, YOLOV5
from yolotrain.utils.weights.convert.reader import Archive, ReadError
from yolotrain.utils.engine.setup import transfer_weights

pytestmark = pytest.mark.usefixtures("one_thread")
NAMES = ["cat", "dog", "bird"]
STANDIN_HEADER = '''import os
from pathlib import Path

from torch import nn

if os.environ.get("FOREIGN_MARKERS"):
    Path(os.environ["FOREIGN_MARKERS"], "imported-" + __name__).touch()


class _Module(nn.Module):
    def __setstate__(self, state):
        if os.environ.get("FOREIGN_MARKERS"):
            Path(os.environ["FOREIGN_MARKERS"], "setstate-" + type(self).__name__).touch()
        super().__setstate__(state)
'''
STANDIN_MODULES = {
    "models/yolo.py": ["DetectionModel", "Model", "Detect"],
    "models/common.py": ["Conv", "C3", "Bottleneck", "SPPF", "Concat", "Focus"],
    "yolov5/models/yolo.py": ["DetectionModel", "Model", "Detect"],
    "yolov5/models/common.py": ["Conv", "C3", "Bottleneck", "SPPF", "Concat"],
    "ultralytics/nn/tasks.py": ["DetectionModel", "SegmentationModel"],
    "ultralytics/nn/modules/conv.py": ["Conv", "DWConv", "Concat"],
    "ultralytics/nn/modules/block.py": ["C2f", "C3", "C3k", "C3k2", "C2PSA", "PSABlock", "Attention", "SPPF",
                                        "Bottleneck", "DFL"],
    "ultralytics/nn/modules/head.py": ["Detect", "Segment"],
}
V5_CLASSES = {"Model": "yolo.DetectionModel", "Detect": "yolo.Detect",
              **{k: f"common.{k}" for k in ("Conv", "C3", "Bottleneck", "SPPF", "Concat")}}
UL_CLASSES = {"Model": "tasks.DetectionModel", "DFLDetect": "modules.head.Detect",
              **{k: f"modules.conv.{k}" for k in ("Conv", "DWConv", "Concat")},
              **{k: f"modules.block.{k}" for k in ("C2f", "C3", "C3k", "C3k2", "C2PSA", "PSABlock", "Attention",
                                                   "SPPF", "Bottleneck", "DFL")}}


# ----------------------------------------------------------------------------------------------
# crafting


def write_standins(root: Path) -> Path:
    """The stand-in packages: every module marks its import, every class its __setstate__."""
    for rel, classes in STANDIN_MODULES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(STANDIN_HEADER + "".join(f"\n\nclass {c}(_Module):\n    pass\n" for c in classes))
        for parent in path.relative_to(root).parents:
            if parent != Path("."):
                init = root / parent / "__init__.py"
                if not init.exists():
                    init.write_text(STANDIN_HEADER)
    (root / "evil_mod.py").write_text(STANDIN_HEADER + "\n\nclass Payload:\n    pass\n")
    return root


def foreign_yaml(model: Model, package: str, yaml_file: str) -> dict:
    """The model yaml as the package stores it: YOLOv5's is our schema; Ultralytics' names its head
    Detect [nc] and keeps the file name and channel count."""
    d = copy.deepcopy(model.yaml)
    if package == YOLOV5:
        return d
    d["head"] = [*d["head"][:-1], [d["head"][-1][0], 1, "Detect", ["nc"]]]
    d["yaml_file"] = yaml_file
    d["channels"] = d.pop("ch")
    return d


def fp16(t: torch.Tensor) -> torch.Tensor:
    """How both packages save weights: floating tensors in half precision."""
    return t.detach().half() if t.is_floating_point() else t.detach()


def make_spec(model: Model, package: str, yaml_file: str, prefix: str = "", ckpt: dict | None = None,
              weights: str = "model", ema_offset: float = 0.0) -> dict:
    """A plain description of ``model`` as the package would pickle it (fp16, the head's stride an attribute)."""
    classes = V5_CLASSES if package == YOLOV5 else UL_CLASSES
    base = f"{prefix}models." if package == YOLOV5 else "ultralytics.nn."
    entries = []
    for path, m in model.named_modules():
        kind = type(m).__name__
        cls = f"{type(m).__module__}.{kind}" if type(m).__module__.startswith("torch.") else base + classes[kind]
        params = {k: None if v is None else fp16(v) for k, v in m._parameters.items()}
        buffers = {k: fp16(v) for k, v in m._buffers.items() if v is not None}
        attrs = {k: v for k, v in vars(m).items() if not k.startswith("_") and k not in ("training", "source")}
        if isinstance(m, Head):
            attrs["stride"] = buffers.pop("stride").float()
        if path == "":
            attrs.update(yaml=foreign_yaml(model, package, yaml_file), names=dict(enumerate(NAMES)),
                         stride=model.stride.clone(), nc=len(NAMES))
        entries.append({"path": path, "cls": cls, "params": params, "buffers": buffers, "attrs": attrs})
    top = {"epoch": -1, "date": "2024-01-01T00:00:00"}
    top.update({"opt": {"imgsz": 96}, "yolov5pip_version": "7.0.14"} if package == YOLOV5 else
               {"version": "8.4.190", "train_args": {"imgsz": 96}})
    top.update(ckpt or {})
    return {"modules": entries, "ckpt": top, "weights": weights, "ema_offset": ema_offset}


def craft(jobs: list[tuple[dict, Path, str]], standins: Path, tmp: Path) -> None:
    """Run tests/scripts/craft_foreign.py with only the stand-ins importable (not this repo)."""
    jobs_file = tmp / "jobs.pt"
    torch.save([{"spec": s, "out": str(o), "payload": p} for s, o, p in jobs], jobs_file)
    env = {k: v for k, v in run_env().items() if k != "FOREIGN_MARKERS"}
    env["PYTHONPATH"] = str(standins)
    p = subprocess.run([PYTHON, str(ROOT / "tests" / "scripts" / "craft_foreign.py"), str(jobs_file)],
                       cwd=tmp, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def half_rounded(model: Model) -> dict[str, torch.Tensor]:
    """What a fp16 checkpoint of ``model`` holds, back in fp32."""
    return {k: v.half().float() if v.is_floating_point() else v for k, v in model.state_dict().items()}


def both_outputs(converted: torch.nn.Module, original: Model, expected: dict[str, torch.Tensor]) -> tuple:
    """The converted model's and the original's eval outputs on one fixed batch, the original holding
    ``expected`` (its fp16-rounded weights): ((ours, ours_raw), (theirs, theirs_raw))."""
    original.load_state_dict(expected)
    original.eval()
    x = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return converted(x), original(x)


def models() -> dict[str, Model]:
    """One small model of each family, seeded, with BN statistics that are not the init values."""
    torch.manual_seed(0)
    out = {"yolov5n": Model("yolov5n.yaml", nc=len(NAMES)), "yolov8n": Model("yolov8n.yaml", nc=len(NAMES)),
           "yolo11n": Model("yolo11n.yaml", nc=len(NAMES))}
    for m in out.values():  # so a dropped or misplaced BN buffer changes the outputs
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 1.5)
                mod.num_batches_tracked.fill_(7)
    return out


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> dict:
    """Every crafted file of this module, made in one subprocess."""
    tmp = tmp_path_factory.mktemp("foreign")
    standins = write_standins(tmp / "standins")
    ms = models()
    v5, v8, v11 = ms["yolov5n"], ms["yolov8n"], ms["yolo11n"]
    evil = tmp / "pwned"
    files = {name: tmp / f"{name}.pt" for name in (
        "yolov5n", "yolov5n_pip_ema", "yolov8n", "yolo11n", "system", "exec", "import", "in_model",
        "ultra9", "focus", "unknown_module", "unknown_key", "missing", "unexpected", "segment")}

    def spec(model, package, **kw):
        return make_spec(model, package, next(k for k, v in ms.items() if v is model) + ".yaml", **kw)

    focus = spec(v5, YOLOV5)
    focus["modules"][0]["attrs"]["yaml"]["backbone"][0][2] = "Focus"
    unknown_module = spec(v5, YOLOV5)
    unknown_module["modules"][0]["attrs"]["yaml"]["head"][3][2] = "C3TR"
    unknown_key = spec(v8, ULTRALYTICS)
    unknown_key["modules"][0]["attrs"]["yaml"]["kpt_shape"] = [17, 3]
    missing = spec(v5, YOLOV5)
    layer0 = next(e for e in missing["modules"] if e["path"] == "model.0.bn")
    del layer0["buffers"]["running_var"]
    unexpected = spec(v8, ULTRALYTICS)
    next(e for e in unexpected["modules"] if e["path"] == "model.1.conv")["buffers"]["extra"] = torch.zeros(2)
    segment = spec(v8, ULTRALYTICS)
    segment["modules"][-1]["cls"] = "ultralytics.nn.modules.head.Segment"
    jobs = [
        (spec(v5, YOLOV5), files["yolov5n"], ""),
        (spec(v5, YOLOV5, prefix="yolov5.", weights="ema", ema_offset=0.25), files["yolov5n_pip_ema"], ""),
        (spec(v8, ULTRALYTICS), files["yolov8n"], ""),
        (spec(v11, ULTRALYTICS), files["yolo11n"], ""),
        (spec(v5, YOLOV5), files["system"], f"system:{evil}"),
        (spec(v8, ULTRALYTICS), files["exec"], f"exec:{evil}"),
        (spec(v8, ULTRALYTICS), files["import"], "import"),
        (spec(v5, YOLOV5), files["in_model"], f"in-model:{evil}"),
        (spec(v8, ULTRALYTICS, ckpt={"version": "9.1.0"}), files["ultra9"], ""),
        (focus, files["focus"], ""),
        (unknown_module, files["unknown_module"], ""),
        (unknown_key, files["unknown_key"], ""),
        (missing, files["missing"], ""),
        (unexpected, files["unexpected"], ""),
        (segment, files["segment"], ""),
    ]
    craft(jobs, standins, tmp)
    return {"files": files, "models": ms, "standins": standins, "evil": evil, "tmp": tmp}


@pytest.fixture
def watched(crafted, tmp_path, monkeypatch) -> Path:
    """Stand-ins importable (so an import by the reader would succeed and leave its mark) and a marker folder."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("FOREIGN_MARKERS", str(markers))
    monkeypatch.syspath_prepend(str(crafted["standins"]))
    yield markers
    assert not crafted["evil"].exists()
    assert "evil_mod" not in sys.modules and "ultralytics" not in sys.modules and "yolov5" not in sys.modules


# ----------------------------------------------------------------------------------------------
# conversion


@pytest.mark.parametrize("name", ["yolov5n", "yolov8n", "yolo11n"])
def test_converted_weights_and_outputs_equal_the_originals(crafted, watched, name):
    original = crafted["models"][name]
    ckpt = load_checkpoint(crafted["files"][name])
    assert sorted(watched.iterdir()) == []  # no stand-in imported, no __setstate__ called
    expected = half_rounded(original)
    assert list(ckpt["model"]) == list(expected)
    assert all(torch.equal(ckpt["model"][k], v) and ckpt["model"][k].dtype == v.dtype for k, v in expected.items())
    assert ckpt["names"] == NAMES and ckpt["args"] == {"imgsz": 96} and ckpt["epoch"] == -1
    assert ckpt["converted_from"]["package"] == (YOLOV5 if name == "yolov5n" else ULTRALYTICS)
    model, card = load_model(crafted["files"][name], torch.device("cpu"))
    assert (card.names, card.imgsz, card.epoch, card.tensors) == (tuple(NAMES), 96, -1, len(expected))
    assert card.converted_weights == ckpt["converted_from"]["weights"] and card.data is None
    (ours, ours_raw), (theirs, theirs_raw) = both_outputs(model, original, expected)
    assert torch.equal(ours, theirs) and all(torch.equal(a, b) for a, b in zip(ours_raw, theirs_raw))


def test_yolo11_keeps_its_depthwise_class_branch(crafted):
    assert load_checkpoint(crafted["files"]["yolo11n"])["model_yaml"]["head"][-1][3] == ["nc", 16, True]
    assert load_checkpoint(crafted["files"]["yolov8n"])["model_yaml"]["head"][-1][3] == ["nc", 16, False]


def test_ema_is_preferred_like_the_packages_own_loaders(crafted, watched):
    ckpt = load_checkpoint(crafted["files"]["yolov5n_pip_ema"])  # the PyPI package's yolov5.models paths
    w = "model.0.conv.weight"
    assert torch.equal(ckpt["model"][w], (crafted["models"]["yolov5n"].state_dict()[w].half() + 0.25).float())
    assert ckpt["converted_from"]["weights"] == "ema"


def test_yolov5_anchors_come_from_the_trained_buffer(crafted):
    ckpt = load_checkpoint(crafted["files"]["yolov5n"])
    det = crafted["models"]["yolov5n"].detect
    pixels = (det.anchors.half().float() * det.stride.view(-1, 1, 1)).view(det.nl, -1).tolist()
    assert ckpt["model_yaml"]["anchors"] == pixels


@pytest.mark.slow
def test_cli_writes_a_weights_only_checkpoint(crafted, tmp_path):
    out = tmp_path / "converted.pt"
    p = subprocess.run([PYTHON, "-m", "yolotrain", "weights", str(crafted["files"]["yolov8n"]), str(out)],
                       cwd=ROOT, env=run_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "converted to a yolotrain checkpoint" in p.stdout and f"Saved {out}" in p.stdout
    assert p.stdout.count("Its weights keep their AGPL-3.0 licence") == 1  # said once, where the file is converted
    saved = torch.load(out, weights_only=True)
    direct = load_checkpoint(crafted["files"]["yolov8n"])
    assert saved["model_yaml"] == direct["model_yaml"] and saved["names"] == NAMES
    assert all(torch.equal(saved["model"][k], v) for k, v in direct["model"].items())


@pytest.mark.slow
def test_cli_errors_are_one_line(crafted, tmp_path):
    p = subprocess.run([PYTHON, "-m", "yolotrain", "weights", str(crafted["files"]["system"]), str(tmp_path / "o.pt")],
                       cwd=ROOT, env=run_env(), capture_output=True, text=True)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out and out.count("ERROR:") == 1 and "refused" in out
    assert not (tmp_path / "o.pt").exists() and not crafted["evil"].exists()


def test_fine_tuning_transfers_all_but_the_class_layers(crafted):
    ckpt = load_checkpoint(crafted["files"]["yolov8n"])
    model = Model(ckpt["model_yaml"], nc=80)
    transfer_weights(model, ckpt["model"], "yolov8n.pt")
    own, source = model.state_dict(), ckpt["model"]
    skipped = [k for k in own if own[k].shape != source[k].shape or not torch.equal(own[k], source[k])]
    assert skipped and all(k.startswith("model.22.cv3.") for k in skipped)  # the class branch: nc-sized
    assert "model.22.cv3.0.2.weight" in skipped


# ----------------------------------------------------------------------------------------------
# refusals and errors


@pytest.mark.parametrize("name, named", [("system", "posix.system"), ("exec", "(__builtin__|builtins).exec"),
                                         ("import", "evil_mod.Payload"), ("in_model", "posix.system")])
def test_hostile_pickles_are_refused_and_nothing_runs(crafted, watched, name, named):
    with pytest.raises(UserError, match=rf"{name}\.pt: refused: its pickle asks for {named}.*nothing in the file "
                                        "was run"):
        load_checkpoint(crafted["files"][name])
    assert sorted(watched.iterdir()) == []


def test_a_foreign_class_outside_the_allow_list_is_refused(crafted, watched):
    with pytest.raises(UserError, match=r"refused: its pickle names ultralytics\.nn\.modules\.head\.Segment"):
        load_checkpoint(crafted["files"]["segment"])


def test_truncated_and_non_zip_files(crafted, tmp_path):
    data = crafted["files"]["yolov5n"].read_bytes()
    for cut in (len(data) // 2, len(data) - 10):
        f = tmp_path / f"cut{cut}.pt"
        f.write_bytes(data[:cut])
        with pytest.raises(UserError, match=rf"cut{cut}\.pt: not a readable yolotrain checkpoint \(not a PyTorch zip"):
            load_checkpoint(f)
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(UserError, match=r"notes\.pt: not a readable yolotrain checkpoint \(not a PyTorch zip"):
        load_checkpoint(text)


def test_corrupt_storage_record_is_an_error(crafted, tmp_path):
    """A storage record shorter than its tensors claim: refused before any tensor is built from it."""
    src, dst = crafted["files"]["yolov8n"], tmp_path / "short.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            zout.writestr(info, data[: len(data) // 2] if info.filename.endswith("/data/0") else data)
    with pytest.raises(UserError, match=r"short\.pt: corrupt checkpoint pickle .*storage '0' should hold"):
        load_checkpoint(dst)


def test_unsupported_versions(crafted):
    with pytest.raises(UserError, match=r"ultra9\.pt: written by Ultralytics 9\.1\.0; only Ultralytics 8\.x"):
        load_checkpoint(crafted["files"]["ultra9"])
    with pytest.raises(UserError, match=r"focus\.pt: a YOLOv5 model from before release v6\.0 \(Focus layers\)"):
        load_checkpoint(crafted["files"]["focus"])


def test_model_yaml_the_parser_does_not_know(crafted):
    with pytest.raises(UserError, match=r"unknown_module\.pt: .* not a model yolotrain can build: .*unknown module "
                                        r"'C3TR'"):
        load_checkpoint(crafted["files"]["unknown_module"])
    with pytest.raises(UserError, match=r"unknown_key\.pt: .* not a model yolotrain can build: .*unknown key "
                                        r"'kpt_shape'"):
        load_checkpoint(crafted["files"]["unknown_key"])


def test_missing_and_unexpected_tensors_are_named(crafted):
    with pytest.raises(UserError, match=r"missing\.pt: its tensors do not match .* missing model\.0\.bn\.running_var"):
        load_checkpoint(crafted["files"]["missing"])
    with pytest.raises(UserError, match=r"unexpected\.pt: its tensors do not match .* unexpected "
                                        r"model\.1\.conv\.extra"):
        load_checkpoint(crafted["files"]["unexpected"])


def test_plain_yolotrain_checkpoints_still_load_the_plain_way(tmp_path):
    f = tmp_path / "ours.pt"
    torch.save({"model_yaml": {"nc": 1}, "model": {"w": torch.ones(1)}}, f)
    assert "converted_from" not in load_checkpoint(f)


# ----------------------------------------------------------------------------------------------
# the reader on hand-made pickles


class _Storage:
    """A storage record for the hand-made pickles below: ('storage', FloatStorage, key, 'cpu', numel)."""

    def __init__(self, key: str, numel: int) -> None:
        self.pid = ("storage", torch.FloatStorage, key, "cpu", numel)


class _Tensor:
    """Pickles as torch does (torch._utils._rebuild_tensor_v2), optionally followed by a BUILD state."""

    def __init__(self, storage: _Storage, size: tuple, stride: tuple, state=None) -> None:
        self.storage, self.size, self.stride, self.state = storage, size, stride, state

    def __reduce__(self):
        args = (self.storage, 0, self.size, self.stride, False, collections.OrderedDict())
        rebuild = torch._utils._rebuild_tensor_v2
        return (rebuild, args) if self.state is None else (rebuild, args, self.state)


def write_raw(path: Path, obj, records: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            return o.pid if isinstance(o, _Storage) else None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for key, data in records.items():
            z.writestr(f"archive/data/{key}", data)
    return path


def test_reader_builds_tensors_lazily_and_exactly(tmp_path):
    values = torch.arange(6, dtype=torch.float32)
    s = _Storage("0", 6)
    f = write_raw(tmp_path / "ok.pt", {"t": _Tensor(s, (2, 2), (1, 3))}, {"0": values.numpy().tobytes()})
    archive = Archive(f)
    ref = archive.load()["t"]
    assert torch.equal(archive.tensor(ref), torch.as_strided(values, (2, 2), (1, 3)))


@pytest.mark.parametrize("size, state, why", [
    ((100,), None, "does not fit its storage"),  # larger than its storage
    ((2,), {"size": (10**6,)}, "tries to modify a TensorRef"),  # resized by BUILD after the check
    ((2,), [None, 0, (10**6,), (1,)], "tries to modify a TensorRef"),  # a frozen dataclass's own state form
])
def test_reader_refuses_tensors_outside_their_storage(tmp_path, size, state, why):
    f = write_raw(tmp_path / "bad.pt", {"t": _Tensor(_Storage("0", 4), size, (1,), state)}, {"0": bytes(16)})
    with pytest.raises(ReadError, match=rf"bad\.pt: corrupt checkpoint pickle \(UnpicklingError: .*{why}"):
        Archive(f).load()


def test_reader_refuses_a_storage_the_archive_lacks(tmp_path):
    f = write_raw(tmp_path / "nodata.pt", {"t": _Tensor(_Storage("7", 4), (4,), (1,))}, {})
    with pytest.raises(ReadError, match=r"storage '7' should hold 16 bytes, the archive has none"):
        Archive(f).load()


def test_reader_refuses_compressed_archives(tmp_path):
    """torch.save never compresses; a compressed record could inflate far beyond the file's size."""
    f = write_raw(tmp_path / "zipped.pt", {"t": 1}, {}, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(ReadError, match=r"zipped\.pt: compressed zip records"):
        Archive(f)
