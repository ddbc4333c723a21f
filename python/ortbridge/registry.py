"""Which torch.autograd.Functions a model may call.

A model names its Functions by string (`func_name`). ortbridge resolves that string only
through this registry, never by importing a module or evaluating a name, so a model file
cannot make the process run code it did not opt into.
"""

from __future__ import annotations

import secrets
import threading

import torch
from torch.autograd.function import FunctionCtx

from . import operators
from ._torch_private import backward_class

_lock = threading.Lock()
_functions: dict[str, type] = {}
_objects: dict[int, object] = {}  # key -> pinned object
_keys: dict[int, int] = {}  # id of a pinned object -> its key


class UnknownFunctionError(LookupError):
    """A model names a Function that was not registered with ortbridge.register."""


def qualified_name(cls: type) -> str:
    """The default registry name: module plus qualified class name."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register(cls: type | None = None, *, name: str | None = None):
    """Allow models to call `cls`, under `name` (default: its qualified name).

    Usable as ``register(MyFn)``, ``@register`` or ``@register(name="...")``. Registering
    another class under a taken name replaces it, as rebinding a name does in Python.
    """
    if cls is None:
        return lambda c: register(c, name=name)
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"ortbridge.register expects a torch.autograd.Function subclass, got {cls!r}")
    key = name or qualified_name(cls)
    _track_materialize_grads(cls)
    with _lock:
        _functions[key] = cls
    cls._ortbridge_name = key
    return cls


def unregister(name_or_cls) -> None:
    key = name_or_cls if isinstance(name_or_cls, str) else registered_name(name_or_cls)
    with _lock:
        _functions.pop(key, None)


def registered_name(cls: type) -> str | None:
    """The name `cls` is registered under, or None."""
    key = cls.__dict__.get("_ortbridge_name")
    return key if key is not None and _functions.get(key) is cls else None


def registered_names() -> list[str]:
    return sorted(_functions)


def lookup(name: str) -> type:
    """The Function a func_name names: a registered one, or (`namespace::op.overload`) the one that
    runs an allowed torch operator (see ortbridge.operators)."""
    cls = _functions.get(name)
    if cls is None and operators.is_operator_name(name):
        return operators.function(name)
    if cls is None:
        known = ", ".join(registered_names()) or "none"
        raise UnknownFunctionError(
            f"func_name '{name}' is not registered with ortbridge (registered: {known}). "
            "Import the module that defines the Function and call ortbridge.register(cls) "
            "before creating the session.")
    return cls


def pin_object(obj: object) -> int:
    """Keep `obj` alive and return the key a graph may use to refer to it (in-process only).

    Keys are random, so a model file cannot name an object another model pinned; pinning the same
    object again gives the same key."""
    with _lock:
        key = _keys.get(id(obj))
        while key is None or (key in _objects and _objects[key] is not obj):
            key = secrets.randbits(63)
        _objects[key] = obj
        _keys[id(obj)] = key  # (pinned objects live forever, so their ids stay theirs)
    return key


def pinned_object(key: int) -> object:
    try:
        return _objects[key]
    except KeyError:
        raise LookupError(
            f"input_pointer_scalars refers to object key {key}, which no ortbridge.pin_object call "
            "made in this process; graphs holding Python objects run only in the process that "
            "exported them") from None


def _track_materialize_grads(cls: type) -> None:
    # torch keeps ctx.materialize_grads write-only; record the value where the runner can read it.
    backward_cls = backward_class(cls)
    if "set_materialize_grads" in backward_cls.__dict__:
        return

    def set_materialize_grads(self, value: bool):
        self._ortbridge_materialize_grads = bool(value)
        FunctionCtx.set_materialize_grads(self, value)

    backward_cls.set_materialize_grads = set_materialize_grads
