"""Constant arguments that ORT's typed attributes cannot hold, as one JSON text (`input_literals`).

None, bool, int (any size), float (exact, NaN and infinities too), str, lists, tuples, dicts with
str keys, torch.dtype and torch.device, nested freely. Decoding only builds those values, so a
model file can never make it run code. JSON has no tuples, dtypes or devices: those are objects
with one tag key; dicts are tagged too, so no user dict is ever read as a tag.
"""

from __future__ import annotations

import json
import re

import torch

from . import dtypes

# The device literals a model may name: fixed types, a small index (torch's is 8 bits).
_DEVICE = re.compile(r"(cpu|cuda|meta|mps|xpu)(:[0-9]{1,2})?")


def encodable(value) -> bool:
    """Whether `value` can be written as a literal (no tensors, no other objects)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True
    if isinstance(value, (list, tuple)):
        return all(encodable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and encodable(v) for k, v in value.items())
    return False


def _tagged(value):
    if isinstance(value, tuple):
        return {"tuple": [_tagged(v) for v in value]}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[k, _tagged(v)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    return value


def encode(values: list) -> str:
    return json.dumps([_tagged(v) for v in values], separators=(",", ":"))


def _untag(obj: dict):
    if len(obj) == 1:
        ((tag, body),) = obj.items()
        if tag == "tuple" and isinstance(body, list):
            return tuple(body)
        if (
            tag == "dict"
            and isinstance(body, list)
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in body)
        ):
            return dict(body)
        if tag == "dtype" and isinstance(body, str) and body in dtypes.BY_NAME:
            return dtypes.BY_NAME[body]
        if tag == "device" and isinstance(body, str) and _DEVICE.fullmatch(body):
            return torch.device(body)
    raise ValueError(f"unknown literal {json.dumps(obj)[:80]}")


def decode(text: str, count: int) -> list:
    """The `count` values of an input_literals attribute."""
    try:
        values = json.loads(text, object_hook=_untag)
    except (ValueError, RecursionError, RuntimeError) as e:
        raise ValueError(f"attribute 'input_literals' is not a valid literal list: {e}") from None
    if not isinstance(values, list) or len(values) != count:
        got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
        raise ValueError(f"attribute 'input_literals' holds {got}, but input_literal_positions names {count}")
    return values
