"""The torch.export-based path: torch.export.export(strict=False), then torch's ONNX exporter.

torch.export traces through a Function's forward and drops its backward. While it runs, each
exported Function's `apply` emits `torch.onnx.ops.symbolic_multi_out("ortbridge::PythonOp")`
instead, an opaque node with the call's attributes and (symbolic) output shapes, so forward is
never traced: numpy, `.item()` and data-dependent branches inside it do not matter.
"""

from __future__ import annotations

import torch

from .._compat.torch_private import fx_config
from .._tracing import fallback
from .._tracing.interception import intercepted
from .._tracing.nodes import emit_python_op
from .._tracing.record import Call, CallTable
from . import dims


class _Emitter:
    def __init__(self, calls: list[Call]):
        self.table = CallTable(calls)
        self.emitted = 0

    def __call__(self, func, original, args, kwargs):
        arguments, call = self.table.match(func, args, kwargs)
        traced = [list(t.shape) for t in arguments.tensors]
        self.emitted += 1
        outputs = emit_python_op(
            arguments.tensors, call.node_attrs(self.emitted - 1), call.output_dtypes, call.output_shapes_for(traced)
        )
        return call.returned(arguments.tensors, outputs[1:])  # output 0 is the context id


def export(model, args: tuple, kwargs: dict, dynamic_shapes, calls: list[Call], opset_version):
    # Capture with torch.export ourselves, non-strict only: torch.onnx.export would retry a failed
    # capture in strict mode, where dynamo inlines Function.apply without calling ours.
    # Like torch.onnx.export: a dynamic dim may have an example size of 0 or 1.
    emitter = _Emitter(calls)
    with intercepted({call.func for call in calls}, emitter), fx_config.patch(backed_size_oblivious=True):
        shapes = dims.for_torch_export(dynamic_shapes)
        program = torch.export.export(model, args, kwargs=kwargs, strict=False, dynamic_shapes=shapes)
        emitter.table.require_all_reached("torch.export's trace")
    proto = fallback.onnx_of(program, opset_version=opset_version)
    dims.rename(proto, dims.names(model, args, kwargs, dynamic_shapes))
    return proto
