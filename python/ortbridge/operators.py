"""Which torch operators a graph may call as PythonOp nodes: the fallback for operators torch's ONNX
exporter cannot write (convolution_backward, avg_pool2d_backward, a user's torch.library op...).

A func_name of the form `namespace::op.overload` (`aten::convolution_backward.default`) names a
torch operator instead of a registered Function. It resolves only among the operators already
registered with torch in a namespace that is allowed (`aten`, `prims`, and those passed to
`allow_operators`): never by importing a module. How a node calls the operator it names:
_kernel/lookup.py.
"""

from __future__ import annotations

import re
import threading

import torch

from ._compat import torch_private
from ._compat.torch_private import OpOverload, OpOverloadPacket

_NAME = re.compile(r"([A-Za-z][A-Za-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\Z")
# Never from a model file: reading a file it names, memory without bounds checks (_reshape_alias)
# or without initial values (empty...), storage surgery.
_DENIED = re.compile(r"(from_file|_reshape_alias|as_strided\w*|set_|_unsafe_\w*|\w*empty\w*|resize\w*)\Z")
_lock = threading.Lock()
_namespaces = {"aten", "prims"}  # (prims: torch's primitives, which its decompositions emit)


def allow_operators(namespace: str) -> None:
    """Let graphs run the operators of torch.ops.<namespace> (a torch.library namespace the
    process defines) as fallback nodes, and let the exporters emit them."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", namespace):
        raise ValueError(f"not an operator namespace: {namespace!r}")
    with _lock:
        _namespaces.add(namespace)


def allowed(namespace: str) -> bool:
    return namespace in _namespaces


def is_operator_name(func_name: str) -> bool:
    return "::" in func_name


def name_of(op: OpOverload) -> str:
    """The func_name of an operator: `namespace::op.overload`."""
    return f"{op.namespace}::{op._schema.name.split('::', 1)[1]}.{op._overloadname}"


def resolve(func_name: str) -> OpOverload:
    """The operator a func_name names, where this process allows it; LookupError saying why not."""
    match = _NAME.match(func_name)
    if not match:
        raise LookupError(f"func_name '{func_name}' is not an operator name of the form namespace::op.overload")
    namespace, op, overload = match.groups()
    if not allowed(namespace):
        raise LookupError(
            f"func_name '{func_name}': operators of namespace '{namespace}' are not allowed here "
            f"(allowed: {', '.join(sorted(_namespaces))}; ortbridge.allow_operators adds one)"
        )
    if _DENIED.match(op):
        raise LookupError(f"func_name '{func_name}': this operator is not allowed in a graph")
    packet = getattr(getattr(torch.ops, namespace), op, None) if not op.startswith("__") else None
    if not isinstance(packet, OpOverloadPacket) or overload not in packet.overloads():
        raise LookupError(f"func_name '{func_name}' names no operator registered with torch in this process")
    found = getattr(packet, overload)
    # (aten's in-place and out= overloads would write into ONNX Runtime's buffers; torch functionalizes
    # the others, as the node runs them)
    if found._schema.is_mutable and not torch_private.can_auto_functionalize(found):
        raise LookupError(f"func_name '{func_name}': an operator that writes into its arguments is not allowed")
    return found
