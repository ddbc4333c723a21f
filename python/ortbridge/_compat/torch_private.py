"""Every private torch API that ortbridge uses, in one place, with a branch where releases differ.

Supported: torch 2.9 to 2.15 (pyproject.toml; CI runs 2.9, 2.11, 2.13 and 2.15). No other module of
the package reaches a private torch name itself (tests/python/test_private_apis.py). A release
that lacks a name this module takes fails at `import ortbridge` with an error naming that name;
one that changed how Function.apply is called fails where apply is first routed, naming what
changed (csrc/apply_route.cc).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
import types

import torch

RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
OLDEST = (2, 9)
if RELEASE < OLDEST:
    raise ImportError(f"ortbridge needs torch 2.9 or later; this is torch {torch.__version__}")

try:
    # Autograd and grad mode, in the kernels' per-call path (plain C functions), and what the
    # exporters and the kernels share; all loaded with torch already.
    # The TorchScript exporter's graph values and tracing state.
    from torch._C import TensorType, Value, _storage_Use_Count
    from torch._C import _are_functorch_transforms_active as functorch_transforms_active
    from torch._C import _DisableAutocast as DisableAutocast
    from torch._C import _get_tracing_state as get_tracing_state
    from torch._C import _is_any_autocast_enabled as is_any_autocast_enabled
    from torch._C import _set_grad_enabled as set_grad_enabled
    from torch._C import _set_tracing_state as set_tracing_state
    from torch._C._autograd import _pop_saved_tensors_default_hooks as pop_saved_tensors_default_hooks
    from torch._C._autograd import _push_saved_tensors_default_hooks as push_saved_tensors_default_hooks
    from torch._C._autograd import _saved_tensors_hooks_is_enabled as saved_tensors_hooks_enabled
    from torch._ops import OpOverload, OpOverloadPacket
    from torch.autograd.function import _is_setup_context_defined
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
except ImportError as e:
    raise ImportError(f"ortbridge does not know torch {torch.__version__}: {e} (supported: torch 2.9 to 2.15)") from e


def as_written(module: torch.nn.Module) -> torch.nn.Module:
    """The module a torch.compile'd one (dynamo's OptimizedModule) wraps; any other, itself. (No
    module is compiled before dynamo is imported.)"""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return module._orig_mod if eval_frame and isinstance(module, eval_frame.OptimizedModule) else module


@contextlib.contextmanager
def calls_routed(module: torch.nn.Module, call):
    """Every call of `module` (module(...), module.__call__) goes to `call`, but those made inside
    it on its thread, which run the module's own: nn.Module's call runs an instance's
    `_compiled_call_impl` where there is one (as module.compile() sets)."""
    own = module._call_impl
    inside = threading.local()

    def routed(*args, **kwargs):
        if getattr(inside, "call", False):
            return own(*args, **kwargs)
        inside.call = True
        try:
            return call(*args, **kwargs)
        finally:
            inside.call = False

    previous = module.__dict__.get("_compiled_call_impl")
    module._compiled_call_impl = routed
    try:
        yield
    finally:
        module._compiled_call_impl = previous


# Tracing's names (AOTAutograd, fake tensors, decompositions, FX's settings), imported at their first
# use (the module's __getattr__): they bring in dynamo, which inference and the kernels never need.
# name -> (module, its attribute; None: the module itself)
_TRACING = {
    "aot_module_simplified": ("torch._functorch.aot_autograd", "aot_module_simplified"),
    "can_auto_functionalize": ("torch._higher_order_ops.auto_functionalize", "can_auto_functionalize"),
    "remove_effect_tokens": ("torch.export._remove_effect_tokens_pass", "_remove_effect_tokens"),
    "default_partition": ("torch._functorch.partitioners", "default_partition"),
    "MutationType": ("torch._functorch._aot_autograd.schemas", "MutationType"),
    "OutputType": ("torch._functorch._aot_autograd.schemas", "OutputType"),
    "decomposition_table": ("torch._decomp", "decomposition_table"),
    "get_decompositions": ("torch._decomp", "get_decompositions"),
    "compiling_state_context": ("torch._export.utils", "_compiling_state_context"),
    "TracingContext": ("torch._guards", "TracingContext"),
    "detect_fake_mode": ("torch._guards", "detect_fake_mode"),
    "tracing": ("torch._guards", "tracing"),
    "DataDependentOutputException": ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
    "DynamicOutputShapeException": ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
    "FakeTensorMode": ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    "fx_config": ("torch.fx.experimental._config", None),
    "IncompatibleKeys": ("torch.nn.modules.module", "_IncompatibleKeys"),
    "FloorDiv": ("torch.utils._sympy.functions", "FloorDiv"),
    "PythonPrinter": ("torch.utils._sympy.printers", "PythonPrinter"),
}


def __getattr__(name: str):
    if name not in _TRACING:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _TRACING[name]
    try:
        value = importlib.import_module(module)
        value = value if attribute is None else getattr(value, attribute)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"ortbridge does not know torch {torch.__version__}: it has no {module}"
            f"{'' if attribute is None else '.' + attribute} (supported: torch 2.9 to 2.15)"
        ) from e
    globals()[name] = value
    return value


from_dlpack = getattr(torch._C, "_from_dlpack", torch.utils.dlpack.from_dlpack)  # (the C function, where there is one)


def tensor_use_count(t: torch.Tensor) -> int:
    """The references C++ holds to the tensor (autograd's saved ones among them)."""
    return t._use_count()


def storage_users(t: torch.Tensor) -> int:
    """The tensors on t's storage, t among them. (Where torch keeps the storage's Python object,
    which reading the count makes, that object holds a reference too: the count of a tensor alone
    is measured at import.)"""
    return _storage_Use_Count(t.untyped_storage()._cdata) - _STORAGE_OBJECT_REFERENCES


def _references_of_a_lone_storage() -> int:
    alone = torch.empty(1)
    return _storage_Use_Count(alone.untyped_storage()._cdata) - 1


_STORAGE_OBJECT_REFERENCES = _references_of_a_lone_storage()


# --- autograd.Function --------------------------------------------------------------------------

# torch's apply in C, a classmethod descriptor of _C._FunctionBase. From torch 2.14 Function.apply
# is that descriptor itself; before, a Python classmethod that binds setup_context's default
# arguments and dispatches functorch's transforms, then calls it.
FUNCTION_BASE_APPLY = torch._C._FunctionBase.__dict__["apply"]
APPLY_IN_C = torch.autograd.Function.__dict__["apply"] is FUNCTION_BASE_APPLY


def backward_class(func: type) -> type:
    """The class of a Function's ctx (and autograd node), which torch makes for each Function."""
    return func._backward_cls


def leave_non_differentiable_gradients_absent(ctx) -> None:
    """The backward of ctx's Function gets None for an output marked non-differentiable, not zeros
    (what ctx.set_materialize_grads(False) does for every output)."""
    ctx._materialize_non_diff_grads = False


def uses_setup_context(func: type) -> bool:
    """Whether a Function defines setup_context; then apply binds keyword and defaulted
    arguments to positions."""
    return _is_setup_context_defined(func.setup_context)


# Function.apply routed, for _tracing/interception.py: every way of reaching apply (Fn.apply, a bound
# method stored before, an alias, a closure, functools.partial, super().apply in an override) ends
# in one function object, whose behavior is changed while routed; outside, a call costs what it did.
if APPLY_IN_C:
    # The method entry of torch's C function (csrc/apply_route.h); torch's own function stays
    # callable beside it.
    from .. import _C

    torch_apply = _C._unrouted_apply(FUNCTION_BASE_APPLY)  # torch_apply(cls, *args, **kwargs)

    def route_apply(route) -> None:
        """Until unroute_apply, each call of `cls.apply(*args, **kwargs)` is `route(cls, args, kwargs)`."""
        _C._route_apply(FUNCTION_BASE_APPLY, route)

    def unroute_apply() -> None:
        _C._unroute_apply(FUNCTION_BASE_APPLY)

    def apply_routed() -> bool:
        return _C._apply_routed(FUNCTION_BASE_APPLY)
else:
    # The Python function behind the classmethod gets another code object. Its one free variable
    # is super()'s __class__ cell, holding Function: the routing code reaches the route through it.
    _APPLY = torch.autograd.Function.__dict__["apply"].__func__
    _TORCH_CODE = _APPLY.__code__
    # torch's apply as a function object of its own (its zero-argument super() reads the same cell).
    torch_apply = types.FunctionType(_TORCH_CODE, _APPLY.__globals__, "apply", _APPLY.__defaults__, _APPLY.__closure__)

    def _routing_code() -> types.CodeType:
        __class__ = None  # (a cell of that name: the closure of torch's apply fits this code)

        def apply(cls, *args, **kwargs):
            return __class__._ortbridge_route(cls, args, kwargs)

        return apply.__code__

    _ROUTING_CODE = _routing_code()

    def route_apply(route) -> None:
        """Until unroute_apply, each call of `cls.apply(*args, **kwargs)` is `route(cls, args, kwargs)`."""
        torch.autograd.Function._ortbridge_route = staticmethod(route)
        _APPLY.__code__ = _ROUTING_CODE

    def unroute_apply() -> None:
        _APPLY.__code__ = _TORCH_CODE

    def apply_routed() -> bool:
        return _APPLY.__code__ is _ROUTING_CODE


# A PythonOp node of `func` stands for what `super().apply` reached in an override of apply (the
# override's own work is in the graph around the node), so what runs it is torch's apply bound to
# `func`, whatever `func` overrides.


def bound_apply(func: type):
    """torch's apply bound to `func`, routed as any apply is while ortbridge records or captures
    (a graph that runs as torch operators, onnx_to_torch, is captured again)."""
    return torch.autograd.Function.__dict__["apply"].__get__(None, func)


def unrouted_apply(func: type):
    """torch's apply bound to `func`, never routed: what a kernel calls (on every release alike,
    a kernel's call is not a call of the model a capture on its thread records)."""
    return torch_apply.__get__(None, func) if APPLY_IN_C else types.MethodType(torch_apply, func)


def direct_apply(func: type):
    """unrouted_apply(func) without torch's Python wrapper where that wrapper only passes the
    arguments on: no setup_context (whose default arguments it binds). None where it is needed.
    (From 2.14 there is no wrapper: unrouted_apply itself.)"""
    if APPLY_IN_C:
        return unrouted_apply(func)
    return None if uses_setup_context(func) else FUNCTION_BASE_APPLY.__get__(None, func)


# Where torch.compile's autograd_function_apply makes the Function class it applies, for a
# Function dynamo traced (its operators are in the graph already).
DYNAMO_FUNCTION_MODULE = "torch._functorch.autograd_function"
# Where torch.library makes the Function that runs a custom operator's registered autograd
# (register_autograd): part of the operator, not a Function of the model.
CUSTOM_OP_AUTOGRAD_MODULE = "torch._library.autograd"


# Up to torch 2.12 a Function's ctx (its THPFunction) holds only a weak reference to its autograd
# node, which its outputs own: once ORT has the outputs' values and torch's tensors are gone, the
# node is freed, and ctx.saved_tensors with it. What keeps the node alive then is another node
# with an edge to it that saves no data: the grad_fn of a view of an output. From 2.13 ctx owns
# its node (pytorch#179924), and nothing is needed. Which one this torch does is tried, not read
# off its version (a build between releases may have either).


class _Saves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def _context_owns_node() -> bool:
    with torch.inference_mode(False), torch.enable_grad():
        ctx = _Saves.apply(torch.zeros(1, requires_grad=True)).grad_fn  # (its output is gone at once)
        try:
            ctx.saved_tensors
        except RuntimeError:
            return False
    return True


CONTEXT_OWNS_NODE = _context_owns_node()


def _node_owner(output: torch.Tensor):
    """A node that keeps `output`'s grad_fn alive, saving none of its data (None for a tensor
    that is not dense, which a PythonOp refuses as an output anyway)."""
    if output.layout != torch.strided:
        return None
    enabled = torch.is_grad_enabled()
    set_grad_enabled(True)
    try:
        return output.view_as(output).grad_fn
    finally:
        set_grad_enabled(enabled)


node_owner = None if CONTEXT_OWNS_NODE else _node_owner


def forget_real_tensors(mode) -> None:
    """Drops a fake mode's weak references to the real tensors it made fakes of (a capture's
    parameters among them): torch.utils.swap_tensors (load_state_dict and .to() in torch's
    swap-tensors mode) refuses a tensor that any weak reference points to, and the mode lives on
    in the captured graphs' metadata. (Tensors only, which is what swap_tensors checks: clearing
    the storages' too made torch 2.9.1 crash in a later garbage collection.)"""
    mode.fake_tensor_converter.meta_converter.describer.lookup_tensor.clear()


# --- AOTAutograd ---------------------------------------------------------------------------------


@contextlib.contextmanager
def capture_config():
    """AOTAutograd's settings for a capture: the backward graph compiled with the forward graph, not
        at the first backward (a Step runs both), and no saved tensor a donated buffer (ORT reuses none;
        AOTAutograd's runtime would refuse retain_graph for one), effect tokens made and consumed inside
    the forward graph, not its inputs and outputs (fallback.fold_error_checks removes them)."""
    from torch._functorch import aot_autograd
    from torch._functorch import config as functorch_config

    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        with functorch_config.patch(
            force_non_lazy_backward_lowering=True, donated_buffer=False, unlift_effect_tokens=True
        ):
            yield
        return
    # torch 2.9: an argument of aot_module_simplified's preparation only, which it leaves at its default
    prepare = getattr(aot_autograd, "prepare_aot_module_simplified", None)
    defaults = getattr(prepare, "__kwdefaults__", None) or {}
    if "force_non_lazy_backward_lowering" not in defaults:
        raise RuntimeError(
            f"ortbridge does not know torch {torch.__version__}: its AOTAutograd has no setting that "
            "compiles the backward graph with the forward graph (force_non_lazy_backward_lowering)"
        )
    prepare.__kwdefaults__ = {**defaults, "force_non_lazy_backward_lowering": True}
    try:
        with functorch_config.patch(donated_buffer=False, unlift_effect_tokens=True):
            yield
    finally:
        prepare.__kwdefaults__ = defaults


def saved_for_backward(meta) -> tuple[slice, slice, slice]:
    """Where a forward graph's outputs for its backward graph are, by AOTAutograd's metadata:
    (tensors saved with a version check, tensors saved without one, symbolic ints). Before 2.11
    every saved tensor is checked."""
    if hasattr(type(meta), "tensors_saved_for_backwards_with_vc_check_slice"):
        return (
            meta.tensors_saved_for_backwards_with_vc_check_slice,
            meta.tensors_saved_for_backwards_no_vc_check_slice,
            meta.symints_saved_for_backwards_slice,
        )
    return meta.tensors_saved_for_backwards_slice, slice(0, 0), meta.symints_saved_for_backwards_slice


def opaque_objects_saved(meta) -> int:
    """Objects (not tensors) AOTAutograd saves for backward: none before 2.11."""
    return getattr(meta, "num_opaque_objects_saved_for_bw", 0) or 0


def is_tangent(output_info) -> bool:
    """Whether the backward graph takes a gradient input for this output of AOTAutograd's
    metadata (from 2.12 a view made under no_grad that inherits requires_grad does not)."""
    return getattr(output_info, "requires_grad_for_backward", output_info.requires_grad)


# --- torch's ONNX exporter ----------------------------------------------------------------------


def onnx_opsets(opset_version: int | None) -> tuple[int, int]:
    """(the model's opset, its translations' opset) as torch.onnx.export(dynamo=True) picks them:
    torch's default opset where None; translations no older than torchlib's (converted after)."""
    from torch.onnx import _constants as onnx_constants
    from torch.onnx._internal.exporter import _constants

    opset_version = opset_version or onnx_constants.ONNX_DEFAULT_OPSET
    return opset_version, max(opset_version, _constants.TORCHLIB_OPSET)


@functools.cache
def onnx_registry(registry_opset: int):
    """torch's ONNX translations for one opset, built once: torch.onnx.export builds them at each
    call (about a second)."""
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib(opset_version=registry_opset)


def onnx_decompositions(registry: object) -> tuple[frozenset, dict]:
    """(the operators torch's exporter translates with `registry`, the decompositions it applies
    to the others)."""
    from torch.onnx._internal.exporter import _decomp

    translated = frozenset(_decomp.get_onnx_implemented_overloads(registry))
    return translated, _decomp.create_onnx_friendly_decomposition_table(translated)


def torchscript_constant(value, kind: str):
    """A TorchScript exporter's graph value as the constant of `kind` ("b", "i", ...) it holds, or
    the value itself where it is not a constant."""
    from torch.onnx import symbolic_helper

    return symbolic_helper._maybe_get_const(value, kind)


def rename_node(node: torch.fx.Node, name: str) -> None:
    """Names an FX node `name`, or a free name made from it where another node of its graph has it."""
    node._rename(name)


def remove_assertion_nodes(graph_module: torch.fx.GraphModule) -> None:
    from torch.onnx._internal.exporter import _fx_passes

    _fx_passes.remove_assertion_nodes(graph_module)


@functools.cache
def onnx_exporter() -> types.SimpleNamespace:
    """The private functions of torch's exporter that an export of a decomposed program calls.
    `export` (torch.onnx.export's own call) and `translate` (with the steps around it, from
    _core.export's code) are None where this torch lacks them, or their `registry` parameter."""

    def taking_registry(function):
        return function if "registry" in inspect.signature(function).parameters else None

    exporter = types.SimpleNamespace(export=None, translate=None)
    with contextlib.suppress(ImportError, AttributeError):  # (in order: `translate` last, with all it needs)
        from torch.onnx._internal.exporter import _core, _fx_passes

        exporter.export = taking_registry(_core.export)
        exporter.insert_type_promotion_nodes = _fx_passes.insert_type_promotion_nodes
        exporter.remove_assertion_nodes = _fx_passes.remove_assertion_nodes
        exporter.convert_version = _core.onnxscript_apis.convert_version
        exporter.translate = taking_registry(_core._exported_program_to_onnx_program)
    return exporter


# The logger of torch's exporter that warns about optional packages that do not concern the user.
ONNX_REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"


# --- nn.Module's hooks ----------------------------------------------------------------------------

_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def module_hooks(module: torch.nn.Module) -> dict:
    """The forward and backward hooks registered on `module` ({kind: {handle id: hook}}, kinds
    that have none left out)."""
    return {kind[1:]: hooks for kind in _MODULE_HOOKS if (hooks := getattr(module, kind))}


def global_module_hooks() -> dict:
    """The hooks registered for every module (nn.modules.module.register_module_forward_hook...)."""
    module = torch.nn.modules.module
    return {kind[1:]: hooks for kind in _MODULE_HOOKS if (hooks := getattr(module, "_global" + kind))}


def registered_members(module: torch.nn.Module) -> tuple[dict, dict, dict]:
    """The dicts in which `module` keeps its submodules, parameters and buffers by name (which
    torch.func.functional_call writes directly)."""
    return module._modules, module._parameters, module._buffers


# A module's own entries of __dict__, which a forward never changes (its attributes are the others).
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
