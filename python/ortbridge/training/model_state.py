"""What a capture depends on besides its arguments, and the state it cannot carry.

A captured graph runs without the model's Python code. So everything its trace read that is not
an argument decides whether the graph may run again (the state key: each module's train/eval
mode, autocast, the settings below); hooks run only where their work is a tensor computation the
trace recorded, others are refused; and a forward that changes the model's Python attributes is
refused, as the graph would not change them again.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import itertools
import operator
import threading
import types

import torch
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from torch.utils.hooks import RemovableHandle

from .._compat.torch_private import MODULE_INTERNALS, global_module_hooks, module_hooks, registered_members


class CaptureError(RuntimeError):
    """A module ortbridge cannot capture; the message says where and what to do."""


# Hooks whose whole work is a parameter computed from others (weight_norm, spectral_norm): the
# trace records that computation, which every run of the graph repeats. They set that parameter
# as a plain attribute on each call (`hook.name`).
TRACED_HOOKS = (WeightNorm, SpectralNorm)
# Hooks whose whole work is to collect a module's outputs for forward to return: the trace records
# them as outputs of the graph (transformers' output_hidden_states / output_attentions).
_COLLECTING_HOOK_MODULES = ("transformers.utils.output_capturing",)


# Hooks whose whole work is requires_grad_(True) on a module's output (transformers'
# enable_input_require_grads, which its gradient checkpointing turns on, for reentrant checkpoints):
# the trace runs them; in a graph gradients flow by the graph's own derivative.
_REQUIRES_GRAD_HOOKS = (("transformers.modeling_utils", "make_inputs_require_grads"),)


def _traced(hook) -> bool:
    return (
        isinstance(hook, TRACED_HOOKS)
        or getattr(hook, "__module__", None) in _COLLECTING_HOOK_MODULES
        or (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) in _REQUIRES_GRAD_HOOKS
    )


_AUTOCAST_DEVICES = ("cpu", "cuda")
_VALUES = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)


def settings() -> tuple:
    """Global settings a trace reads: grad mode, autocast per device type (whether on, its
    dtype), deterministic algorithms, float32 matmul precision, the default dtype."""
    return (
        torch.is_grad_enabled(),
        torch.get_default_dtype(),
        *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
    )


def autocast_state() -> tuple:
    """(device type, dtype) of each device type autocast is on for."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_on(state: tuple):
    """Autocast on as autocast_state() gave it."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


class FunctionsAutocast(threading.local):
    """The autocast state a graph's Functions run under, as eager runs them: a forward or inference
    graph's, that of the call it was captured for; a backward graph's, that of the code calling
    backward(), which each forward call under autocast records from a hook on its outputs'
    autograd nodes (AOTAutograd's runtime turns autocast off around the graphs of a forward it
    runs under autocast; eager runs a Function's backward under backward's caller's state, which
    custom_bwd replaces with the forward's)."""

    def __init__(self, state: tuple = ()):
        self.state = state

    def record_from(self, outputs) -> None:
        for node in {t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}:
            node.register_prehook(self._record)

    def _record(self, grad_outputs) -> None:
        self.state = autocast_state()


class Hooks:
    """The hooks of a module tree, read again only when some hook may have changed: a hook's
    registration numbers it (RemovableHandle.next_id), so while none is registered and none was
    there, none is; where some are, they are read on each call (a removal numbers nothing)."""

    def __init__(self):
        self._numbered = -1  # RemovableHandle.next_id when last read
        self.key: tuple = ()  # (module index, kind, hook ids) of each traced hook

    def check(self, modules: list) -> tuple:
        """The key of the hooks on `modules` [(name, module)]; raises CaptureError for a hook a
        graph cannot run."""
        if self._numbered != RemovableHandle.next_id or self.key:
            self.key = _hooks_key(modules)  # (raising, it leaves them to be read again)
            self._numbered = RemovableHandle.next_id
        return self.key

    def forget(self) -> None:
        """Read them again at the next check (the modules are others)."""
        self._numbered = -1


def _hooks_key(modules: list) -> tuple:
    for kind, hooks in global_module_hooks().items():
        raise CaptureError(
            f"a global module {kind[:-1].replace('_', ' ')} is registered "
            f"({next(iter(hooks.values()))!r}); inside a captured graph it would run only while "
            "capturing, on trace tensors, never on later calls. Remove it while using OrtModule."
        )
    key = []
    for index, (name, module) in enumerate(modules):
        for kind, hooks in module_hooks(module).items():
            untraced = [h for h in hooks.values() if not _traced(h)]
            if untraced:
                where = f"submodule '{name}'" if name else "the wrapped module"
                # (FSDP2's fully_shard: its hooks gather and free parameters around each forward)
                sharded = "FSDP" in type(getattr(untraced[0], "__self__", None)).__name__
                raise CaptureError(
                    f"{where} ({type(module).__name__}) has a {kind[:-1].replace('_', ' ')} ({untraced[0]!r}); a "
                    "captured graph runs without the model's Python code, so the hook would run only while "
                    "capturing, on trace tensors, never on later calls. "
                    + (
                        "It is sharded with fully_shard: wrap each block in an OrtModule first, then fully_shard the "
                        "blocks and the model (or compile each sharded block: block.compile(backend='ortbridge'))."
                        if sharded
                        else "Register it on the OrtModule instead (its hooks run in PyTorch around the "
                        "graphs, with real tensors), or remove it."
                    )
                )
            key.append((index, kind, tuple(hooks)))
    return tuple(key)


class Members:
    """The registered members of a module tree as last read: each module's submodules, parameters
    and buffers. `changed()` is the identity check each call makes: it sees a member added, removed
    or replaced however that was done, by registration, load_state_dict(assign=True), or
    torch.func.functional_call, which writes `module._parameters[name]` directly. (A process-wide
    registration hook would see fewer, and dynamo would guard on it in every compiled model.)"""

    _ABSENT = object()

    def __init__(self, modules: list | None = None):
        """(None: not read yet, changed() until it is)"""
        self._dicts = [d for m in modules or () for d in registered_members(m)]
        self._sizes = tuple(map(len, self._dicts)) if modules is not None else None
        self._owners = [d for d in self._dicts for _ in d]
        self._names = [k for d in self._dicts for k in d]
        self._values = [v for d in self._dicts for v in d.values()]

    def changed(self) -> bool:
        # (in C throughout: a few nanoseconds a member)
        return tuple(map(len, self._dicts)) != self._sizes or not all(
            map(operator.is_, map(dict.get, self._owners, self._names, itertools.repeat(self._ABSENT)), self._values)
        )


class Constants:
    """The plain values among the modules' attributes (numbers, strings, None, dtypes, enums,
    tuples, lists and dicts of them: dropout's p, a conv's padding, grad_checkpointing) and among
    those of the plain objects a module holds (a Hugging Face config), which a trace reads as
    constants: a capture runs only while they hold (one get and compare per object)."""

    def __init__(self, modules: list, written: frozenset = frozenset()):
        """`written`: (submodule name, attribute) of module attributes that a Function running as a
        PythonOp writes, in PyTorch at every call: not constants."""
        self._held = []  # (an object's __dict__, a getter of its plain values' names, a copy of their values)
        for module_name, attributes in _holders(modules):
            names = [
                k
                for k, v in attributes.items()
                if k not in MODULE_INTERNALS and _plain(v) and (module_name, k) not in written
            ]
            if names:
                get = operator.itemgetter(*names, *names[:1])  # (twice the first: a tuple, for one name too)
                self._held.append((attributes, get, copy.deepcopy(get(attributes))))

    def hold(self) -> bool:
        try:
            return all(get(attributes) == values for attributes, get, values in self._held)
        except KeyError:  # (an attribute deleted)
            return False


def _holders(modules: list):
    """(the module's name, its __dict__) of each module, then (None, the __dict__) of each plain
    object a module holds (once each)."""
    seen = set()
    for name, m in _written_in_python(modules):
        for holder in (m, *(v for k, v in vars(m).items() if k not in MODULE_INTERNALS and _record(v))):
            if id(holder) not in seen:
                seen.add(id(holder))
                yield (name if holder is m else None), vars(holder)


def _record(value) -> bool:
    """Whether `value` is an object whose attributes are data (a config), not code or tensors."""
    return (
        isinstance(getattr(value, "__dict__", None), dict)
        and not callable(value)
        and not isinstance(value, (torch.nn.Module, torch.Tensor, type, types.ModuleType))
    )


def _written_in_python(modules):
    """The modules whose attributes are the model's: not an FX graph's (dynamo's graph for the
    torch.compile backend), whose code FX makes and sets itself at its first call."""
    return ((name, m) for name, m in modules if not isinstance(m, torch.fx.GraphModule))


def _plain(value, depth: int = 0) -> bool:
    if type(value) in _VALUES or isinstance(value, enum.Enum):
        return True
    if depth > 2 or not isinstance(value, (tuple, list, dict)) or len(value) > 64:
        return False
    items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
    return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in items)


