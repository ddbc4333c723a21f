"""The gradient graph of an ONNX model from onnxruntime-training's builder (OrtModuleGraphBuilder),
run by its TrainingAgent: the path OrtGradientForwardBackward and OnnxModule take where
onnxruntime-training (1.19.2, the last release) provides the `onnxruntime` package.

ORT's builder writes the gradient of com.microsoft::PythonOp itself (a PythonOpGrad with every
attribute), and knows no other custom domain: the graph's ortbridge::PythonOp nodes cross as
com.microsoft ones, in training mode, and the gradient graph comes back as ortbridge's
(convert_from_ortmodule).
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import torch

from .. import convert, runtime
from .._compat.ort_private import c_session
from .._compat.ort_private import training_c as _ort_c
from .._copying import NotCopyable
from .._tracing.nodes import DOMAIN, unname_unread_context_ids

_MICROSOFT = "com.microsoft"
_FLOATING = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_SAVED_OUTPUTS = {("", "LayerNormalization"): 3, ("", "Dropout"): 2}
# Attributes of ortbridge's PythonOp that com.microsoft's schema does not declare.
_ORTBRIDGE_ONLY = (
    "call_index",
    "input_float_scalars_f64",
    "input_float_tuples_f64",
    "input_literals",
    "input_literal_positions",
)


def available() -> bool:
    """Whether the installed onnxruntime is onnxruntime-training, with its gradient builder."""
    return _ort_c is not None and hasattr(_ort_c, "OrtModuleGraphBuilder") and hasattr(_ort_c, "TrainingAgent")


def _as_microsoft(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
    """A copy with each ortbridge::PythonOp as a com.microsoft one in training mode (so that it
    keeps a context for its PythonOpGrad); returns it and the attributes set aside, by node name."""
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    set_aside = {}
    for k, node in enumerate(model_copy.graph.node):
        if node.domain != DOMAIN:
            continue
        node.name = node.name or f"PythonOp_{k}"
        node.domain = _MICROSOFT
        if not node.output[0]:  # (the builder's schema requires the context id an inference export leaves unnamed)
            node.output[0] = f"{node.name}_context"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        types = iter(attrs.get("input_tensor_types", []))
        # Each floating-point tensor input needs its gradient (what the builder asks of the node).
        requires = [int(next(types) in _FLOATING) if c == ord("d") else 0 for c in attrs.get("input_convention", b"")]
        replaced = _ORTBRIDGE_ONLY + ("training_mode", "safe_run_mode", "input_requires_grads")
        kept = [a for a in node.attribute if a.name not in replaced]
        set_aside[node.name] = [a for a in node.attribute if a.name in _ORTBRIDGE_ONLY]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.extend(
            [
                onnx.helper.make_attribute("training_mode", 1),
                onnx.helper.make_attribute("safe_run_mode", 1),
                onnx.helper.make_attribute("input_requires_grads", requires),
            ]
        )
    for k, node in enumerate(model_copy.graph.node):
        # The builder's gradients of these read outputs torch's exporter leaves off (LayerNormalization's
        # mean and inverse standard deviation, Dropout's mask).
        wanted = _SAVED_OUTPUTS.get((node.domain, node.op_type), 0)
        while len(node.output) < wanted:
            node.output.append(f"{node.name or node.op_type}_{k}_saved_{len(node.output)}")
    if set_aside and not any(o.domain == _MICROSOFT for o in model_copy.opset_import):
        model_copy.opset_import.append(onnx.helper.make_opsetid(_MICROSOFT, 1))
    return model_copy, set_aside


def _as_ortbridge(model_bytes: bytes, set_aside: dict) -> onnx.ModelProto:
    model = convert.convert_from_ortmodule(model_bytes)
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == "PythonOp":
            node.attribute.extend(set_aside.get(node.name, []))
    return model


def _to_torch(value) -> torch.Tensor:
    # (a copy: ORT reuses the buffers of a forward's outputs in its backward)
    return torch.from_numpy(value.numpy().copy())


def _ort_values(tensors, device) -> tuple:
    """An OrtValueVector viewing `tensors`, and the arrays it views (which the caller keeps alive
    while ORT may read them: the C OrtValue does not own them)."""
    arrays = [t.detach().contiguous().numpy() for t in tensors]
    vector = _ort_c.OrtValueVector()
    for a in arrays:
        vector.push_back(_ort_c.OrtValue.ortvalue_from_numpy(a, device))
    return vector, arrays


class TrainingGraph(NotCopyable):
    """`model`'s forward and backward from ORT's gradient builder. Arguments: the graph inputs
    `input_names`, then the initializers `weights_to_train`; gradients come for each argument of
    a floating-point type. Outputs: the graph's `output_names` (a subset of its outputs)."""

    def __init__(
        self,
        model: onnx.ModelProto,
        weights_to_train: list[str],
        input_names: list[str],
        output_names: list[str],
        sess_options: ort.SessionOptions | None,
        providers: list | None,
    ):
        if not available():
            raise RuntimeError("the installed onnxruntime has no gradient builder: it is not onnxruntime-training")
        outputs = {o.name: o for o in model.graph.output}
        missing = [n for n in output_names if n not in outputs]
        if missing:
            raise ValueError(
                f"with onnxruntime-training's gradient builder, output_names must be graph outputs; {missing} are not"
            )
        prepared, set_aside = _as_microsoft(model)
        del prepared.graph.output[:]
        prepared.graph.output.extend(outputs[n] for n in output_names)
        inputs = {i.name: i for i in model.graph.input}
        self.requires_grad = [inputs[n].type.tensor_type.elem_type in _FLOATING for n in input_names]
        config = _ort_c.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = config.initializer_names_to_train = list(weights_to_train)
        config.input_names_require_grad = [n for n, r in zip(input_names, self.requires_grad) if r]
        config.build_gradient_graph = True
        builder = _ort_c.OrtModuleGraphBuilder()
        try:
            builder.initialize(prepared.SerializeToString(), config)
            builder.build(_ort_c.TrainingGraphTransformerConfiguration())
        except RuntimeError as e:  # (ORT's text starts with its source location: its own words are last)
            raise RuntimeError(
                "onnxruntime-training's gradient builder refused the graph: "
                + str(e).split("[ONNXRuntimeError]")[-1].strip(" :")
            ) from e
        self.info = builder.get_graph_info()
        self.gradient_model = _as_ortbridge(builder.get_gradient_model(), set_aside)
        options = runtime.session_options(sess_options)
        providers = providers or ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(self.gradient_model.SerializeToString(), options, providers=providers)
        self.device = _ort_c.OrtDevice(_ort_c.OrtDevice.cpu(), _ort_c.OrtDevice.default_memory(), 0)
        feeds = [i.name for i in self.session.get_inputs()]
        fetches = [o.name for o in self.session.get_outputs()]
        self.agent = _ort_c.TrainingAgent(
            c_session(self.session), feeds, [self.device] * len(output_names), fetches, [self.device] * len(fetches), 0
        )
        # Which argument each backward output is the gradient of.
        grad_names = dict(self.info.user_input_grad_names)
        argument_grads = [grad_names.get(n) for n in input_names] + list(self.info.initializer_grad_names_to_train)
        self.gradient_slots = [argument_grads.index(name) for name in fetches]
        self.argument_count = len(input_names) + len(weights_to_train)
        self.non_differentiable = set(self.info.output_grad_indices_non_differentiable)
        # The forward alone, for inference: its PythonOps keep no context.
        forward = _as_ortbridge(builder.get_forward_model(), set_aside)
        for node in forward.graph.node:
            if node.domain == DOMAIN and node.op_type == "PythonOp":
                for a in node.attribute:
                    if a.name == "training_mode":
                        a.i = 0
        unname_unread_context_ids(forward.graph)
        self.inference = runtime.InferenceSession(
            forward.SerializeToString(), runtime.session_options(sess_options), providers=providers
        )
        self.inference_inputs = [i.name for i in self.inference.get_inputs()]
        self.feed_names = feeds

    def new_instance(self) -> TrainingStep:
        return TrainingStep(self)


