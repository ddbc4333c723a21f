"""Dynamic dims: torch.export's `dynamic_shapes` as each exporter path needs it, and the names
the user gave them on the ONNX graph."""

from __future__ import annotations

import inspect
import re

import onnx
import torch


def for_torch_export(dynamic_shapes):
    """torch.onnx.export takes dim names as strings; torch.export wants Dim objects (one per name)."""
    dims = {}

    def convert(spec):
        if isinstance(spec, str):
            return dims.setdefault(spec, torch.export.Dim(spec))
        if isinstance(spec, dict):
            return {key: convert(value) for key, value in spec.items()}
        if isinstance(spec, (list, tuple)):
            return type(spec)(convert(value) for value in spec)
        return spec

    return convert(dynamic_shapes)


def names(model, args: tuple, kwargs: dict, dynamic_shapes) -> dict:
    """{forward parameter: {dim: name}} for the parameters that are tensors: a Dim's name, a
    string as it is, or <parameter>_dim_<d> for an unnamed dynamic dim."""
    if dynamic_shapes is None:
        return {}
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    specs = dynamic_shapes.items() if isinstance(dynamic_shapes, dict) else zip(bound, dynamic_shapes)
    result = {}
    for param, spec in specs:
        if not isinstance(bound.get(param), torch.Tensor):
            continue
        dims = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        named = {
            int(d): dim if isinstance(dim, str) else getattr(dim, "__name__", f"{param}_dim_{d}")
            for d, dim in dims
            if dim is not None
        }
        if named:
            result[param] = named
    return result


def rename(proto: onnx.ModelProto, dim_names: dict) -> None:
    """Replace torch's symbols (s0, s77, ...) in every shape of the graph by the names of the
    input dims they stand for: `2*s77` becomes `2*batch`."""
    symbols = {}
    for value in proto.graph.input:
        for d, name in dim_names.get(value.name, {}).items():
            dims = value.type.tensor_type.shape.dim
            if d < len(dims) and dims[d].dim_param:
                symbols.setdefault(dims[d].dim_param, name)
    if not symbols:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, symbols)) + r")\b")
    for value in (*proto.graph.input, *proto.graph.output, *proto.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: symbols[m.group(1)], dim.dim_param)
