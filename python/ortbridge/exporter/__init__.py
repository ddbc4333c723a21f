"""torch model -> ONNX model in which each call of an exported autograd.Function is one
ortbridge::PythonOp node and everything else is ordinary ONNX.

One eager run of the model on the example inputs records every call (arguments, output dtypes
and shapes); then torch's exporter runs with each exported Function made opaque: the dynamo
path (default) or the deprecated TorchScript path, both writing the same nodes.
"""

from __future__ import annotations

import os

import onnx
import torch

from .._tracing.functions import ExportError
from .._tracing.nodes import DOMAIN, name_nodes, quiet_exporter, rename_values, unname_unread_context_ids
from .._tracing.record import Recorder
from . import dynamo as _dynamo
from . import torchscript as _torchscript


def export(
    model: torch.nn.Module,
    args,
    f=None,
    *,
    kwargs: dict | None = None,
    dynamic_shapes=None,
    dynamo: bool = True,
    training: bool = False,
    all_functions: bool = False,
    allow_object_references: bool = False,
    opset_version: int | None = None,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
) -> onnx.ModelProto:
    """Export `model(*args, **kwargs)` to ONNX; save it to `f` (a path or binary file) if given,
    and return it.

    Functions registered with ortbridge.register become PythonOp nodes (`all_functions=True`:
    every Function the model calls, registering those not yet registered); others are traced
    through by torch. `dynamic_shapes` as in torch.export (per forward parameter: {dim: Dim or
    name}). `training=True` exports the model in train mode with nodes that keep their autograd
    context, each context id a graph output (for a PythonOpGrad graph, or release_context).
    Arguments held by reference (objects other than plain values) are valid only in this
    process: saving such a model needs `allow_object_references=True`. `input_names` and
    `output_names` name the graph's first inputs (the model's tensor arguments, in order) and
    outputs, as torch.onnx.export's do.
    """
    from ..training.module import OrtModule  # (an OrtModule exports as the module it wraps)

    while isinstance(model, OrtModule):
        model = model.module
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = kwargs or {}
    recorder = Recorder(all_functions, training, compiling=dynamo)
    was_training = model.training
    model.train(training)
    try:
        recorder.run(model, args, kwargs)
        if f is not None and not allow_object_references:
            _refuse_object_references(recorder.calls)
        exporter = "torch.export" if dynamo else "torch's TorchScript exporter"
        try:
            with quiet_exporter():
                if dynamo:
                    proto = _dynamo.export(model, args, kwargs, dynamic_shapes, recorder.calls, opset_version)
                else:
                    proto = _torchscript.export(
                        model, args, kwargs, dynamic_shapes, recorder.calls, opset_version, training
                    )
        except Exception as e:
            if recorder.traced_through and not isinstance(e, ExportError):
                e.add_note(
                    f"ortbridge: {exporter} traced through these Functions, which are not registered: "
                    f"{', '.join(sorted(recorder.traced_through))}. If one of them cannot be traced, register "
                    "it with ortbridge.register (or pass all_functions=True) to export it as a PythonOp."
                )
            raise
    except BaseException:
        recorder.unregister_new()
        raise
    finally:
        model.train(was_training)
    name_nodes(proto.graph)
    rename_values(proto.graph, input_names, output_names)
    if training:
        _expose_contexts(proto.graph)
    else:
        unname_unread_context_ids(proto.graph)
    if f is not None:
        onnx.save(proto, f if hasattr(f, "write") else os.fspath(f))
    return proto


def _refuse_object_references(calls) -> None:
    held = [(call.name, position, type_name) for call in calls for position, type_name in call.objects]
    if held:
        name, position, type_name = held[0]
        raise ExportError(
            f"argument {position} of {name}.apply is a {type_name} object, which the model can only hold by "
            "reference, valid in this process alone, so the saved file would not run elsewhere. Pass a plain "
            "value instead (None, bool, int, float, str, torch.dtype, torch.device, or lists, tuples and "
            "str-keyed dicts of those), or allow_object_references=True to save it anyway."
        )


def _expose_contexts(graph: onnx.GraphProto) -> None:
    """In a training export each PythonOp keeps its autograd context: its id becomes a graph
    output, so the caller can hand it to PythonOpGrad or release it."""
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == "PythonOp":
            graph.output.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.INT64, []))


__all__ = ["ExportError", "export"]
