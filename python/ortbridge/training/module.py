"""ortbridge.OrtModule: an nn.Module whose forward and backward ONNX Runtime runs."""

from __future__ import annotations

import hashlib
import logging
import os
import time

import onnxruntime as ort
import torch
import torch.nn.modules.module as nn_module

from .._torch_private import pytree
from .capture import Capture

log = logging.getLogger("ortbridge")

# Bumped whenever any module gains or replaces a parameter, buffer or submodule: OrtModule walks
# its module's parameters and buffers again only then, not on every call.
_registrations = [0]


def _registered(*args) -> None:
    _registrations[0] += 1


for _hook in (nn_module.register_module_parameter_registration_hook,
              nn_module.register_module_buffer_registration_hook, nn_module.register_module_module_registration_hook):
    _hook(_registered)


def _signature(leaf, dynamic: bool) -> object:
    if isinstance(leaf, torch.Tensor):
        return (leaf.dtype, leaf.dim() if dynamic else leaf.shape, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf), id(leaf))
    return (type(leaf), leaf)


class OrtModule(torch.nn.Module):
    """Wraps `module` so that ONNX Runtime runs its forward and backward graphs, with every
    autograd.Function it calls run by PyTorch as a PythonOp (forward) and PythonOpGrad
    (backward). Parameters and buffers stay the module's own: optimizers, state_dict and
    `.grad` work as in eager mode.

    A graph is captured for each signature of the arguments (tensor dtypes, shapes, devices and
    requires_grad; other values), train/eval mode and grad mode, on first use, and again once the
    module's parameters or buffers are other tensors (a layer replaced, load_state_dict(assign=True)). With
    `dynamic=True` tensor sizes are symbols instead: a capture serves every call with sizes that
    meet the relations its trace relied on (sizes 0 and 1 are specialized, as torch does). Under
    torch.no_grad (or when nothing needs a gradient) an inference graph runs, which keeps no
    autograd context. `all_functions=False` keeps only Functions registered with
    ortbridge.register as PythonOp nodes (others are traced into ONNX ops); by default every
    Function the module calls is registered, under its qualified name.

    `session_options` (onnxruntime.SessionOptions) and `providers` are used for every graph's
    session (default: torch's thread count, one thread for a graph of small tensors; threads
    that sleep or spin during a run, as a CPU graph's first runs measure; the CPU provider).
    `save_graphs`: a folder where each capture writes its ONNX graphs, named
    `<Module>_<signature>_<k>_{forward,backward,inference}.onnx`. Captures are logged (logger
    `ortbridge`, INFO) with their times. `parameters()`, `named_parameters()`, `buffers()`,
    `modules()` and their named forms give the wrapped module's (names without a prefix).
    """

    def __init__(self, module: torch.nn.Module, *, all_functions: bool = True, dynamic: bool = False,
                 session_options: ort.SessionOptions | None = None, providers: list | None = None,
                 save_graphs: str | os.PathLike | None = None):
        super().__init__()
        self.module = module
        self.all_functions = all_functions
        self.dynamic = dynamic
        self.options = {"session_options": session_options, "providers": providers,
                        "save_graphs": os.fspath(save_graphs) if save_graphs is not None else None}
        self._captures: dict = {}  # signature -> the captures made for it
        self._state: tuple = ((), ())  # the module's parameters and buffers, which the captures hold
        self._state_registrations = None  # _registrations when _state was read

    def forward(self, *args, **kwargs):
        if not kwargs and all(type(x) is torch.Tensor for x in args):  # (no pytree walk: most calls)
            leaves, spec = args, len(args)
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
        if self._state_registrations != _registrations[0]:
            self._check_state()
        key = (self.module.training, torch.is_grad_enabled(), spec,
               tuple(_signature(x, self.dynamic) for x in leaves),
               tuple(p.requires_grad for p in self._state[0]))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        captures = self._captures.setdefault(key, [])
        capture = next((c for c in captures if c.accepts(tensors)), None)
        if capture is None:
            name = f"{type(self.module).__name__}_{hashlib.sha1(repr(key).encode()).hexdigest()[:10]}_{len(captures)}"
            log.info("capturing %s (%s mode, %d tensor arguments)", name, "train" if key[0] else "eval", len(tensors))
            started = time.perf_counter()
            capture = Capture(self.module, args, kwargs, self.all_functions, self.dynamic, self.options, name)
            log.info("captured %s in %.2f s", name, time.perf_counter() - started)
            captures.append(capture)
        return capture(tensors)

    def _check_state(self) -> None:
        """Drops the captures when the module's parameters or buffers are other tensors than those
        they hold (a layer replaced, load_state_dict(assign=True))."""
        state = (list(self.module.parameters()), list(self.module.buffers()))
        if any(len(now) != len(then) or any(a is not b for a, b in zip(now, then))
               for now, then in zip(state, self._state)):
            self._captures.clear()
        self._state, self._state_registrations = state, _registrations[0]

    # The wrapped module's names, as ORTModule gave them: optimizer parameter groups and
    # checkpoints written for the bare module work unchanged.
    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self.module.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self.module.named_buffers(*args, **kwargs)

    def modules(self):
        return self.module.modules()

    def named_modules(self, *args, **kwargs):
        return self.module.named_modules(*args, **kwargs)

    # The wrapped module's names, as a checkpoint of either expects.
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)
