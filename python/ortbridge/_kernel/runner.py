"""The Python side of one PythonOp / PythonOpGrad call.

The C++ kernels build one ForwardNode or BackwardNode per graph node when the session is
created and call its `run` on every Compute, holding the GIL; a call on the CPU the kernel
usually makes itself, from what the node's `direct` gives it, ending in the node's `result` for
anything unusual. Inputs arrive as DLPack capsules that view ONNX Runtime's buffers (borrowed for
the duration of the call); outputs leave as DLPack capsules that the kernel copies into
ORT-allocated buffers.

On a CUDA execution provider the node also does the kernel's device work, as the library links
no CUDA runtime: the kernel makes ORT's compute stream torch's current stream around the call
(use_stream, restore_stream), and torch writes ORT's device buffers on it (copy_into, fill).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import traceback
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd.function import FunctionCtx

from .. import _C, registry
from .._compat import torch_private
from .._compat.torch_private import direct_apply, unrouted_apply, uses_setup_context
from .._format import dtypes, literals
from .lookup import lookup

# The names the C++ kernels call (csrc/runner_api.cc resolves each once: the lists are the same,
# tests/python/test_layout.py checks): of this module, of its node objects (ForwardNode,
# BackwardNode), and the fields of a DirectCall.
KERNEL_NAMES = (
    "ForwardNode",
    "BackwardNode",
    "format_exception",
    "_from_dlpack",
    "_to_dlpack",
    "_is_grad_enabled",
    "_set_grad_enabled",
    "_functorch_active",
    "_node_owner",
    "_own_borrowed_attributes",
    "_pop_saved_hooks",
    "_kept_from_borrowed",
    "Tensor",
    "_push_saved_hooks",
)
NODE_NAMES = ("func", "run", "direct", "result", "use_stream", "restore_stream", "copy_into", "fill")

Tensor = torch.Tensor
_from_dlpack = torch_private.from_dlpack
_to_dlpack = torch.utils.dlpack.to_dlpack
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch_private.set_grad_enabled
_functorch_active = torch_private.functorch_transforms_active
_node_owner = torch_private.node_owner  # (None where a context owns its autograd node)
# (csrc/saved_tensors.cc installs its hooks with these)
_push_saved_hooks = torch_private.push_saved_tensors_default_hooks
_pop_saved_hooks = torch_private.pop_saved_tensors_default_hooks


_refused = threading.local()  # .error: the last UnknownFunctionError of a node made on this thread


def _function(name: str) -> type:
    """The Function a node names. A refused name is kept for take_refusal: ONNX Runtime turns the
    error into text of its own, which an `except UnknownFunctionError` would not catch."""
    try:
        return lookup(name)
    except registry.UnknownFunctionError as e:
        _refused.error = e
        raise


def take_refusal() -> registry.UnknownFunctionError | None:
    """The UnknownFunctionError of the last node refused on this thread since the last call."""
    error, _refused.error = getattr(_refused, "error", None), None
    return error


def format_exception(exc: BaseException, tb=None) -> str:
    """The exception and its traceback `tb` (exc.__traceback__ when None: an exception raised by a
    Function the kernel called directly, with no Python frame above, has none of its own yet)."""
    return "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)).rstrip()


def _as_tuple(result, what: str) -> tuple:
    if isinstance(result, torch.Tensor) or result is None:
        return (result,)
    if isinstance(result, (tuple, list)):
        return tuple(result)
    raise TypeError(f"{what} returned {type(result).__name__}; expected a tensor or a tuple of tensors")


def _export_tensor(t, owner: str, index: int, device: torch.device):
    """A DLPack capsule of `t`, which must be a dense tensor on `device`; the kernel checks its
    dtype and rank against the node. (The forward inlines the common case: a dense CPU tensor on
    the CPU.)"""
    if isinstance(t, torch.Tensor) and t.device == device and t.layout == torch.strided:
        return _to_dlpack(t)
    what = f"{owner} {index}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} is {type(t).__name__}; expected a torch.Tensor")
    if t.layout != torch.strided:
        raise RuntimeError(
            f"{what} is a {t.layout} tensor; ONNX Runtime takes dense tensors only (return t.to_dense())"
        )
    provider = "the CPU execution provider" if device.type == "cpu" else f"{device} (the CUDA execution provider)"
    raise RuntimeError(f"{what} is on {t.device}, but this kernel runs on {provider}")


def _forward_without_autograd(func: type, argument_count: int):
    """Calls the Function's forward (and setup_context) with a plain context, bypassing apply
    and autograd: ORT's safe_run_mode=0, for inference nodes that opt in."""
    needs_input_grad = (False,) * argument_count
    forward = func.forward
    setup_context = func.setup_context
    if uses_setup_context(func):

        def call(*args):
            output = forward(*args)
            ctx = FunctionCtx()
            ctx.needs_input_grad = needs_input_grad
            setup_context(ctx, args, output)
            return output
    else:

        def call(*args):
            ctx = FunctionCtx()
            ctx.needs_input_grad = needs_input_grad
            return forward(ctx, *args)

    return call


