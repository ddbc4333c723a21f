"""Graphs exported by ORTModule (onnxruntime-training) -> ortbridge graphs.

ORTModule writes `com.microsoft::PythonOp` / `PythonOpGrad`; ortbridge's ops keep those attribute
names and meanings, so converting moves the nodes to the ortbridge domain and keeps every
attribute. One form differs: ORT leaves an empty input name where PythonOpGrad gets no gradient,
which a custom op cannot express; ortbridge lists the present gradients and marks them in
`input_tensor_present`.
"""

from __future__ import annotations

import os

import onnx

from ._tracing.nodes import DOMAIN

_ORT_DOMAIN = "com.microsoft"
_OPS = ("PythonOp", "PythonOpGrad")


def convert_from_ortmodule(model) -> onnx.ModelProto:
    """A copy of `model` (ModelProto, serialized bytes or a path) with every com.microsoft
    PythonOp/PythonOpGrad node (in subgraphs and functions too) in the ortbridge domain."""
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    elif isinstance(model, bytes):
        proto = onnx.load_from_string(model)
    elif isinstance(model, (str, os.PathLike)):
        proto = onnx.load(model)
    else:
        raise TypeError(f"convert_from_ortmodule takes a ModelProto, bytes or a path, not {type(model).__name__}")
    for nodes, imports in [
        (proto.graph.node, proto.opset_import),
        *((f.node, f.opset_import) for f in proto.functions),
    ]:  # each has its own imports
        converted = _convert_nodes(nodes)
        _retarget_imports(imports, converted, still_ort=any(n.domain == _ORT_DOMAIN for n in _all_nodes(nodes)))
    return proto


def _retarget_imports(imports, converted: int, still_ort: bool) -> None:
    """Import ortbridge where it is used; drop com.microsoft where nothing uses it any more."""
    uses_ortbridge = converted > 0 or any(o.domain == DOMAIN for o in imports)
    kept = [o for o in imports if o.domain != DOMAIN and (still_ort or o.domain != _ORT_DOMAIN)]
    if uses_ortbridge:
        kept.append(onnx.helper.make_opsetid(DOMAIN, 1))
    del imports[:]
    imports.extend(kept)


def _all_nodes(nodes):
    for node in nodes:
        yield node
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_nodes(g.node)


def _convert_nodes(nodes) -> int:
    count = 0
    for node in _all_nodes(nodes):
        if node.domain != _ORT_DOMAIN or node.op_type not in _OPS:
            continue
        attrs = {a.name: a for a in node.attribute}
        if "input_pointer_scalars" in attrs and attrs["input_pointer_scalars"].ints:
            raise ValueError(
                f"node {node.name!r} ({attrs['func_name'].s.decode()}) passes Python objects by their address in the "
                "process that exported it (input_pointer_scalars); no other process can restore them. Re-export the "
                "model with ortbridge.export, which stores plain values such as str and None in the graph."
            )
        node.domain = DOMAIN
        if node.op_type == "PythonOpGrad":
            _list_present_gradients(node, len(attrs["input_tensor_types"].ints) if "input_tensor_types" in attrs else 0)
        count += 1
    return count


def _list_present_gradients(node: onnx.NodeProto, slots: int) -> None:
    """ORT: one input per forward output, empty (or left off at the end) where no gradient flows."""
    grads = list(node.input[1:])
    present = [int(i < len(grads) and grads[i] != "") for i in range(max(slots, len(grads)))]
    if all(present):
        return
    kept = [node.input[0], *(name for name in grads if name)]
    del node.input[:]
    node.input.extend(kept)
    node.attribute.append(onnx.helper.make_attribute("input_tensor_present", present))
