"""One AOTAutograd graph (forward, backward or inference) as an ONNX Runtime session that takes
and gives torch tensors.

The graph is exported with torch's ONNX exporter after each python_op / python_op_grad node is
rewritten to emit an ortbridge PythonOp / PythonOpGrad node. Graph outputs that are graph inputs
(tensors saved for backward, mostly) skip ONNX Runtime; context ids are written into tensors
that release their context when torch frees them.
"""

from __future__ import annotations

import operator

import onnx
import onnxruntime as ort
import torch

from .. import _C, _dtypes, runtime
from ..exporter import _quiet_exporter
from ..exporter.calls import DOMAIN
from . import ops

_PYTHON_OP = torch.ops.ortbridge.python_op.default
_PYTHON_OP_GRAD = torch.ops.ortbridge.python_op_grad.default


def _forward_node(inputs: list, index: int, training: bool) -> list:
    traced = ops.traced_call(index)
    return list(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::PythonOp", list(inputs), traced.forward_attrs(training),
        dtypes=[torch.int64, *traced.call.output_dtypes], shapes=[[], *traced.call.output_shapes], version=1))


def _backward_node(context, grads: list, index: int) -> list:
    traced = ops.traced_call(index)
    wanted = traced.wanted_gradients()
    return list(torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::PythonOpGrad", [context, *(g for g in grads if g is not None)],
        traced.backward_attrs([g is not None for g in grads]),
        dtypes=[traced.input_dtypes[i] for i in wanted], shapes=[traced.input_shapes[i] for i in wanted], version=1))


def _spread_gradient_outputs(graph: onnx.GraphProto) -> None:
    """PythonOpGrad has one output per forward tensor input, empty where no gradient is wanted;
    the exporter wrote only the wanted ones."""
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == "PythonOpGrad":
            wanted = next(a.ints for a in node.attribute if a.name == "output_tensor_requires_grads")
            produced = iter(list(node.output))
            del node.output[:]
            node.output.extend(next(produced) if w else "" for w in wanted)


def _session_options() -> ort.SessionOptions:
    """As many threads as torch uses, which sleep between runs: torch runs in between (the
    Functions, the optimizer, the rest of the step), and ORT's default spinning threads would
    take its cores."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _is_context_id(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0
            and node.args[0].target is _PYTHON_OP)


class GraphSession:
    """Runs `gm` in ONNX Runtime: called with a list of tensors (AOTAutograd's boxed calling
    convention), returns the graph's outputs."""

    _boxed_call = True

    def __init__(self, gm: torch.fx.GraphModule, training: bool):
        gm = torch.fx.GraphModule(gm, gm.graph)  # a copy to rewrite; AOTAutograd keeps the original
        graph = gm.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for p in placeholders:
            if p.meta["val"].device.type != "cpu":
                raise NotImplementedError(f"ortbridge training runs on the CPU; graph input {p.name} is on "
                                          f"{p.meta['val'].device}")
        output = graph.output_node()
        results = list(output.args[0])
        # Each graph output: ("none",), ("input", k) or ("onnx", j).
        computed: list[torch.fx.Node] = []
        self.sources = []
        for r in results:
            if r is None:
                self.sources.append(("none",))
            elif r.op == "placeholder":
                self.sources.append(("input", placeholders.index(r)))
            else:
                if r not in computed:
                    computed.append(r)
                self.sources.append(("onnx", computed.index(r)))
        # Every context id leaves the graph in a tensor that owns it: one backward does not need
        # (its Function's outputs were not differentiable here) is released after the run.
        for node in list(graph.nodes):
            if training and node.target is _PYTHON_OP:
                ids = [u for u in node.users if _is_context_id(u)]
                if not ids:
                    with graph.inserting_after(node):
                        ids = [graph.call_function(operator.getitem, (node, 0))]
                        ids[0].meta["val"] = node.meta["val"][0]
                if ids[0] not in computed:
                    computed.append(ids[0])
        self.outputs = [(n.meta["val"].dtype, tuple(n.meta["val"].shape), _is_context_id(n)) for n in computed]
        for node in graph.nodes:
            if node.target is _PYTHON_OP:
                node.target, node.args = _forward_node, (*node.args, training)
            elif node.target is _PYTHON_OP_GRAD:
                node.target = _backward_node
        output.args = (tuple(computed),)
        graph.eliminate_dead_code()
        gm.recompile()
        example = tuple(torch.zeros(p.meta["val"].shape, dtype=p.meta["val"].dtype) for p in placeholders)
        # (under dynamo, the fake mode of its trace is still current)
        with _quiet_exporter(), torch._subclasses.fake_tensor.unset_fake_temporarily():
            program = torch.export.export(gm, example, strict=False)
            self.model = torch.onnx.export(program, example, dynamo=True, verbose=False).model_proto
        _spread_gradient_outputs(self.model.graph)
        self.session = runtime.InferenceSession(self.model.SerializeToString(), _session_options(),
                                                providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        if len(self.input_names) != len(placeholders) or len(self.output_names) != len(computed):
            raise RuntimeError(f"the exported graph has {len(self.input_names)} inputs and {len(self.output_names)} "
                               f"outputs, the captured one {len(placeholders)} and {len(computed)}")

    def __call__(self, args: list) -> list:
        if torch.is_inference_mode_enabled():  # Functions see normal tensors, as in an ORT session of their own
            with torch.inference_mode(False):
                return self._run(args)
        return self._run(args)

    def _run(self, args: list) -> list:
        binding = self.session.io_binding()
        inputs = [t.contiguous() for t in args]  # (kept alive until the run is done)
        args.clear()  # the boxed convention: the callee may free its inputs early
        for name, t in zip(self.input_names, inputs):
            binding.bind_input(name, "cpu", 0, _dtypes.numpy_type(t.dtype), tuple(t.shape), t.data_ptr())
        outputs = [torch.from_dlpack(_C.context_id_capsule()) if is_context else torch.empty(shape, dtype=dtype)
                   for dtype, shape, is_context in self.outputs]
        for name, t in zip(self.output_names, outputs):
            binding.bind_output(name, "cpu", 0, _dtypes.numpy_type(t.dtype), tuple(t.shape), t.data_ptr())
        self.session.run_with_iobinding(binding)
        return [None if s[0] == "none" else inputs[s[1]] if s[0] == "input" else outputs[s[1]]
                for s in self.sources]
