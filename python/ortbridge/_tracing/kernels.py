"""Which nodes of an exported graph ONNX Runtime has no kernel for, found all at once.

A session that ONNX Runtime refuses names one node without a kernel, and each new attempt
exports the graph again (~0.3 s); in a dtype its kernels barely cover (bfloat16 on the CPU: no
Add, MatMul, Gemm, Where...) a graph has dozens. So ONNX Runtime itself is asked about each
distinct (operator, input and output types) of the graph, as a session of that one node (~0.2 ms,
remembered for the process): its answer is the real session's, such as a float16 node that the
CPU provider runs in float32 between Casts it inserts, or a node the CUDA provider leaves to the CPU.
"""

from __future__ import annotations

import re

import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as ort_capi
from onnx import helper

from .nodes import DOMAIN

# The exporter's record of the FX node a node translates ("%mm_1 : [num_users=1] = ..."); else its
# name: `node_X`, or `node_X__k` for the k-th ONNX node of X's translation.
_FX_NODE = re.compile(r"%([A-Za-z0-9_]+) :")
_NAMED = re.compile(r"node_([A-Za-z0-9_]+?)(?:__\d+)?")


def fx_node_of(node: onnx.NodeProto) -> str | None:
    """The FX node (of the decomposed graph) whose translation wrote `node`, or None."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.fx_node" and (match := _FX_NODE.match(prop.value)):
            return match.group(1)
    match = _NAMED.fullmatch(node.name)
    return match.group(1) if match else None


def without_kernel(model: onnx.ModelProto, providers: list) -> set[str]:
    """The FX nodes with an ONNX node in `model` that ONNX Runtime has no kernel for on `providers`
    (those of the ortbridge domain and those of unknown types aside)."""
    graph = model.graph
    types = _value_types(graph)
    if any(v and v not in types for node in graph.node for v in (*node.input, *node.output)):
        # (values inside an operator's translation: the exporter gives no type)
        types = {**_value_types(onnx.shape_inference.infer_shapes(model).graph), **types}
    versions = {o.domain or "": o.version for o in model.opset_import}
    refused = set()
    for node in graph.node:
        values = [*node.input, *node.output]
        if node.domain == DOMAIN or node.op_type == "Constant" or not all(v in types for v in values if v):
            continue
        key = (
            repr(providers),
            node.domain,
            node.op_type,
            versions.get(node.domain or ""),
            tuple(_type_key(types[v]) if v else None for v in values),
        )
        if key not in _HAS_KERNEL:
            _HAS_KERNEL[key] = _has_kernel(node, model, types, providers)
        if not _HAS_KERNEL[key] and (name := fx_node_of(node)):
            refused.add(name)
    return refused


def _value_types(graph: onnx.GraphProto) -> dict:
    types = {v.name: v.type for v in (*graph.input, *graph.output, *graph.value_info)}
    types.update((t.name, helper.make_tensor_type_proto(t.data_type, t.dims)) for t in graph.initializer)
    return types


def _type_key(value_type: onnx.TypeProto):
    """What a kernel's choice depends on: the element type (and rank) of a tensor, not its sizes."""
    if value_type.HasField("tensor_type"):
        tensor = value_type.tensor_type
        return tensor.elem_type, len(tensor.shape.dim) if tensor.HasField("shape") else None
    return value_type.SerializeToString()


_HAS_KERNEL: dict[tuple, bool] = {}  # (providers, domain, operator, opset, value types) -> the answer


def _has_kernel(node: onnx.NodeProto, model: onnx.ModelProto, types: dict, providers: list) -> bool:
    """Whether ONNX Runtime makes a session of `node` alone, on values of these types."""
    inputs = list(dict.fromkeys(v for v in node.input if v))
    graph = helper.make_graph(
        [node],
        "probe",
        [helper.make_value_info(v, types[v]) for v in inputs],
        [helper.make_value_info(v, types[v]) for v in node.output if v],
    )
    probe = helper.make_model(
        graph, opset_imports=model.opset_import, ir_version=model.ir_version, functions=model.functions
    )  # (a call of one of the model's functions: its nodes)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 3
    try:
        ort.InferenceSession(probe.SerializeToString(), options, providers=providers)
    except ort_capi.NotImplemented:
        return False
    except (ort_capi.InvalidGraph, ort_capi.Fail) as e:  # (the operator's schema refuses these types: Conv of bfloat16)
        return "Type Error" not in str(e)
    except Exception:  # (refused for another reason: the real session will say what)
        return True
    return True
