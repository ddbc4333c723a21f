"""The Python side of one PythonOp / PythonOpGrad call.

The C++ kernels build one ForwardNode or BackwardNode per graph node when the session is
created and call its `run` on every Compute, holding the GIL. Inputs arrive as DLPack
capsules that view ONNX Runtime's buffers (borrowed for the duration of the call); outputs
leave as DLPack capsules that the kernel copies into ORT-allocated buffers.
"""

from __future__ import annotations

import traceback

import torch

from . import registry

_from_dlpack = torch.utils.dlpack.from_dlpack
_to_dlpack = torch.utils.dlpack.to_dlpack
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_push_saved_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_saved_hooks = torch._C._autograd._pop_saved_tensors_default_hooks

pinned_object = registry.pinned_object


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)).rstrip()


def _as_tuple(result, what: str) -> tuple:
    if isinstance(result, torch.Tensor) or result is None:
        return (result,)
    if isinstance(result, (tuple, list)):
        return tuple(result)
    raise TypeError(f"{what} returned {type(result).__name__}; expected a tensor or a tuple of tensors")


def _export_tensor(t, owner: str, index: int):
    """A DLPack capsule of `t`; the kernel checks its dtype and rank against the node."""
    if isinstance(t, torch.Tensor) and t.is_cpu:
        return _to_dlpack(t)
    what = f"{owner} {index}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} is {type(t).__name__}; expected a torch.Tensor")
    raise RuntimeError(f"{what} is on {t.device}, but this kernel runs on the CPU execution provider")


def _unpack_saved(t):
    return t


class Saved:
    """What a training-mode forward keeps for its backward: the autograd context (None when
    no output needs a gradient) and the shapes and dtypes of the outputs and tensor inputs,
    from this very call."""

    __slots__ = ("ctx", "outputs", "inputs")

    def __init__(self, ctx, outputs, inputs):
        self.ctx = ctx
        self.outputs = outputs
        self.inputs = inputs


class ForwardNode:
    def __init__(self, func_name: str, args: list, tensor_positions: list, requires_grad: list,
                 training: bool, output_count: int):
        self.func = registry.lookup(func_name)
        self.apply = self.func.apply
        self.name = registry.qualified_name(self.func)
        self.forward_output = f"{self.name}.forward output"
        self.args = args
        self.tensor_positions = tensor_positions
        self.requires_grad = requires_grad if any(requires_grad) else None
        self.training = training
        self.output_count = output_count

    def run(self, capsules: tuple) -> tuple:
        args = self.args.copy()
        tensors = [_from_dlpack(c) for c in capsules]
        for position, tensor in zip(self.tensor_positions, tensors):
            args[position] = tensor
        if self.training:
            return self._run_training(args, tensors)
        grad_was_enabled = _is_grad_enabled()
        if grad_was_enabled:
            _set_grad_enabled(False)
        try:
            outputs = self.apply(*args)
        finally:
            if grad_was_enabled:
                _set_grad_enabled(True)
        return self._export(None, outputs, tensors)

    def _run_training(self, args: list, tensors: list) -> tuple:
        if self.requires_grad:
            for tensor, flag in zip(tensors, self.requires_grad):
                if flag:
                    tensor.requires_grad_()
        # Inputs view ORT buffers that ORT reuses after this call: whatever the Function saves
        # for backward from them must be a copy. Other saved tensors are kept detached, which
        # also breaks the cycle output -> node -> saved output.
        borrowed = {t.data_ptr() for t in tensors}

        def pack(t):
            return t.clone() if t.untyped_storage().data_ptr() in borrowed else t.detach()

        grad_was_enabled = _is_grad_enabled()
        _set_grad_enabled(True)
        _push_saved_hooks(pack, _unpack_saved)
        try:
            outputs = self.apply(*args)
        finally:
            _pop_saved_hooks()
            _set_grad_enabled(grad_was_enabled)
        if type(outputs) is not tuple:
            outputs = _as_tuple(outputs, f"{self.name}.forward")
        ctx = next((o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None), None)
        if ctx is not None:
            _own_borrowed_attributes(ctx, borrowed)
        saved = Saved(ctx,
                      [(o.shape, o.dtype) for o in outputs if isinstance(o, torch.Tensor)],
                      [(t.shape, t.dtype) for t in tensors])
        return self._export(saved, outputs, tensors)

    def _export(self, saved, outputs, tensors: list) -> tuple:
        """(saved context or None, one capsule per output[, indices of inputs modified in place])."""
        if type(outputs) is not tuple:
            outputs = _as_tuple(outputs, f"{self.name}.forward")
        if len(outputs) != self.output_count:
            raise RuntimeError(f"{self.name}.forward returned {len(outputs)} outputs, but the node declares "
                               f"{self.output_count} (output_tensor_types)")
        result = (saved, *[_export_tensor(o, self.forward_output, i) for i, o in enumerate(outputs)])
        modified = [i for i, t in enumerate(tensors) if t._version]
        if modified:
            self._check_modified(modified, tensors, outputs)
            result += (modified,)
        return result

    def _check_modified(self, modified: list, tensors: list, outputs: tuple) -> None:
        returned = {o.data_ptr() for o in outputs if isinstance(o, torch.Tensor)}
        for i in modified:
            if tensors[i].data_ptr() not in returned:
                raise RuntimeError(
                    f"{self.name}.forward modified input {i} in place without returning it; ONNX Runtime may "
                    "still read that buffer. Modify a copy instead (x = x.clone()).")


