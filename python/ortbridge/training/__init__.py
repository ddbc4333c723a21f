"""Training with ONNX Runtime running the forward and backward graphs: OrtModule and the
torch.compile backend."""

from .module import OrtModule

__all__ = ["OrtModule"]
