"""Exports run on any device: the traced heads record no device constant (CPU twin: trace on CPU,
inspect the saved graph, run it on the meta device where the weights allow), and a CUDA trace runs
on the CPU; an FP16 ONNX export without onnxruntime's CUDA provider is refused, not run on the CPU."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from yolotrain.models.yolo import Model
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.infer.backends import ModelMeta
from yolotrain.utils.infer.export import DecodedOnly, ExportOptions, check_half_onnx, export_all, write_torchscript

CFGS = {"anchor-based": "models/yolov5n.yaml", "anchor-free": "models/yolov8n.yaml"}


def _export(family: str, path: Path, device: str = "cpu", hw: tuple[int, int] = (64, 64)) -> tuple[Model, Path]:
    torch.manual_seed(0)
    model = Model(CFGS[family], nc=3).fuse().eval().to(device)
    meta = ModelMeta(names=("a", "b", "c"), stride=32, imgsz=hw[1], family=family, format="torchscript")
    write_torchscript(DecodedOnly(model).eval(), torch.zeros(1, 3, *hw, device=device), path, meta)
    return model, path


def _load(path: Path, device: str = "cpu") -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.load(str(path), map_location=device)


def device_constants(module: torch.jit.ScriptModule) -> list[str]:
    """Every device the saved graph names as a constant (what a trace bakes in from ``device=`` arguments)."""
    return re.findall(r'Device = prim::Constant\[value="([^"]+)"\]', str(module.inlined_graph))


def test_the_detector_finds_a_baked_device():
    """The inspection can fail: a traced ``device=x.device`` is a Device constant in the graph."""
    def grid(x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert device_constants(torch.jit.trace(grid, torch.zeros(2, 3))) == ["cpu"]


@pytest.mark.parametrize("family", CFGS)
def test_a_cpu_trace_names_no_device_and_matches_eager(family, tmp_path, one_thread):
    model, path = _export(family, tmp_path / "m.torchscript")
    traced = _load(path)
    assert device_constants(traced) == []
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(traced(x), model(x)[0])


@pytest.mark.parametrize("family", CFGS)
def test_the_heads_cache_no_grid_into_a_trace(family, tmp_path, one_thread):
    """A model that already ran (its grid caches full) still traces the grids as operations, not constants."""
    torch.manual_seed(0)
    model = Model(CFGS[family], nc=3).fuse().eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, 64, 64))
    meta = ModelMeta(names=("a", "b", "c"), stride=32, imgsz=64, family=family, format="torchscript")
    write_torchscript(DecodedOnly(model).eval(), torch.zeros(1, 3, 64, 64), tmp_path / "m.torchscript", meta)
    graph = str(_load(tmp_path / "m.torchscript").inlined_graph)
    assert "aten::cumsum" in graph and device_constants(_load(tmp_path / "m.torchscript")) == []


def test_a_cpu_trace_runs_on_the_meta_device(tmp_path, one_thread):
    """The anchor-free graph takes its strides as numbers, so with a meta input nothing in it is on the CPU.
    (The anchor head multiplies by its anchor buffers, which stay on the CPU: there the graph text is the proof.)"""
    _, path = _export("anchor-free", tmp_path / "m.torchscript")
    out = _load(path)(torch.zeros(2, 3, 64, 96, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 8 * 12 + 4 * 6 + 2 * 3, 7)  # cells at strides 8, 16, 32


@pytest.mark.parametrize("providers, refused", [(["CPUExecutionProvider"], True),
                                                (["CUDAExecutionProvider", "CPUExecutionProvider"], False)])
def test_half_onnx_needs_onnxruntimes_cuda_provider(monkeypatch, providers, refused):
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setattr(ort, "get_available_providers", lambda: providers)
    half = ExportOptions(imgsz=64, batch=1, half=True)
    check_half_onnx(["torchscript"], half)  # TorchScript FP16 runs on CUDA through torch itself
    check_half_onnx(["onnx"], ExportOptions(imgsz=64, batch=1))  # FP32 ONNX runs anywhere
    if refused:
        with pytest.raises(UserError, match=r"--half --include onnx: onnxruntime .*has no CUDA provider here "
                                            r"\(only CPUExecutionProvider\).*onnxruntime-gpu"):
            export_all(None, ["torchscript", "onnx"], half, torch.device("cuda", 0), [])  # before any work
    else:
        check_half_onnx(["onnx"], half)


@pytest.mark.cuda
@pytest.mark.parametrize("family", CFGS)
def test_a_cuda_trace_runs_on_the_cpu_and_another_gpu(family, tmp_path):
    model, path = _export(family, tmp_path / "m.torchscript", device="cuda:0")
    assert device_constants(_load(path, "cpu")) == []
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x.cuda())[0].cpu()
        assert torch.allclose(_load(path, "cpu")(x), want, atol=1e-3, rtol=1e-3)
        if torch.cuda.device_count() > 1:
            assert torch.allclose(_load(path, "cuda:1")(x.to("cuda:1")).cpu(), want, atol=1e-3, rtol=1e-3)


def _onnx(tmp_path: Path) -> Path:
    """A dynamic-shape yolov8n (random weights, 3 classes) ONNX export with its metadata."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from yolotrain.utils.infer.export import write_onnx

    torch.manual_seed(0)
    model = Model(CFGS["anchor-free"], nc=3).fuse().eval()
    meta = ModelMeta(names=("a", "b", "c"), stride=32, imgsz=64, family="anchor-free", format="onnx")
    path = tmp_path / "m.onnx"
    write_onnx(DecodedOnly(model).eval(), torch.zeros(1, 3, 64, 64), path, meta, ExportOptions(imgsz=64, batch=1,
                                                                                              dynamic=True))
    return path