def refuse_caches(args: tuple, kwargs: dict) -> None:
    """Raises CaptureError for a Hugging Face KV cache among the arguments (a DynamicCache, any
    transformers Cache): the forward writes each step's keys and values into it, which a captured
    graph would write as trace tensors into the caller's object."""
    for name, value in (*enumerate(args), *kwargs.items()):
        if any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(value).__mro__):
            raise CaptureError(
                f"argument {name!r} is a Hugging Face {type(value).__name__}, which the forward updates in place: "
                "OrtModule cannot capture a KV cache object yet. Call it with use_cache=False (generate(..., "
                "use_cache=False)), or without a cache."
            )


def refuse_mistraced(module: torch.nn.Module) -> None:
    """Raises CaptureError for a submodule whose trace differs from eager: a multi-layer RNN with
    dropout in training, whose dropout between layers torch's decomposition leaves out (a
    condition that is never true, torch/_decomp/decompositions.py, _rnn_helper; 2.9 to 2.15); a
    batch norm training with momentum=None, whose factor a graph would keep at its first value."""
    for name, m in module.named_modules():
        if (  # (a batch norm, by what its forward reads)
            m.training
            and getattr(m, "track_running_stats", False)
            and isinstance(getattr(m, "num_batches_tracked", None), torch.Tensor)
            and getattr(m, "momentum", 0) is None
        ):
            raise CaptureError(
                f"submodule '{name}' ({type(m).__name__}) has momentum=None: a cumulative average, whose factor "
                "torch computes in Python from num_batches_tracked on each call, which a captured graph would keep "
                "at its first value. torch.optim.swa_utils.update_bn sets it: call update_bn with the wrapped "
                "module (update_bn(loader, ort_module.module)), which runs eagerly; or give the layer a momentum."
            )
        if isinstance(m, torch.nn.RNNBase) and m.training and m.dropout > 0 and m.num_layers > 1:
            raise CaptureError(
                f"submodule '{name}' ({type(m).__name__}, {m.num_layers} layers, dropout={m.dropout}) would train "
                "without its dropout between layers: torch's decomposition of multi-layer RNNs leaves it out. "
                "Set dropout=0, or call that module outside the OrtModule (its output as an argument)."
            )


