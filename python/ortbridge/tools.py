"""ONNX Runtime's own Python tools on ortbridge files: quantization (quant_pre_process,
quantize_static, quantize_dynamic), symbolic shape inference, the .ort converter."""

from __future__ import annotations

import contextlib
import threading

import onnx

from . import registry, runtime
from ._compat.ort_private import every_session_prepared, library_registered_once, symbolic_shape_handlers
from ._tracing.nodes import DOMAIN

_lock = threading.Lock()


@contextlib.contextmanager
def onnxruntime_tools():
    """For its duration, ONNX Runtime's Python tools handle files with ortbridge nodes:

    - every onnxruntime.InferenceSession created has the ortbridge kernels (quantize_static's
      calibrator, quant_pre_process's optimization step, the .ort converter, to which passing
      `custom_op_library_path=ortbridge.library_path()` is then optional);
    - ORT's symbolic shape inference (SymbolicShapeInference, quant_pre_process) gives each node's
      outputs their types and ranks from its attributes, and their shapes from the Function's
      `infer_shape` where it has one (ORT's training build does the same through its own registry),
      else new symbolic dims.

    It changes those two onnxruntime classes while it lasts, for every thread; one at a time.
    The tools run in this process, where the model's Functions are registered.
    """
    with (
        _lock,
        every_session_prepared(runtime.session_options),
        library_registered_once(runtime.library_path(), runtime.session_options),
        symbolic_shape_handlers(_infer_shapes, ("PythonOp", "PythonOpGrad")),
    ):
        yield


def _infer_shapes(inferred, own) -> None:
    node = inferred.node
    if node.domain != DOMAIN:  # (onnxruntime-training's com.microsoft nodes)
        if own is None:
            raise ValueError(f"{node.op_type} node {node.name!r} of domain {node.domain!r}: no shape inference")
        return own(node)
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    types, ranks = attributes.get("output_tensor_types", []), attributes.get("output_tensor_ranks", [])
    first = 1 if node.op_type == "PythonOp" else 0  # (a PythonOp's output 0 is its context id)
    if first:  # (typed even where unnamed: before 1.21 ORT's inference reads a value named "" after this)
        inferred.set_output(0, onnx.TensorProto.INT64, [])
    shapes = _function_shapes(inferred, attributes) if first else None
    for i, (elem_type, rank) in enumerate(zip(types, ranks)):
        if node.output[first + i]:
            inferred.set_output(first + i, elem_type, shapes[i] if shapes else inferred.new_shape(rank, first + i))


def _function_shapes(inferred, attributes: dict) -> list | None:
    """The output shapes the node's Function's infer_shape gives, or None where it has none."""
    name = attributes["func_name"].decode()
    function = None if ":" in name else registry.registered_function(name)
    infer = getattr(function, "infer_shape", None)
    if infer is None:
        return None
    shapes = [inferred.input_shape(i) for i in range(len(inferred.node.input))]
    shapes, _ = infer(inferred.node, shapes, attributes.get("input_tensor_types", []))
    return [list(s) for s in shapes]