def test_onnx_binds_io_only_for_a_cuda_provider_and_a_cuda_input(tmp_path, monkeypatch, one_thread):
    from yolotrain.utils.infer.backends import OnnxBackend

    backend = OnnxBackend(_onnx(tmp_path), torch.device("cpu"))
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    plain = backend.run(x)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not backend.binds_on_device(cpu) and not backend.binds_on_device(cuda)  # CPU provider only
    monkeypatch.setattr(backend.session, "get_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert backend.binds_on_device(cuda) and not backend.binds_on_device(cpu)

    def no_binding(images):
        raise AssertionError("IOBinding chosen for a CPU input")

    monkeypatch.setattr(backend, "run_bound", no_binding)
    assert torch.equal(backend.run(x), plain)  # a CPU input keeps the host path, results unchanged


def test_onnx_threads_sleep_between_runs(tmp_path, one_thread):
    """ONNX Runtime's threads must not spin after a run: detect.py's letterbox, NMS and unletterbox run on
    the same cores between runs."""
    from yolotrain.utils.infer.backends import OnnxBackend

    options = OnnxBackend(_onnx(tmp_path), torch.device("cpu")).session.get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.intra_op_num_threads == torch.get_num_threads()


@pytest.mark.cuda
def test_onnx_on_cuda_through_iobinding_equals_the_host_path(tmp_path, monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA provider here (onnxruntime-gpu)")
    from yolotrain.utils.infer.backends import OnnxBackend

    path = _onnx(tmp_path)
    gpu, cpu = OnnxBackend(path, torch.device("cuda", 0)), OnnxBackend(path, torch.device("cpu"))
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    assert gpu.binds_on_device(torch.device("cuda", 0))
    host_runs = []
    run = gpu.session.run
    monkeypatch.setattr(gpu.session, "run", lambda *a, **k: host_runs.append(1) or run(*a, **k))
    bound = gpu(x.cuda())[0]
    assert bound.is_cuda and host_runs == []  # the output stays on the GPU; no host round trip
    host = torch.from_numpy(run(None, {gpu.input_name: x.numpy()})[0])  # the same CUDA session via host copies
    assert torch.allclose(bound.cpu(), host, atol=1e-4, rtol=1e-4)
    want = cpu(x)[0]  # the CPU provider: TF32 convolutions on recent GPUs differ by more than 1e-4
    assert torch.allclose(bound.cpu(), want, atol=1e-2 * float(want.abs().max()), rtol=0)
