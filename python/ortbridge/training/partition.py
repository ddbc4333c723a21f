"""The joint graph's split into forward and backward graphs: AOTAutograd's default partition,
then saved views made in the backward graph instead of the forward graph.

Torch saves `t(weight)` of a Linear for its backward as a free view. In ONNX a view is a copy
(Transpose, Reshape), and one that is a graph output is made at every run: ONNX Runtime cannot
fold it into its consumer (Gemm's transB, MatMul) nor give it the buffer of its input. So a
saved tensor that is a chain of views of another tensor (the base) becomes the base itself in
the forward graph's outputs, and the backward graph applies the same views to it, where ONNX
Runtime folds them into the operators that read them (FusedMatMul's transposes) or makes them
once. The forward graph's output is then an input (passed through without ONNX Runtime) or a
value the graph computes anyway; the bytes saved are the same.

The context ids of the Function calls are saved as one int64 vector instead of one 0-d tensor per
call: AOTAutograd's runtime handles each saved tensor in Python (about a microsecond each, in
both graphs), and the forward run makes one tensor that owns them all (session.py).
"""

from __future__ import annotations

import torch

from .._compat.torch_private import default_partition
from .onnx_graph import is_context_id

aten = torch.ops.aten
# Views that keep every element of their input (a saved base is no larger than the saved view;
# expand's is smaller where it broadcasts), and detach (an alias; as a graph output, a copy).
# (Not squeeze: traced again in the backward graph it becomes prims.squeeze, which
# functionalization refuses.)
_VIEWS = {
    aten.t.default,
    aten.permute.default,
    aten.transpose.int,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.expand.default,
    aten.detach.default,
}


def partition(joint_module: torch.fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
    """AOTAutograd's partition_fn: its default partition, saved views moved to the backward graph."""
    forward, backward = default_partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    _save_view_bases(forward, backward, num_fwd_outputs)
    _save_context_ids_as_one(forward, backward, num_fwd_outputs)
    return forward, backward


def _view_chain(node: torch.fx.Node) -> tuple[list, torch.fx.Node]:
    """(the views from the base to `node`, in order; the base). Views whose other arguments are
    graph values (symbolic sizes) end the chain: the backward graph does not have them."""
    chain = []
    while node.op == "call_function" and node.target in _VIEWS and node.all_input_nodes == [node.args[0]]:
        chain.append(node)
        node = node.args[0]
    return chain[::-1], node


def _save_view_bases(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int) -> None:
    """Forward outputs from num_fwd_outputs on are the saved tensors, read by the backward
    graph's placeholders of the same names. A forward input is a base only where the backward
    graph gives it a gradient (a parameter, an input that requires grad); an input without one
    (a buffer, which the forward may update in place) keeps its view saved as it was."""
    outputs = forward.graph.output_node()
    saved = list(outputs.args[0])
    inputs = [n for n in forward.graph.nodes if n.op == "placeholder"]
    gradients = backward.graph.output_node().args[0]
    has_gradient = {p for p, g in zip(inputs, gradients) if g is not None} if len(gradients) == len(inputs) else set()
    placeholders = {n.name: n for n in backward.graph.nodes if n.op == "placeholder"}
    body = next(n for n in backward.graph.nodes if n.op != "placeholder")
    unused = []  # forward views no longer saved, last first
    for k in range(num_fwd_outputs, len(saved)):
        node = saved[k]
        if not isinstance(node, torch.fx.Node) or node.name not in placeholders:
            continue
        chain, base = _view_chain(node)
        if (
            not chain
            or "val" not in base.meta
            or not (base.op == "call_function" or (base.op == "placeholder" and base in has_gradient))
        ):
            continue
        saved[k] = base
        placeholder = placeholders[node.name]
        placeholder.meta["val"] = base.meta["val"]
        placeholder.meta.pop("tensor_meta", None)  # (the view's)
        view, made = placeholder, []
        with backward.graph.inserting_before(body):
            for v in chain:
                view = backward.graph.call_function(v.target, (view, *v.args[1:]), dict(v.kwargs))
                view.meta = dict(v.meta)
                made.append(view)
        placeholder.replace_all_uses_with(view, delete_user_cb=lambda user: user is not made[0])
        unused.extend(reversed(chain))
    if unused:
        outputs.args = (tuple(saved),)
        for node in dict.fromkeys(unused):  # (only the views: other nodes without users may have effects)
            if not node.users:
                forward.graph.erase_node(node)
        forward.recompile()
        backward.recompile()


def _save_context_ids_as_one(
    forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int
) -> None:
    """The saved context ids become one saved `stack` of them, in the place of the first; the
    backward graph's placeholders of them become `select`s of one placeholder in its place."""
    outputs = forward.graph.output_node()
    saved = list(outputs.args[0])
    placeholders = {n.name: n for n in backward.graph.nodes if n.op == "placeholder"}
    ids = [
        n
        for n in saved[num_fwd_outputs:]
        if isinstance(n, torch.fx.Node) and is_context_id(n) and n.name in placeholders
    ]
    if not ids:
        return
    with forward.graph.inserting_before(outputs):
        vector = forward.graph.call_function(aten.stack.default, (ids,))
    vector.meta["val"] = ids[0].meta["val"].new_empty((len(ids),))
    first = saved.index(ids[0])
    saved = [n for n in saved if n not in ids]
    saved.insert(first, vector)
    outputs.args = (tuple(saved),)

    old = [placeholders[n.name] for n in ids]
    with backward.graph.inserting_before(old[0]):
        held = backward.graph.placeholder("context_ids")
    held.meta["val"] = vector.meta["val"]
    body = next(n for n in backward.graph.nodes if n.op != "placeholder")
    for j, placeholder in enumerate(old):
        with backward.graph.inserting_before(body):
            one = backward.graph.call_function(aten.select.int, (held, 0, j))
        one.meta = dict(placeholder.meta)
        placeholder.replace_all_uses_with(one)
        backward.graph.erase_node(placeholder)
    forward.recompile()
    backward.recompile()
