"""The two torch custom ops that stand for one Function call while AOTAutograd traces a model:
`ortbridge::python_op` (forward; output 0 is the context id) and `ortbridge::python_op_grad`
(backward; takes that id, saved between the graphs). AOTAutograd's partitioner puts each in its
graph; onnx_graph.py writes them as PythonOp and PythonOpGrad nodes. They have no kernel of their own:
ONNX Runtime runs them.
"""

from __future__ import annotations

import torch

from .._format import dtypes
from .._tracing.nodes import Arguments
from .._tracing.record import Call


class TracedCall:
    """One traced Function call: the recorded call (attributes, output types and shapes) and
    which of its tensor inputs need a gradient in this trace."""

    def __init__(self, call: Call, arguments: Arguments, index: int):
        self.call = call
        self.index = index
        tensors = arguments.tensors
        self.requires_grad = [t.requires_grad for t in tensors]
        self.input_dtypes = [t.dtype for t in tensors]
        self.input_shapes = [tuple(t.shape) for t in tensors]  # (SymInts where sizes are dynamic)
        self.output_shapes = call.output_shapes_for([list(t.shape) for t in tensors])
        self.device = tensors[0].device if tensors else torch.device("cpu")

    def forward_attrs(self, training: bool) -> dict:
        attrs = dict(self.call.node_attrs(self.index), training_mode=int(training))
        attrs.pop("input_requires_grads", None)
        if training:
            grads = iter(self.requires_grad)
            attrs["input_requires_grads"] = [int(next(grads)) if c == "d" else 0 for c in attrs["input_convention"]]
        dims = self.output_dims()
        if dims is not None:
            attrs["output_tensor_dims"] = dims
        return attrs

    def output_dims(self) -> list[int] | None:
        """Where the trace has symbolic sizes, what it took each output dim for, which the kernel
        checks at every call (the node's output_tensor_dims): a size, -2 - k for dim k of the
        tensor inputs' dims in order, -1 for a size of another form (an infer_shape's expression).
        None for a trace of static sizes: the record run's, which a graph of those sizes keeps."""
        inputs = [d for shape in self.input_shapes for d in shape]
        if all(type(d) is int for d in inputs):
            return None
        position = {d.node.expr: -2 - k for k, d in reversed(list(enumerate(inputs))) if type(d) is not int}
        return [d if type(d) is int else position.get(d.node.expr, -1) for shape in self.output_shapes for d in shape]

    def backward_attrs(self, present: list[bool]) -> dict:
        return dict(
            func_name=self.call.name,
            output_convention=self.call.attrs["input_convention"],
            input_tensor_types=self.call.attrs["output_tensor_types"],
            input_tensor_ranks=self.call.attrs["output_tensor_ranks"],
            input_tensor_present=[int(p) for p in present],
            output_tensor_types=[dtypes.onnx_type(d) for d in self.input_dtypes],
            output_tensor_ranks=[len(s) for s in self.input_shapes],
            output_tensor_requires_grads=[int(r) for r in self.requires_grad],
        )

    def wanted_gradients(self) -> list[int]:
        return [i for i, r in enumerate(self.requires_grad) if r]


_calls: list[TracedCall] = []  # by index, the int argument of both ops (a few per captured graph)


def traced_call(index: int) -> TracedCall:
    return _calls[index]


def python_op_call(call: Call, arguments: Arguments):
    """The traced call of `call`: what apply returns, computed by python_op."""
    _calls.append(TracedCall(call, arguments, len(_calls)))
    outputs = python_op(arguments.tensors, len(_calls) - 1)
    return call.returned(arguments.tensors, outputs[1:])


def _only_traced(name: str):
    raise RuntimeError(
        f"ortbridge::{name} stands for a Function call in a captured graph, which ONNX Runtime runs; "
        "it has no kernel of its own"
    )


@torch.library.custom_op("ortbridge::python_op", mutates_args=())
def python_op(inputs: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    _only_traced("python_op")


@python_op.register_fake
def _(inputs, call):
    traced = traced_call(call)
    outputs = [
        torch.empty(s, dtype=d, device=traced.device) for s, d in zip(traced.output_shapes, traced.call.output_dtypes)
    ]
    # The context id lives on the host whatever the device (PythonOpGrad reads it there).
    return [torch.empty((), dtype=torch.int64), *outputs]


@torch.library.custom_op("ortbridge::python_op_grad", mutates_args=())
def python_op_grad(context: torch.Tensor, grads: list[torch.Tensor | None], call: int) -> list[torch.Tensor]:
    _only_traced("python_op_grad")


@python_op_grad.register_fake
def _(context, grads, call):
    traced = traced_call(call)
    return [
        torch.empty(traced.input_shapes[i], dtype=traced.input_dtypes[i], device=traced.device)
        for i in traced.wanted_gradients()
    ]


def _setup_context(ctx, inputs, output):
    ctx.call = inputs[1]
    ctx.save_for_backward(output[0])
    # The context id, and the outputs the Function made non-differentiable in the eager run.
    differentiable = traced_call(ctx.call).call.differentiable
    ctx.mark_non_differentiable(output[0], *(o for o, d in zip(output[1:], differentiable) if not d))
    ctx.set_materialize_grads(False)  # an absent gradient stays absent: the Function's own setting decides


def _backward(ctx, grads):
    traced = traced_call(ctx.call)
    input_grads = [None] * len(traced.requires_grad)
    if any(g is not None for g in grads[1:]):
        (context,) = ctx.saved_tensors
        for i, g in zip(traced.wanted_gradients(), python_op_grad(context, list(grads[1:]), ctx.call)):
            input_grads[i] = g
    return input_grads, None


python_op.register_autograd(_backward, setup_context=_setup_context)
