"""ortbridge: ONNX Runtime graphs that call torch.autograd.Functions.

A custom Function becomes one `ortbridge::PythonOp` node (and `PythonOpGrad` for its
backward); the kernel library runs it in this process's PyTorch, zero-copy on the inputs.
"""

from .convert import convert_from_ortmodule
from .exporter import ExportError, export
from .operators import allow_operators
from .registry import UnknownFunctionError, pin_object, register, registered_names, unregister
from .runtime import InferenceSession, context_pool_size, library_path, release_context, session_options
from .tools import onnxruntime_tools

__all__ = [
    "CaptureError",
    "ExportError",
    "InferenceSession",
    "OnnxModule",
    "OrtGradientForwardBackward",
    "OrtModule",
    "UnknownFunctionError",
    "allow_operators",
    "context_pool_size",
    "convert_from_ortmodule",
    "export",
    "library_path",
    "onnxruntime_tools",
    "pin_object",
    "register",
    "registered_names",
    "release_context",
    "session_options",
    "unregister",
]


def __getattr__(name: str):
    # Training pulls in AOTAutograd and dynamo (over a second to import): only when asked for.
    if name in ("CaptureError", "OrtModule", "OnnxModule", "OrtGradientForwardBackward"):
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'ortbridge' has no attribute {name!r}")
