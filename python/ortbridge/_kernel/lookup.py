"""The Function a node's func_name names: a registered one (ortbridge.registry), or the one that
runs an allowed torch operator (ortbridge.operators), made here.

An operator node's constants are the operator's non-tensor arguments after two of their own: the
layout (per argument, -1 for one value or the length of a list) and the names of the trailing
keyword arguments, of which DIM_ORDERS is none either: ((position, dim order), ...), tensor
arguments to lay out in memory in that order (outermost dim first) before the call.

An operator that writes into its arguments (a custom op with `mutates_args`) runs functionalized,
as torch's traces write it (`auto_functionalized`, `auto_functionalized_v2`): its node's arguments
are that call's keywords, the operator writes into copies of what it would write into, and the
node's outputs are the operator's, then those copies. It never writes into ONNX Runtime's buffers.
"""

from __future__ import annotations

import functools

import torch

from .. import _C, operators, registry
from .._compat import torch_private
from .._compat.torch_private import OpOverload

_functions: dict[str, type] = {}  # operator func_name -> its Function
DIM_ORDERS = "_ortbridge_dim_orders"  # (a keyword: see above)


def lookup(name: str) -> type:
    """The Function a func_name names; UnknownFunctionError saying what to do where none."""
    cls = registry.registered_function(name)
    if cls is not None:
        return cls
    if not operators.is_operator_name(name):
        raise registry.unknown_function(name)
    try:
        return operator_function(name)
    except LookupError as e:
        raise registry.UnknownFunctionError(str(e)) from None


def operator_function(func_name: str) -> type:
    """The Function whose forward runs the named operator (cached per name)."""
    found = _functions.get(func_name)
    if found is None:
        found = _functions.setdefault(func_name, _make_function(func_name, operators.resolve(func_name)))
    return found


def flatten_outputs(result) -> list:
    """The tensors an operator returned, in order (absent ones, None, left out)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in flatten_outputs(r)]
    if result is None:
        return []
    raise TypeError(f"an operator returned a {type(result).__name__}; a fallback node gives tensors only")


def _lent(output: int, shape, dtype: torch.dtype) -> torch.Tensor | None:
    """ONNX Runtime's buffer for output `output` of the node being run, or None where the call
    lends none (see _C._lend_output) or it would not have `dtype`."""
    capsule = _C._lend_output(output, list(shape))
    if capsule is None:
        return None
    buffer = torch_private.from_dlpack(capsule)
    return buffer if buffer.dtype == dtype else None


def _batch_norm_into_outputs(op, input, weight, bias, running_mean, running_var, training, momentum, eps):
    """Training batch norm (_native_batch_norm_legit_functional) with its outputs written where
    ONNX Runtime wants them, not copied there: the out= form of _native_batch_norm_legit (the same
    CPU kernel) writes the normalized input and the saved statistics into ORT's buffers, and
    updates copies of the running statistics made in them. The functional call where a buffer
    is not lent (outside a kernel call, off the CPU, mixed dtypes) or is the input's own."""
    stats = running_mean.shape
    wanted = [
        (input.shape, input.dtype),
        (stats, input.dtype),
        (stats, input.dtype),
        (stats, running_mean.dtype),
        (stats, running_var.dtype),
    ]
    buffers = [_lent(i, shape, dtype) for i, (shape, dtype) in enumerate(wanted)] if training else [None]
    # (ORT may give the output the input's own buffer, where nothing else reads the input)
    if any(b is None for b in buffers) or buffers[0].data_ptr() == input.data_ptr():
        return op(input, weight, bias, running_mean, running_var, training, momentum, eps)
    out, save_mean, save_invstd, new_mean, new_var = buffers
    new_mean.copy_(running_mean)
    new_var.copy_(running_var)
    torch.ops.aten._native_batch_norm_legit.out(
        input,
        weight,
        bias,
        new_mean,
        new_var,
        training,
        momentum,
        eps,
        out=out,
        save_mean=save_mean,
        save_invstd=save_invstd,
    )
    return out, save_mean, save_invstd, new_mean, new_var


# Operators whose node writes its outputs into ONNX Runtime's buffers instead of returning tensors
# to copy there (train_step.py's larger CNN: its 13 batch-norm nodes took 7.9 ms a step with the
# copies, 6.5 ms without; profile_train_step.py), each with its implementation, called with the
# operator first. Other operators' out= forms are none (flash attention) or torch's generated
# wrapper that copies (convolution_backward.out, native_batch_norm_backward.out).
_INTO_OUTPUTS = {"aten::_native_batch_norm_legit_functional.default": _batch_norm_into_outputs}


def _functionalized(op: OpOverload, *args, **kwargs):
    """`op` called as torch's functionalized traces call it (keywords only), on copies of what it
    writes into: its outputs, then those copies."""
    if args or any(name.startswith("_only_clone") for name in kwargs):  # (which would write in place)
        raise TypeError(
            f"{operators.name_of(op)} writes into its arguments: its node takes the keywords of a functionalized "
            "call (auto_functionalized), without _only_clone_these_* "
        )
    hop = (
        torch.ops.higher_order.auto_functionalized_v2
        if "_all_bases" in kwargs
        else torch.ops.higher_order.auto_functionalized
    )
    return hop(op, **kwargs)


def _make_function(func_name: str, op: OpOverload) -> type:
    into_outputs = _INTO_OUTPUTS.get(func_name) or (_functionalized if op._schema.is_mutable else None)
    call = functools.partial(into_outputs, op) if into_outputs else op

    def forward(ctx, layout, keywords, *values):
        if torch_private.is_any_autocast_enabled():  # (a graph's casts are nodes of their own: none again)
            with torch_private.DisableAutocast():
                return forward(ctx, layout, keywords, *values)
        if not keywords and layout == (-1,) * len(values):  # (the common call: tensors alone, in order)
            return tuple(flatten_outputs(call(*values)))
        args, given = [], iter(values)
        for size in layout:
            args.append(next(given) if size < 0 else [next(given) for _ in range(size)])
        split = len(args) - len(keywords)
        kwargs = dict(zip(keywords, args[split:]))
        for position, order in kwargs.pop(DIM_ORDERS, ()):
            x = args[position]
            args[position] = torch.empty_permuted(x.shape, order, dtype=x.dtype, device=x.device).copy_(x)
        return tuple(flatten_outputs(call(*args[:split], **kwargs)))

    def backward(ctx, *grads):
        raise RuntimeError(f"{func_name} runs as an operator node, which has no backward of its own")

    namespace, rest = func_name.split("::", 1)
    cls = type(rest, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    cls.__module__ = namespace
    cls._ortbridge_name = func_name
    return cls