_Kind = _C.Constant.Kind
_CONSTANT_VALUE = {
    _Kind.BOOL: lambda c: bool(c.ints[0]),
    _Kind.INT: lambda c: c.ints[0],
    _Kind.FLOAT: lambda c: c.floats[0],
    _Kind.BOOL_TUPLE: lambda c: tuple(map(bool, c.ints)),
    _Kind.INT_TUPLE: lambda c: tuple(c.ints),
    _Kind.FLOAT_TUPLE: lambda c: tuple(c.floats),
    _Kind.OBJECT: lambda c: registry.pinned_object(c.ints[0]),
}


parse_forward = _C.parse_forward  # (a PythonOp node's attributes, validated as its kernel does it)


def arguments(layout) -> list:
    """Function.apply's arguments with the node's constants in place; tensor slots hold None."""
    args = [None] * len(layout.input_convention)
    constants = layout.constants
    literal_count = sum(c.kind == _Kind.LITERAL for c in constants)
    decoded = literals.decode(layout.literals, literal_count) if literal_count else []
    for c in constants:
        args[c.position] = decoded[c.ints[0]] if c.kind == _Kind.LITERAL else _CONSTANT_VALUE[c.kind](c)
    return args


class _Node:
    """What both nodes share: the device of the kernel's tensors, and the device work of a
    kernel off the CPU (on the CPU, its large copies: torch's copy runs on several threads)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"
        self._streams = {}  # ORT's stream handle -> torch's view of it

    def use_stream(self, stream: int):
        """Makes ORT's compute stream for this call (a cudaStream_t as int, 0 for none) torch's
        current stream on the node's device; returns what restore_stream puts back."""
        if self.device.type != "cuda":
            return None
        torch_stream = self._streams.get(stream)
        if torch_stream is None:  # (ExternalStream does not own ORT's stream)
            torch_stream = self._streams[stream] = (
                torch.cuda.ExternalStream(stream, device=self.device)
                if stream
                else torch.cuda.default_stream(self.device)
            )
        previous = torch.cuda.current_device(), torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(torch_stream)  # (which also makes its device current)
        return previous

    @staticmethod
    def restore_stream(previous) -> None:
        if previous is not None:
            device, stream = previous
            torch.cuda.set_stream(stream)
            torch.cuda.set_device(device)

    @staticmethod
    def copy_into(destination, source, overlapping: bool) -> None:
        """Writes the tensor of capsule `source` into the compact buffer of capsule `destination`,
        on the current stream. The source stays valid until the copy has run: the caching
        allocator reuses its memory only for work ordered after it on that stream."""
        source = _from_dlpack(source)
        _from_dlpack(destination).copy_(source.clone() if overlapping else source)

    @staticmethod
    def fill(destination, value: int) -> None:
        _from_dlpack(destination).fill_(value)


class DirectCall(NamedTuple):
    """A forward call on the CPU that the kernel makes itself, without `run` (python_op.cc,
    CallDirect), ending in the node's `result` where it meets anything unusual."""

    call: Callable  # apply without its pass-through wrapper, or forward (safe_run_mode=0)
    args: tuple  # the arguments, None in the tensor positions
    tensor_positions: tuple  # where the node's tensor inputs go among them, in input order


