"""Where a graph runs: the execution providers of its device (CUDA on ortbridge's own stream),
ONNX Runtime's device objects, an address for tensors without elements."""

from __future__ import annotations

import onnxruntime as ort
import torch

from .._compat.ort_private import c_device

_streams: dict = {}  # CUDA device -> the stream ONNX Runtime runs every graph on there


def cuda_stream(device: torch.device):
    """A torch stream of ortbridge's own on `device` (ORT refuses the default one), made ORT's
    compute stream: the Functions' kernels, ORT's and the copies are all ordered on it."""
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def execution_providers(providers, device: torch.device) -> list:
    """The execution providers of a graph on `device`: the CUDA provider of that device on
    ortbridge's stream (the user's options kept), then the CPU."""
    if device.type == "cpu":
        return providers or ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(
            f"the module's tensors are on {device}, but this onnxruntime has no "
            "CUDAExecutionProvider: install onnxruntime-gpu (pip install 'ortbridge[gpu]')"
        )
    ours = {
        "device_id": str(device.index or 0),
        "has_user_compute_stream": "1",
        "user_compute_stream": str(cuda_stream(device).cuda_stream),
    }
    given = [(p, {}) if isinstance(p, str) else tuple(p) for p in providers or ["CPUExecutionProvider"]]
    cuda = [(name, {**options, **ours}) for name, options in given if name == "CUDAExecutionProvider"]
    return (cuda or [("CUDAExecutionProvider", ours)]) + [p for p in given if p[0] != "CUDAExecutionProvider"]


def ort_device(device: torch.device):
    return c_device(device.type, device.index or 0)


_PLACEHOLDERS: dict = {}  # device -> a small tensor there


def placeholder_address(t: torch.Tensor) -> int:
    """An address on t's device for a tensor without elements (whose own is 0, which ORT refuses
    to bind)."""
    assert t.numel() == 0, "a tensor with elements at address 0"
    if t.device not in _PLACEHOLDERS:
        _PLACEHOLDERS[t.device] = torch.empty(16, dtype=torch.uint8, device=t.device)
    return _PLACEHOLDERS[t.device].data_ptr()
