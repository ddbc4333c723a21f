"""ortbridge.OrtModule: an nn.Module whose forward and backward ONNX Runtime runs."""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import logging
import operator
import os
import time
import warnings

import onnxruntime as ort
import torch

from .._compat.torch_private import as_written, calls_routed, functorch_transforms_active, registered_members
from .capture import Capture, flatten
from .model_state import Constants, Hooks, Members, settings
from .session import GraphInputChanged

log = logging.getLogger("ortbridge")
MAX_CAPTURES = 8  # per signature: an older one is dropped

_training, _requires_grad = operator.attrgetter("training"), operator.attrgetter("requires_grad")


def _signature(leaf, dynamic: bool) -> object:
    if isinstance(leaf, torch.Tensor):
        return (leaf.dtype, leaf.dim() if dynamic else leaf.shape, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return (type(leaf), id(leaf))
    return (type(leaf), leaf)


def _to_wrapped_names(module, state_dict: dict, prefix: str, *args) -> None:
    """A parent's checkpoint names the wrapped module's entries as OrtModule.state_dict does,
    `<prefix><name>`; loading reads them from the OrtModule's child, `<prefix>module.<name>`."""
    for name in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[f"{prefix}module.{name[len(prefix) :]}"] = state_dict.pop(name)


def _others(now: list, then: list) -> bool:
    return len(now) != len(then) or any(a is not b for a, b in zip(now, then))


class _Bound(functools.partial):
    """OrtModule.forward bound to an OrtModule, with the wrapped module's forward's signature, which
    tools read to choose what to pass (Hugging Face's Trainer, the dataset columns)."""

    @property
    def __signature__(self):
        return inspect.signature(self.args[0].module.forward)


class _with_the_wrapped_signature:  # noqa: N801 (a decorator)
    """OrtModule.forward: the function on the class, a _Bound on an OrtModule (made per access: kept
    on the OrtModule, it would make it a reference cycle)."""

    def __init__(self, function):
        self.function = function

    def __get__(self, instance, owner=None):
        return self.function if instance is None else _Bound(self.function, instance)


@torch.compiler.disable
def _outside_dynamo(run, args: tuple, kwargs: dict):
    """An OrtModule's call in a torch.compile'd caller (torch.compile(ort_module), a compiled parent
    holding one): dynamo ends its graph before it and starts another after it, as at any function it
    does not trace, so that ONNX Runtime runs the OrtModule's graphs, not AOTAutograd's trace of them."""
    return run(args, kwargs)


class OrtModule(torch.nn.Module):
    """Wraps `module` so that ONNX Runtime runs its forward and backward graphs, with every
    autograd.Function it calls run by PyTorch as a PythonOp (forward) and PythonOpGrad
    (backward). Parameters and buffers stay the module's own: optimizers, state_dict and
    `.grad` work as in eager mode.

    A graph is captured for each signature of the arguments (tensor dtypes, shapes, devices and
    requires_grad; other values) and of what its trace read besides them: each submodule's
    train/eval mode, the parameters' requires_grad, grad mode, autocast, deterministic algorithms,
    float32 matmul precision, hooks, and the plain values among the modules' attributes (dropout's
    p, a flag). It is captured again once the module's submodules are others (a layer replaced), it
    has more or fewer parameters or buffers, or one changes dtype, device or size (model.double(),
    .to()); parameters and buffers that are only other tensors (torch.func.functional_call,
    load_state_dict(assign=True)) are read from the module at each call and run in the captured
    graphs; torch's swap-tensors mode (load_state_dict, .to()) swaps into the parameters themselves,
    which the captures hold no weak reference to. Inside a torch.func transform (grad, vmap, ...) it refuses to run. Under torch.compile
    (a compiled caller) it runs as a graph of its own between dynamo's; a torch.compile'd module it
    wraps is captured as its code is written (not one inside it). A hook on a
    submodule that a graph cannot run (any but weight_norm's and spectral_norm's) and a forward
    that changes the model's Python attributes are refused (CaptureError); hooks on the OrtModule itself run in PyTorch around the graphs. A copy
    (deepcopy, pickle, torch.save) captures again at its first call. With
    `dynamic=True` tensor sizes are symbols instead: a capture serves every call with sizes that
    meet the relations its trace relied on (sizes 0 and 1 are specialized, as torch does); Hugging
    Face's `generate` of the wrapped model calls it so, without a KV cache (use_cache=False). Under
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

    `backward_stages`: how many ONNX Runtime runs a backward graph takes, each giving autograd
    the gradients it computed as soon as it ends (so that DDP all-reduces them while the next
    runs; up to that many: stages of about equal gradient bytes). By default one, unless
    torch.distributed runs more than one process; then about one per few MiB of gradients
    (training/stages.py).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        all_functions: bool = True,
        dynamic: bool = False,
        session_options: ort.SessionOptions | None = None,
        providers: list | None = None,
        save_graphs: str | os.PathLike | None = None,
        backward_stages: int | None = None,
    ):
        super().__init__()
        self.module = module
        self.all_functions = all_functions
        self.dynamic = dynamic
        self.options = {
            "session_options": session_options,
            "providers": providers,
            "save_graphs": os.fspath(save_graphs) if save_graphs is not None else None,
            "backward_stages": backward_stages,
        }
        self._captures: dict = {}  # signature -> the captures made for it
        self._state: tuple = ((), (), ())  # the module's submodules, parameters and buffers, which the captures hold
        self._members = Members()  # (not read yet)
        self._submodules: list = []  # the module's named_modules()
        self._hooks = Hooks()
        # Nested in a parent module, a checkpoint has the wrapped module's names here too.
        self.register_load_state_dict_pre_hook(_to_wrapped_names)
        self._made = True  # (from here, the wrapped module's attributes are set there)

    @_with_the_wrapped_signature
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # (dynamo tracing a compiled caller: ORT's graphs run between dynamo's)
            return _outside_dynamo(self._run, args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict, dynamic: bool | None = None):
        dynamic = self.dynamic if dynamic is None else dynamic
        if functorch_transforms_active():
            raise RuntimeError(
                "ortbridge.OrtModule cannot run inside a torch.func transform (grad, vmap, jacrev, jvp, ...): "
                "ONNX Runtime runs its graphs outside the transform. For gradients with respect to given "
                "parameters use torch.func.functional_call(ort_module, params, args) with torch.autograd.grad "
                "(OrtModule runs the tensors it is given), or transform the wrapped module (ort_module.module)."
            )
        if not kwargs and all(type(x) is torch.Tensor for x in args):  # (no pytree walk: most calls)
            leaves, spec = args, len(args)
        else:
            leaves, spec = flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        key, capture = self.lookup(leaves, spec, tensors, dynamic)
        capture = capture or self._capture(key, args, kwargs, dynamic)
        try:
            return capture(tensors)
        except GraphInputChanged as e:  # (a parameter or buffer changed dtype, device or size in place)
            log.info("%s: %s; capturing again", capture.name, e)
            self._captures.clear()
            return self._capture(key, args, kwargs, dynamic)(tensors)

    def lookup(self, leaves, spec, tensors: list, dynamic: bool | None = None) -> tuple[tuple, Capture | None]:
        """(the key of a call with these flattened arguments, the capture that serves it or None):
        the check each call makes (benchmarks/guard_cost.py measures it)."""
        dynamic = self.dynamic if dynamic is None else dynamic
        if self._members.changed():
            self._check_state()
        key = (
            tuple(map(_training, self._state[0])),
            settings(),
            self._hooks.check(self._submodules),
            spec,
            tuple(_signature(x, dynamic) for x in leaves),
            tuple(map(_requires_grad, self._state[1])),
        )
        captures = self._captures.get(key, ())
        return key, next((c for c in captures if c.constants.hold() and c.accepts(tensors)), None)

    def _capture(self, key: tuple, args: tuple, kwargs: dict, dynamic: bool) -> Capture:
        captures = self._captures.setdefault(key, [])
        if len(captures) == MAX_CAPTURES:  # (the oldest goes: an attribute value that changes on every call)
            warnings.warn(
                f"ortbridge.OrtModule captured {type(self.module).__name__} {MAX_CAPTURES} times for one "
                "signature: a module attribute value (or a config's) differs between its calls, and each "
                "value is a capture of its own. Keep such values fixed, or pass them as arguments.",
                stacklevel=4,
            )
            captures.pop(0)
        name = f"{type(self.module).__name__}_{hashlib.sha1(repr(key).encode()).hexdigest()[:10]}_{len(captures)}"
        log.info("capturing %s (%s mode)", name, "train" if self.module.training else "eval")
        started = time.perf_counter()
        # (OrtModule(torch.compile(m)): m as written; ONNX Runtime runs the graphs of what it computes)
        capture = Capture(as_written(self.module), args, kwargs, self.all_functions, dynamic, self.options, name)
        # (the values the trace read: the capture leaves every attribute as it was, but those its Functions write)
        capture.constants = Constants(self._submodules, frozenset(capture.written))
        log.info("captured %s in %.2f s", name, time.perf_counter() - started)
        captures.append(capture)
        return capture

    def _check_state(self) -> None:
        """Drops the captures when the module's submodules are others than those they hold (a layer
        replaced) or it has other parameters or buffers; where only some parameters or buffers are
        other tensors (functional_call, load_state_dict(assign=True)), the captures run them."""
        submodules = list(self.module.named_modules())
        state = ([m for _, m in submodules], list(self.module.parameters()), list(self.module.buffers()))
        if _others(state[0], self._state[0]) or any(len(now) != len(then) for now, then in zip(state, self._state)):
            self._captures.clear()
        elif _others(state[1], self._state[1]) or _others(state[2], self._state[2]):
            for capture in [c for captures in self._captures.values() for c in captures]:
                if not capture.rebind():
                    self._captures.clear()
                    break
        self._state = state
        self._members = Members([self, *state[0]])
        self._submodules = submodules
        self._hooks.forget()

    # A copy (deepcopy, pickle, torch.save) holds no capture: it captures again at its first call.
    def __getstate__(self):
        if self.options["session_options"] is not None:
            raise TypeError(
                "an OrtModule with session_options cannot be pickled (onnxruntime.SessionOptions "
                "cannot be): save its module, or its state_dict, and wrap it again where it is loaded"
            )
        return self._state_without_captures()

    def _state_without_captures(self) -> dict:
        return dict(vars(self), _captures={}, _state=((), (), ()), _members=Members(), _submodules=[], _hooks=Hooks())

    def __deepcopy__(self, memo: dict):
        options = self.options["session_options"]
        if options is not None:  # (shared: ONNX Runtime only reads a session's options)
            memo[id(options)] = options
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self._state_without_captures(), memo))
        return copied

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

    # The OrtModule itself, then the wrapped module's, under the same names: torch's fully_shard finds
    # the FSDP state it gives the OrtModule among the root's modules().
    def modules(self):
        for _, module in self.named_modules():
            yield module

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        memo = set() if memo is None else memo
        if remove_duplicate:
            if self in memo:
                return
            memo.add(self)
        yield prefix, self
        yield from self.module.named_modules(memo, prefix, remove_duplicate)

    # The wrapped module's names, as a checkpoint of either expects.
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __setattr__(self, name: str, value) -> None:
        # An attribute of the wrapped module is set there, where its forward reads it (set on the
        # OrtModule, `ort_module.flag = x` would change nothing the graph sees).
        # (Never a dunder: `__class__`, which torch's fully_shard sets to give the OrtModule its FSDP class.)
        module = self.__dict__.get("_modules", {}).get("module") if self.__dict__.get("_made") else None
        if (
            module is not None
            and not name.startswith("__")
            and name not in self.__dict__
            and name not in self._modules
            and hasattr(module, name)
        ):
            parameters = registered_members(module)[1]
            if name in parameters and isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                parameters[name] = value  # (as torch.func.functional_call swaps a parameter of the wrapped module)
            else:
                setattr(module, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(self._modules["module"], name)
        if name == "generate" and callable(value):  # (Hugging Face's: it calls the wrapped model itself)
            return functools.partial(self._generate, value)
        return value

    def _generate(self, generate, *args, **kwargs):
        """Hugging Face's generate of the wrapped model, each of its calls of the model run by this
        OrtModule with symbolic sizes: one capture serves every length the sequence grows to. Without
        a KV cache (use_cache=False, unless given): OrtModule does not capture a cache object yet
        (passed one, it refuses it), and the tokens are the same."""
        kwargs.setdefault("use_cache", False)
        with calls_routed(self.module, lambda *a, **k: self._run(a, k, dynamic=True)):
            return generate(*args, **kwargs)
