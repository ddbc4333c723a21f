"""torch dtype <-> ONNX TensorProto element type, from the kernel library's one table."""

import torch

from .. import _C
from .._compat import ort_private

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
    """The element type ONNX Runtime's IOBinding takes for a torch dtype: a numpy dtype, or for
    bfloat16, which numpy lacks, the ONNX element type (an int, which bind_input takes from
    onnxruntime 1.20)."""
    try:
        return _NUMPY[dtype]
    except KeyError:
        raise TypeError(
            f"{dtype} has no numpy type, which ONNX Runtime's IOBinding needs"
            f"{' (onnxruntime 1.20 or later binds it)' if dtype is torch.bfloat16 else ''}"
        ) from None


_NUMPY = {d: torch.empty(0, dtype=d).numpy().dtype for d in TO_ONNX if d is not torch.bfloat16}
if torch.bfloat16 in TO_ONNX and ort_private.RELEASE >= (1, 20):
    _NUMPY[torch.bfloat16] = TO_ONNX[torch.bfloat16]
