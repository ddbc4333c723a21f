"""torch dtype <-> ONNX TensorProto element type."""

import torch

TO_ONNX = {
    torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.uint16: 4, torch.int16: 5, torch.int32: 6,
    torch.int64: 7, torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.uint32: 12, torch.uint64: 13,
    torch.complex64: 14, torch.complex128: 15, torch.bfloat16: 16,
}
FROM_ONNX = {v: k for k, v in TO_ONNX.items()}


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