class TrainingStep(NotCopyable):
    """One forward, and its backward, through the TrainingAgent. The contexts a training forward
    keeps are released by its backward, or when the step is dropped without one."""

    def __init__(self, graph: TrainingGraph):
        self.graph = graph
        self.state = None
        self.contexts: list[int] = []

    def __del__(self):
        for context_id in self.contexts:
            runtime.release_context(context_id)

    def forward(self, inputs, training: bool = False) -> tuple:
        graph = self.graph
        if len(inputs) != graph.argument_count:
            raise TypeError(
                f"the graph takes {graph.argument_count} arguments (inputs, then weights), got {len(inputs)}"
            )
        if not training:
            feeds = {name: t.detach().contiguous().numpy() for name, t in zip(graph.feed_names, inputs)}
            outputs = graph.inference.run(None, {n: feeds[n] for n in graph.inference_inputs})
            return tuple(torch.from_numpy(o) for o in outputs)
        self.state = _ort_c.PartialGraphExecutionState()
        outputs = _ort_c.OrtValueVector()
        feeds, self.arrays = _ort_values(inputs, graph.device)  # (read again by the backward)
        # (the ids of the contexts this forward keeps: the agent holds them, not an output)
        _, self.contexts = runtime.run_in_scope(
            lambda: graph.agent.run_forward(feeds, outputs, self.state, _ort_c.OrtValueCache())
        )
        self.outputs = tuple(_to_torch(o) for o in outputs)
        return self.outputs

    def backward(self, grad_outputs) -> tuple:
        graph = self.graph
        if self.state is None:
            raise RuntimeError("backward needs a forward with training=True first (and runs once per forward)")
        grads = [
            g if g is not None else torch.zeros_like(o)
            for i, (o, g) in enumerate(zip(self.outputs, grad_outputs))
            if i not in graph.non_differentiable
        ]
        results = _ort_c.OrtValueVector()
        feeds, arrays = _ort_values(grads, graph.device)
        try:
            graph.agent.run_backward(feeds, results, self.state)
        finally:
            self.state = self.outputs = self.arrays = None
            for context_id in self.contexts:  # (taken by their PythonOpGrads, unless backward failed)
                runtime.release_context(context_id)
            self.contexts = []
        gradients = [None] * graph.argument_count
        for slot, value in zip(graph.gradient_slots, results):
            gradients[slot] = _to_torch(value)
        return tuple(gradients)
