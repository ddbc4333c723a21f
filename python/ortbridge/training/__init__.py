"""Training with ONNX Runtime running the forward and backward graphs: OrtModule and the
torch.compile backend, and OnnxModule / OrtGradientForwardBackward for ONNX models."""

from .model_state import CaptureError
from .module import OrtModule
from .onnx_module import OnnxModule, OrtGradientForwardBackward

__all__ = ["CaptureError", "OnnxModule", "OrtGradientForwardBackward", "OrtModule"]
