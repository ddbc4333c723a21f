"""Every private onnxruntime API that ortbridge uses, in one place (no other module of the package
reaches one itself: tests/python/test_private_apis.py). Its public classes, behind these, are
the same in every release from 1.19."""

from __future__ import annotations

import onnxruntime as ort

try:  # onnxruntime-training's gradient builder and TrainingAgent (training/ort_gradient.py)
    from onnxruntime.capi import _pybind_state as training_c
except ImportError:  # pragma: no cover (every onnxruntime has the module)
    training_c = None


def c_session(session: ort.InferenceSession):
    """The C++ session behind an InferenceSession, which an IOBinding of ortbridge's own and
    onnxruntime-training's TrainingAgent take."""
    return session._sess


def c_device(device_type: str, index: int):
    """The C++ OrtDevice that IOBinding's bind calls take."""
    return ort.OrtDevice.make(device_type, index)._get_c_device()
