"""The device's policy: the precision (autocast on or off, in which dtype), the memory format and the
kernels' determinism a run or a tool uses when its flags leave them open.

One place for these choices, so train.py, val.py, detect.py, AutoBatch and the benches pick alike; each
default says the measurement behind it (docs/training.md).
"""
from __future__ import annotations

import os
import sys

import torch


def channels_last_default(flag: bool | None, device: torch.device, half: bool = False) -> bool:
    """--channels-last / --no-channels-last, or when neither is given the layout measured fastest on the
    device: NHWC on CPU (oneDNN's convolutions); on CUDA NHWC under fp16 (``half``: --amp, or inference
    --half), where cuDNN's tensor-core convolutions are NHWC-native, except on Windows, whose driver
    makes the layout conversions costly; NCHW for fp32 CUDA. The evidence: docs/training.md."""
    if flag is not None:
        return bool(flag)
    if device.type == "cuda":
        return half and sys.platform != "win32"
    return device.type == "cpu"


def set_determinism(deterministic: bool, fixed_shapes: bool) -> None:
    """--deterministic: deterministic kernels everywhere (cuDNN's fixed algorithms, cuBLAS's fixed workspace,
    torch's deterministic index_put and scatter), so a resumed CUDA run repeats the uninterrupted one's bits, at
    some speed cost; an op with no deterministic kernel warns rather than stopping the run. Without it, cuDNN
    times its algorithms per input shape and keeps the fastest (only when shapes stay fixed: rect or
    multi-scale batches would re-time every new shape)."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: this is process start
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic and fixed_shapes


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AMX tiles or AVX512-BF16): only there does
    bf16 autocast make CPU training faster; elsewhere oneDNN emulates it and fp32 is quicker."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private torch.cpu probes
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def amp_default(flag: bool | None, device: torch.device, legacy: bool = False) -> bool:
    """--amp / --no-amp, or when neither is given: on for CUDA (fp16 with a GradScaler) and for a CPU
    with native bf16 (bf16 autocast). ``legacy``: a resumed run saved before the flag existed, which
    used autocast on CUDA only."""
    if flag is not None:
        return bool(flag)
    return device.type == "cuda" or (not legacy and device.type == "cpu" and cpu_has_native_bf16())


def amp_dtype(device: torch.device) -> torch.dtype:
    """The autocast precision of --amp: fp16 on CUDA (YOLOv5's, with loss scaling), bf16 on CPU
    (fp32's exponent range, so no scaler is needed)."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16
