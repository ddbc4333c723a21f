"""Function.apply routed to a hook while ortbridge records, exports or captures a model.

A model reaches a Function's apply in many ways: `Fn.apply(x)` in forward, `self.act = Fn.apply`
stored at construction, a module-level alias, a closure, functools.partial, an `apply` override
that calls super().apply. All of them end in one function of torch's, so routing is done there,
while a hook is active (torch_private.route_apply: a Python function's code object up to torch
2.13, a C function's method entry from 2.14): every way in is seen. Hooks are one thread at a
time; other threads, and Functions the hook did not ask for, run torch's apply unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .._compat.torch_private import route_apply, torch_apply, unroute_apply


def _route(cls, args, kwargs):
    hooks = getattr(_local, "hooks", None)
    if hooks and issubclass(cls, torch.autograd.Function):  # (not functorch's own _SingleLevelFunctions)
        classes, hook = hooks[-1]
        if classes is None or cls in classes:
            return hook(cls, functools.partial(torch_apply, cls), args, kwargs)
    return torch_apply(cls, *args, **kwargs)


_local = threading.local()  # .hooks: this thread's stack of (classes, hook)
_lock = threading.RLock()  # (reentrant: a Function's forward may export or capture)
_active = 0


@contextlib.contextmanager
def intercepted(classes, hook):
    """Route each call of `cls.apply(*args, **kwargs)`, for `cls` in `classes` (None: every
    Function), to `hook(cls, torch_apply_bound_to_cls, args, kwargs)`: on this thread only."""
    global _active
    classes = None if classes is None else frozenset(classes)
    hooks = _local.__dict__.setdefault("hooks", [])
    # One thread at a time: torch's tracers patch process-wide state of their own too.
    with _lock:
        _active += 1
        hooks.append((classes, hook))
        try:
            if _active == 1:
                route_apply(_route)
            yield
        finally:
            hooks.pop()
            _active -= 1
            if _active == 0:
                unroute_apply()


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