def attributes(module: torch.nn.Module) -> dict:
    """{(submodule name, attribute): value} of each submodule's own Python attributes: not its
    parameters, buffers, submodules or hooks, nor the parameter a traced hook sets. A list's,
    dict's or set's value is (it, a shallow copy): a forward may change it in place."""
    state = {}
    for name, m in _written_in_python(module.named_modules()):
        set_by_hooks = {
            h.name for hooks in module_hooks(m).values() for h in hooks.values() if isinstance(h, TRACED_HOOKS)
        }
        state.update(
            ((name, attr), (value, copy.copy(value) if type(value) in (list, dict, set) else None))
            for attr, value in vars(m).items()
            if attr not in MODULE_INTERNALS and attr not in set_by_hooks
        )
    return state


def _same(a: tuple, b: tuple) -> bool:
    """Whether an attribute is as it was: the same object (a plain value: an equal one), with the
    same entries (by identity) where it is a list, dict or set."""
    (x, entries), (y, _) = a, b
    if x is not y:
        return type(x) is type(y) and type(x) in _VALUES and (x == y or x != x and y != y)  # (NaN)
    if entries is None or isinstance(entries, set):
        return entries is None or entries == x
    if isinstance(entries, dict):
        return entries.keys() == x.keys() and all(x[k] is v for k, v in entries.items())
    return len(entries) == len(x) and all(u is v for u, v in zip(entries, x))


def changed_attributes(before: dict, after: dict, added: bool = False) -> list:
    """The keys of the attributes that differ between two attributes() of one module (with
    `added`, not those only `after` has)."""
    return sorted(
        k
        for k in (before.keys() if added else before.keys() | after.keys())
        if k not in before or k not in after or not _same(before[k], after[k])
    )


def refuse_changes(
    before: dict, module: torch.nn.Module, added: bool = False, written: frozenset = frozenset()
) -> None:
    """Raises CaptureError if a run of forward changed an attribute of `before` (attributes(module)
    before it), after putting every changed one back: the capture leaves the model as it was.
    `added`: attributes the run added are no change (lazy initialization, as transformers'
    `_output_capturing_hooks_installed`; the capture checks that the trace changes them no more).
    `written`: attributes a Function running as a PythonOp wrote, which it writes at every call."""
    after = attributes(module)
    changed = [k for k in changed_attributes(before, after, added) if k not in written]
    if not changed:
        return
    first = changed[0]  # (described before anything is put back)
    was = "not set"
    if first in before:
        value, entries = before[first]
        was = repr(value if entries is None else entries)
    now = repr(after[first][0]) if first in after else "deleted"
    modules = dict(module.named_modules())
    for name, attr in changed:
        if (name, attr) in before:
            value, entries = before[name, attr]
            if entries is not None:  # (changed in place: its entries put back)
                value.clear()
                if isinstance(value, list):
                    value.extend(entries)
                else:
                    value.update(entries)
            setattr(modules[name], attr, value)
        else:
            delattr(modules[name], attr)
    name, attr = first
    raise CaptureError(
        f"the model's forward changes its Python attribute {'.'.join(filter(None, (name, attr)))} ({was[:60]} -> "
        f"{now[:60]}){f' and {len(changed) - 1} more' if len(changed) > 1 else ''}. A captured graph runs without "
        "forward's Python code, so it would not change again on later calls. Keep such state in a buffer that "
        "forward updates with tensor operations (register_buffer; the graph updates it), or outside the model."
    )