def _own_borrowed_attributes(ctx, borrowed: set) -> None:
    # A tensor kept as a plain ctx attribute (ctx.x = x) would outlive ORT's buffer too.
    for key, value in vars(ctx).items():
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in borrowed:
            setattr(ctx, key, value.detach().clone())


class BackwardNode:
    def __init__(self, func_name: str, argument_count: int, output_positions: list, requires_grad: list):
        self.func = registry.lookup(func_name)
        self.backward = self.func.backward
        self.name = registry.qualified_name(self.func)
        self.backward_value = f"{self.name}.backward value"
        self.argument_count = argument_count
        self.outputs = list(zip(output_positions, requires_grad))

    def run(self, saved: Saved, capsules: tuple) -> tuple:
        results = None
        if saved.ctx is not None:  # else no output of the forward needed a gradient
            results = self._call_backward(saved, [None if c is None else _from_dlpack(c) for c in capsules])
        gradients = []
        for k, (position, wanted) in enumerate(self.outputs):
            if not wanted:
                gradients.append(None)
                continue
            shape, dtype = saved.inputs[k]
            g = None if results is None else results[position]
            if g is None:
                g = torch.zeros(shape, dtype=dtype)
            elif isinstance(g, torch.Tensor) and g.shape != shape:
                raise RuntimeError(f"{self.name}.backward value {position} has shape {tuple(g.shape)}, but "
                                   f"the forward input had shape {tuple(shape)}")
            gradients.append(_export_tensor(g, self.backward_value, position))
        return tuple(gradients)

    def _call_backward(self, saved: Saved, grads: list) -> tuple:
        if len(grads) != len(saved.outputs):
            raise RuntimeError(f"the node passes {len(grads)} gradients, but {self.name}.forward returned "
                               f"{len(saved.outputs)} outputs")
        ctx = saved.ctx
        if getattr(ctx, "_ortbridge_materialize_grads", True):
            for i, g in enumerate(grads):
                if g is None:
                    shape, dtype = saved.outputs[i]
                    grads[i] = torch.zeros(shape, dtype=dtype)
        grad_was_enabled = _is_grad_enabled()
        _set_grad_enabled(False)
        try:
            results = _as_tuple(self.backward(ctx, *grads), f"{self.name}.backward")
        finally:
            _set_grad_enabled(grad_was_enabled)
        if len(results) != self.argument_count:
            raise RuntimeError(f"{self.name}.backward returned {len(results)} values, but forward takes "
                               f"{self.argument_count} arguments: return one gradient (or None) per "
                               "forward argument")
        return results
