"""torch dtype <-> ONNX TensorProto element type, from the kernel library's one table."""

import torch

from . import _C

# Every torch dtype by its name (torch.float32 -> "float32"): a fixed table, so that a name from a
# model file never reaches getattr(torch, ...) and torch's lazy module loader.
BY_NAME = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}

FROM_ONNX = {onnx: BY_NAME[name] for onnx, name in _C.element_types().items()}
TO_ONNX = {d: onnx for onnx, d in FROM_ONNX.items()}


def onnx_type(dtype: torch.dtype) -> int:
    try:
        return TO_ONNX[dtype]
    except KeyError:
        raise TypeError(f"{dtype} has no ONNX element type that ortbridge supports") from None


def numpy_type(dtype: torch.dtype):
    """The numpy dtype ONNX Runtime's IOBinding takes for a torch dtype."""
    try:
        return _NUMPY[dtype]
    except KeyError:
        raise TypeError(f"{dtype} has no numpy type, which ONNX Runtime's IOBinding needs") from None


_NUMPY = {d: torch.empty(0, dtype=d).numpy().dtype for d in TO_ONNX if d is not torch.bfloat16}
