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

from ._compat.torch_private import backward_class

_lock = threading.Lock()
_functions: dict[str, type] = {}
_objects: dict[int, object] = {}  # key -> pinned object
_keys: dict[int, int] = {}  # id of a pinned object -> its key


class UnknownFunctionError(LookupError):
    """A model names a Function that was not registered with ortbridge.register."""


def qualified_name(cls: type) -> str:
    """The default registry name: module plus qualified class name. A script's classes are
    `__main__`'s also where multiprocessing's spawn runs the script again as `__mp_main__` (a
    DataLoader worker): the same classes, under the names the script's models give them."""
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return f"{module}.{cls.__qualname__}"


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


def registered_function(name: str) -> type | None:
    """The Function registered under `name`, or None."""
    return _functions.get(name)


def registered_names() -> list[str]:
    return sorted(_functions)


def unknown_function(name: str) -> UnknownFunctionError:
    """The error for a func_name that nothing is registered under, saying what to do: register the
    Function under the name the model asks for (a name that records where the class lived at
    export, e.g. `__main__.X` from a script, is not where it lives now)."""
    known = ", ".join(registered_names()) or "none"
    said = f"the model calls Function '{name}', and no Function is registered under that name (registered: {known})."
    class_name = name.rsplit(".", 1)[-1]
    same_class = [(key, cls) for key, cls in sorted(_functions.items()) if cls.__name__ == class_name]
    if same_class:
        return UnknownFunctionError(
            said
            + "".join(
                f" {qualified_name(cls)} is registered as '{key}': if the model means that class, "
                f"register it under the model's name too: ortbridge.register({cls.__qualname__}, "
                f"name='{name}')."
                for key, cls in same_class
            )
        )
    return UnknownFunctionError(
        f"{said} Import the Function and register it under that name before creating the session: "
        f"ortbridge.register(YourFunction, name='{name}'). (register(cls) alone uses its module and class name "
        "where it is imported now, which need not be the model's.)"
    )


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
            "exported them"
        ) from None


def _track_materialize_grads(cls: type) -> None:
    # torch keeps ctx.materialize_grads write-only; record the value where the runner can read it.
    backward_cls = backward_class(cls)
    if "set_materialize_grads" in backward_cls.__dict__:
        return

    def set_materialize_grads(self, value: bool):
        self._ortbridge_materialize_grads = bool(value)
        FunctionCtx.set_materialize_grads(self, value)

    backward_cls.set_materialize_grads = set_materialize_grads
