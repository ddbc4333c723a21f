"""Which nodes of an exported graph ONNX Runtime cannot run: those it has no kernel for, found all
at once, and those of kernels known to compute them wrongly (UNSAFE_KERNELS).

A session that ONNX Runtime refuses names one node without a kernel, and each new attempt
exports the graph again (~0.3 s); in a dtype its kernels barely cover (bfloat16 on the CPU: no
Add, MatMul, Gemm, Where...) a graph has dozens. So ONNX Runtime itself is asked about each
distinct (operator, input and output types) of the graph, as a session of that one node (~0.2 ms,
remembered for the process): its answer is the real session's, such as a float16 node that the
CPU provider runs in float32 between Casts it inserts, or a node the CUDA provider leaves to the CPU.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

import onnx
import onnxruntime as ort
import onnxruntime.capi.onnxruntime_pybind11_state as ort_capi
from onnx import helper

from .._compat import ort_private
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


@dataclasses.dataclass(frozen=True)
class UnsafeKernel:
    """An ONNX Runtime kernel whose results differ from PyTorch's, or from run to run, on some
    inputs: nodes of `op_type` for which `applies` holds, and why. `wrong`: against ONNX's own
    definition of the operator too; otherwise only where ONNX and PyTorch define the result
    differently, which matters to a graph that must give eager's results (a training graph), not
    to a model file."""

    op_type: str
    applies: Callable[[onnx.NodeProto, dict[str, list]], bool]  # (the node, its graph's static shapes)
    reason: str
    wrong: bool = True


def _reduction(node: onnx.NodeProto) -> str:
    return next((a.s.decode() for a in node.attribute if a.name == "reduction"), "none")


def _empty_inner_dim(node: onnx.NodeProto, shapes: dict[str, list]) -> bool:
    """Whether a MatMul's inner dimension is 0 (A's last, B's second-to-last, of a vector its one).
    Known where it is: torch's exporters write a size of 0 as a constant, dynamic shapes too."""
    a, b = (shapes.get(v) for v in node.input[:2])
    return (bool(a) and a[-1] == 0) or (bool(b) and b[-2 if len(b) > 1 else 0] == 0)


# The deny list (docs/ort_kernels.md): found by tests/python/test_ort_kernel_audit.py, which runs
# every kind of node the package's graphs contain in ONNX Runtime on 1 and 4 threads against
# PyTorch, on every release CI tests. A graph the package makes has no such node: the FX node whose
# translation wrote it runs in PyTorch instead (fallback.py: those known to write one beforehand,
# onnx_of any other).
UNSAFE_KERNELS = (
    UnsafeKernel(
        "ScatterND",
        lambda node, shapes: _reduction(node) != "none",
        "with a reduction, ONNX Runtime's CPU kernel splits the updates among its threads, and two "
        "threads updating one place race: with repeated indices and 2 or more intra-op threads, updates "
        "are lost (one row updated 1,092 times: max error 70, 10 runs of 10 wrong, ONNX Runtime 1.19 to "
        "1.32). Embedding gradients and index_put(accumulate=True) were written so",
    ),
    UnsafeKernel(
        "TopK",
        lambda node, shapes: True,
        "of equal values it takes the first ones, as ONNX defines it, where torch.topk takes others "
        "(of [1, 3, 3, 2, 3] the 3s at 1 and 2, torch those at 2 and 4), so that indices and "
        "gradients go elsewhere than eager's. torch's exporter writes topk and sort so",
        wrong=False,
    ),
    UnsafeKernel(
        "MatMul",
        lambda node, shapes: ort_private.RELEASE < (1, 20) and _empty_inner_dim(node, shapes),
        "of an empty inner dimension (a sum of no products: zeros), ONNX Runtime 1.19's CPU kernel "
        "leaves its output unwritten, so that it holds whatever the memory held (1 run in 2 wrong, "
        "infinities among them); 1.20 writes zeros",
    ),
)


def nodes_of(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node of `model`: of its graph, its functions and the subgraphs their nodes hold (If,
    Loop, Scan)."""

    def of(graph) -> Iterator[onnx.NodeProto]:
        for node in graph.node:
            yield node
            for attribute in node.attribute:
                for subgraph in (attribute.g, *attribute.graphs) if attribute.HasField("g") else attribute.graphs:
                    yield from of(subgraph)

    for graph in (model.graph, *model.functions):
        yield from of(graph)


def unsafe_nodes(model: onnx.ModelProto, eager_exact: bool = False) -> list[tuple[onnx.NodeProto, str]]:
    """Each node of `model` of a kernel in UNSAFE_KERNELS, with the reason: of those that are
    `wrong`, and with `eager_exact` (a training graph) of all."""
    shapes = _static_shapes(model)
    return [
        (node, kernel.reason)
        for node in nodes_of(model)
        for kernel in UNSAFE_KERNELS
        if (kernel.wrong or eager_exact)
        and node.op_type == kernel.op_type
        and node.domain in ("", "ai.onnx")
        and kernel.applies(node, shapes)
    ]


def _static_shapes(model: onnx.ModelProto) -> dict[str, list]:
    """The shape of each value of `model`'s graph that has one: a list of sizes, None where unknown."""
    graph = model.graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    return shapes
