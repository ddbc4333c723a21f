"""Function.apply routed to a hook while ortbridge records, exports or captures a model.

A model reaches a Function's apply in many ways: `Fn.apply(x)` in forward, `self.act = Fn.apply`
stored at construction, a module-level alias, a closure, functools.partial, an `apply` override
that calls super().apply. Each holds (or reaches) the one function object behind
`torch.autograd.Function.apply`, so routing is done there, by giving that function object
another code object while a hook is active: every way in is seen. Hooks are one thread at a
time; other threads, and Functions the hook did not ask for, run torch's apply unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import torch

_APPLY = torch.autograd.Function.apply.__func__  # what every bound `Fn.apply` calls
_TORCH_CODE = _APPLY.__code__
# torch's apply as a function object of its own (its zero-argument super() reads the same cell).
_torch_apply = types.FunctionType(_TORCH_CODE, _APPLY.__globals__, "apply", _APPLY.__defaults__, _APPLY.__closure__)


def _routing_code() -> types.CodeType:
    __class__ = None  # the one free variable of torch's apply (super()'s cell): the closure fits

    def apply(cls, *args, **kwargs):
        return __class__._ortbridge_route(cls, args, kwargs)

    return apply.__code__


_ROUTING_CODE = _routing_code()
_local = threading.local()  # .hooks: this thread's stack of (classes, hook)
_lock = threading.RLock()  # (reentrant: a Function's forward may export or capture)
_active = 0


def _route(cls, args, kwargs):
    hooks = getattr(_local, "hooks", None)
    if hooks:
        classes, hook = hooks[-1]
        if classes is None or cls in classes:
            return hook(cls, functools.partial(_torch_apply, cls), args, kwargs)
    return _torch_apply(cls, *args, **kwargs)


torch.autograd.Function._ortbridge_route = staticmethod(_route)


@contextlib.contextmanager
def intercepted(classes, hook):
    """Route each call of `cls.apply(*args, **kwargs)`, for `cls` in `classes` (None: every
    Function), to `hook(cls, torch_apply_bound_to_cls, args, kwargs)`: on this thread only."""
    global _active
    classes = None if classes is None else frozenset(classes)
    hooks = _local.__dict__.setdefault("hooks", [])
    # One thread at a time: torch's tracers patch process-wide state of their own too.
    with _lock:
        if _active == 0:
            _APPLY.__code__ = _ROUTING_CODE
        _active += 1
        hooks.append((classes, hook))
        try:
            yield
        finally:
            hooks.pop()
            _active -= 1
            if _active == 0:
                _APPLY.__code__ = _TORCH_CODE


_MISSING = object()


@contextlib.contextmanager
def class_attributes_set(changes: list):
    """Set (class, name, value) attributes for the duration; then restore or remove them. One
    thread at a time (exports and captures on other threads wait), so that each restores what
    was there before it, never another thread's change."""
    with _lock:
        saved = [(cls, name, cls.__dict__.get(name, _MISSING)) for cls, name, _ in changes]
        for cls, name, value in changes:
            setattr(cls, name, value)
        try:
            yield
        finally:
            for cls, name, old in reversed(saved):
                if old is _MISSING:
                    delattr(cls, name)
                else:
                    setattr(cls, name, old)