class ForwardNode(_Node):
    def __init__(self, layout: _C.ForwardLayout, device: str = "cpu"):
        super().__init__(device)
        self.func = _function(layout.func_name)
        self.apply = unrouted_apply(self.func)
        safe = layout.safe_run_mode
        args = arguments(layout)
        # How forward runs unless a functorch transform is active (which needs Function.apply):
        # apply without its pass-through wrapper, or forward itself with safe_run_mode=0.
        self.fast_call = direct_apply(self.func) if safe else _forward_without_autograd(self.func, len(args))
        self.name = registry.qualified_name(self.func)
        self.forward_output = f"{self.name}.forward output"
        self.args = args
        # Lists and dicts among the constants, which forward may change: each call gets its own.
        self.mutable = [i for i, a in enumerate(args) if _holds_mutable(a)]
        self.tensor_positions = layout.tensor_positions
        requires_grad = layout.requires_grad
        self.requires_grad = requires_grad if any(requires_grad) else None
        self.updated = {i for _, i in layout.in_place}  # tensor inputs updated in place (tensor_reuse_map)
        self.training = layout.training_mode
        self.output_count = len(layout.output_tensor_types)
        # A call on the CPU with no constant to copy: None where `run` is needed (also for a
        # training call that updates an input in place, whose input then becomes a copy).
        direct = not self.mutable and self.on_cpu and not (self.training and self.updated)
        self.direct = (
            DirectCall(self.fast_call or self.apply, tuple(args), tuple(self.tensor_positions)) if direct else None
        )

    def run(self, capsules: tuple) -> tuple:
        """(autograd context or None, one capsule per output[, indices of inputs modified in place])."""
        args = self.args.copy()
        for i in self.mutable:
            args[i] = copy.deepcopy(args[i])
        tensors = list(map(_from_dlpack, capsules))
        training = self.training
        if training:
            borrowed = self._prepare_training(tensors)
        for position, tensor in zip(self.tensor_positions, tensors):
            args[position] = tensor
        grad_was_enabled = _is_grad_enabled()
        if grad_was_enabled != training:
            _set_grad_enabled(training)
        try:
            outputs = self.fast_call(*args) if self.fast_call and not _functorch_active() else self.apply(*args)
        finally:
            if grad_was_enabled != training:
                _set_grad_enabled(grad_was_enabled)
            if training:
                _C._end_saving()
        return self.result(outputs, tensors, borrowed if training else None)

    def result(self, outputs, tensors: list, borrowed: set | None = None) -> tuple:
        """What `run` returns, from the Function's outputs and its tensor inputs (`borrowed` in
        training). The kernel's direct call ends here where it meets anything but plain CPU
        tensors out and unchanged inputs."""
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        elif type(outputs) is not tuple:
            outputs = _as_tuple(outputs, f"{self.name}.forward")
        if len(outputs) != self.output_count:
            raise RuntimeError(
                f"{self.name}.forward returned {len(outputs)} outputs, but the node declares "
                f"{self.output_count} (output_tensor_types)"
            )
        result = [self._context(outputs, borrowed) if borrowed is not None else None]
        on_cpu = self.on_cpu
        for i, o in enumerate(outputs):
            result.append(
                _to_dlpack(o)
                if on_cpu and isinstance(o, torch.Tensor) and o.is_cpu and o.layout == torch.strided
                else _export_tensor(o, self.forward_output, i, self.device)
            )
        for t in tensors:
            if t._version:  # the Function wrote into one of ORT's buffers: rare, checked in full
                result.append(self._modified_inputs(tensors, outputs))
                break
        return tuple(result)

    def _prepare_training(self, tensors: list) -> set:
        """Flags the inputs that need gradients (those updated in place become copies) and
        installs the saved-tensor hooks (_C._end_saving removes them); returns the addresses of
        ORT's input buffers."""
        if self.requires_grad:
            for i, flag in enumerate(self.requires_grad):
                if flag:
                    tensors[i].requires_grad_()
                    if i in self.updated:  # autograd refuses in-place updates of a leaf that requires grad
                        with torch.enable_grad():
                            tensors[i] = tensors[i].clone()
        # Inputs view ORT buffers that ORT reuses after this call: whatever the Function saves
        # for backward from them must be a copy (csrc/saved_tensors.h).
        _C._begin_saving([(t.data_ptr(), t.nbytes) for t in tensors])
        return {t.data_ptr() for t in tensors}

    @staticmethod
    def _context(outputs: tuple, borrowed: set):
        """The autograd node of the call, which is its context, or (that, what keeps it alive)
        where the context does not own its node (_node_owner); None when no output needs a
        gradient."""
        for o in outputs:
            ctx = getattr(o, "grad_fn", None)
            if ctx is not None:
                if vars(ctx):
                    _own_borrowed_attributes(ctx, borrowed)
                return ctx if _node_owner is None else (ctx, _node_owner(o))
        return None

    def _modified_inputs(self, tensors: list, outputs: tuple) -> list:
        """Indices of the inputs the Function wrote into, each of which it must return (the kernel
        then checks that ORT gave that output the input's buffer)."""
        modified = [i for i, t in enumerate(tensors) if t._version]
        returned = {o.data_ptr() for o in outputs}
        for i in modified:
            if tensors[i].data_ptr() not in returned:
                raise RuntimeError(
                    f"{self.name}.forward modified input {i} in place without returning it; ONNX Runtime may "
                    "still read that buffer. Modify a copy instead (x = x.clone())."
                )
        return modified


def _holds_mutable(value) -> bool:
    """Whether a constant is or holds a list or dict (tuples of plain values are safe to share)."""
    return isinstance(value, (list, dict)) or (isinstance(value, tuple) and any(map(_holds_mutable, value)))


def _own_borrowed_attributes(ctx, borrowed: set) -> None:
    # A tensor kept as a plain ctx attribute (ctx.x = x) would outlive ORT's buffer too.
    for key, value in vars(ctx).items():
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in borrowed:
            setattr(ctx, key, _kept_from_borrowed(value))


# Buffers of ORT's that torch owns for the length of a graph run: outputs the run's caller
# bound, by address, which no node writes after their own (training/session.py binds a Function's
# saved inputs so). Only code of this process adds to it (lending); a model file cannot.
_lent_buffers: dict[int, torch.Tensor] = {}


@contextlib.contextmanager
def lending(tensors: list):
    """`tensors` (outputs bound to a run) lent to the Functions the run calls while the block
    runs: what a Function saves of one is that tensor, not a copy (_kept_from_borrowed)."""
    for t in tensors:
        _lent_buffers[t.data_ptr()] = t
    try:
        yield
    finally:
        for t in tensors:
            del _lent_buffers[t.data_ptr()]


def context_ids_tensor(ids) -> torch.Tensor:
    """The context ids in `ids` (a 1-d int64 numpy array) as a tensor that owns their contexts:
    freeing it releases each one no backward took (_C.context_ids_capsule)."""
    return _from_dlpack(_C.context_ids_capsule(ids))


def _kept_from_borrowed(t: torch.Tensor) -> torch.Tensor:
    """What a Function keeps for backward of a tensor that views one of ORT's input buffers,
    where the run lent it: the tensor owning that buffer when t is all of it (the Function saved
    its input as ORT gave it, the common case: no view to make), else a view of that tensor,
    which keeps it alive (all of it, as a view keeps its base in eager); otherwise a copy (ORT
    reuses its buffers once the call returns)."""
    owner = _lent_buffers.get(t.data_ptr())
    if owner is not None and owner.shape == t.shape and owner.dtype == t.dtype and t.is_contiguous():
        return owner
    storage = t.untyped_storage()
    owner = _lent_buffers.get(storage.data_ptr())
    if owner is not None and owner.dtype == t.dtype and owner.untyped_storage().nbytes() == storage.nbytes():
        return owner.as_strided(t.shape, t.stride(), t.storage_offset())
    return t.detach().clone()


class BackwardNode(_Node):
    def __init__(self, layout: _C.BackwardLayout, device: str = "cpu"):
        super().__init__(device)
        self.func = _function(layout.func_name)
        self.backward = self.func.backward
        self.name = registry.qualified_name(self.func)
        self.backward_value = f"{self.name}.backward value"
        self.argument_count = len(layout.output_convention)
        self.outputs = [
            position if wanted else None
            for position, wanted in zip(layout.output_positions, layout.output_requires_grad)
        ]
        self.no_gradients = (None,) * len(self.outputs)
        self.gradient_dtypes = [dtypes.FROM_ONNX.get(t) for t in layout.output_tensor_types]
        # What the kernel calls itself on the CPU when every gradient input is present
        # (python_op_grad.cc, CallDirect), ending in `result` for anything unusual; None where
        # `run` is needed.
        self.direct = self.backward if self.on_cpu else None

    def run(self, ctx, capsules: tuple, absent: dict | None) -> tuple:
        """One capsule per wanted gradient output, None elsewhere (the kernel writes zeros where a
        gradient is wanted). `absent` maps forward outputs without a gradient input to their
        (shape, ONNX type)."""
        if ctx is None:  # no output of the forward needed a gradient: backward never runs
            return self.no_gradients
        grads = [None if c is None else _from_dlpack(c) for c in capsules]
        if absent and getattr(ctx, "_ortbridge_materialize_grads", True):
            for slot, (shape, onnx_type) in absent.items():
                grads[slot] = torch.zeros(shape, dtype=dtypes.FROM_ONNX[onnx_type], device=self.device)
        grad_was_enabled = _is_grad_enabled()
        if grad_was_enabled:
            _set_grad_enabled(False)
        try:
            results = self.backward(ctx, *grads)
        finally:
            if grad_was_enabled:
                _set_grad_enabled(True)
        return self.result(results)

    def result(self, results) -> tuple:
        """What `run` returns, from what backward returned."""
        if type(results) is not tuple:
            results = _as_tuple(results, f"{self.name}.backward")
        if (
            len(results) != self.argument_count
            and not (  # (extra trailing Nones: torch accepts them)
                len(results) > self.argument_count and all(r is None for r in results[self.argument_count :])
            )
        ):
            raise RuntimeError(
                f"{self.name}.backward returned {len(results)} values, but forward takes "
                f"{self.argument_count} arguments: return one gradient (or None) per "
                "forward argument"
            )
        gradients = []
        for position, dtype in zip(self.outputs, self.gradient_dtypes):
            g = None if position is None else results[position]
            if isinstance(g, torch.Tensor) and dtype is not None and g.dtype != dtype:
                g = g.to(dtype)  # (as autograd casts a gradient to its input's: AMP's custom_fwd casts inputs)
            gradients.append(None if g is None else _export_tensor(g, self.backward_value, position, self.device))
        return tuple(gradients)
