"""Training an ONNX model from PyTorch: ortbridge.OnnxModule (an nn.Module whose initializers
are Parameters) and ortbridge.OrtGradientForwardBackward (forward and backward on torch tensors,
and a torch.autograd.Function). ONNX Runtime runs the forward and backward graphs.

The backward graph comes from onnxruntime-training's gradient builder where that is the installed
onnxruntime (ort_gradient), else from torch: the ONNX graph runs as torch operators
(onnx_to_torch), which OrtModule captures with AOTAutograd and exports again, forward and
backward, for ONNX Runtime.
"""

from __future__ import annotations

import collections
import os

import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from .._compat.torch_private import IncompatibleKeys
from . import ort_gradient
from .module import OrtModule
from .onnx_to_torch import OnnxGraphModule, float_initializers


def _load(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return onnx.load(os.fspath(model))


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _builder(gradient_builder: str) -> str:
    if gradient_builder == "auto":
        return "onnxruntime-training" if ort_gradient.available() else "torch"
    if gradient_builder not in ("torch", "onnxruntime-training"):
        raise ValueError(f"gradient_builder is 'auto', 'torch' or 'onnxruntime-training', not {gradient_builder!r}")
    if gradient_builder == "onnxruntime-training" and not ort_gradient.available():
        raise RuntimeError(
            "gradient_builder='onnxruntime-training' needs onnxruntime-training installed (it provides "
            "the onnxruntime package); this onnxruntime has no gradient builder"
        )
    return gradient_builder


class OrtGradientForwardBackward:
    """Forward and backward of an ONNX model (a path, bytes or a ModelProto) on torch tensors,
    with ONNX Runtime running both. Its arguments are the graph's inputs (`input_names`, default:
    those no initializer fills) followed by the weights to train (default: every floating-point
    initializer), as tensors; gradients come for all of them. `new_instance()` gives an object
    whose `forward(inputs, training=False)` returns the outputs (`output_names`, default: the
    graph's) and, after a training forward, whose `backward(grad_outputs)` returns one gradient
    (or None) per argument. `apply(*inputs, *weights)` is the same as a torch.autograd.Function.
    `weights()` gives the model's values of the weights to train.

    `gradient_builder`: where the backward graph comes from. "onnxruntime-training": ORT's own
    gradient builder, where onnxruntime-training is the installed onnxruntime; "torch": the
    graph runs as torch operators, whose forward and backward OrtModule captures and exports
    again for ONNX Runtime (stock onnxruntime); "auto" (default): the first available.
    """

    def __init__(
        self,
        onnx_model,
        weights_to_train: list[str] | None = None,
        input_names: list[str] | None = None,
        output_names: list[str] | None = None,
        sess_options: ort.SessionOptions | None = None,
        providers: list | None = None,
        gradient_builder: str = "auto",
        save_graphs=None,
    ):
        self.onnx_model = _load(onnx_model)
        self.weights_to_train = (
            float_initializers(self.onnx_model) if weights_to_train is None else list(weights_to_train)
        )
        self.gradient_builder = _builder(gradient_builder)
        # (the torch form checks the names, and on its own path refuses what it cannot run, naming the node;
        # ORT's builder takes every operator it has a gradient for)
        graph = OnnxGraphModule(
            self.onnx_model,
            weights_to_train=[],
            input_names=input_names,
            output_names=output_names,
            weights_as_inputs=self.weights_to_train,
            check_nodes=self.gradient_builder == "torch",
        )
        self.input_names = graph.input_names[: len(graph.input_names) - len(self.weights_to_train)]
        self.output_names = list(graph.output_names)
        if self.gradient_builder == "torch":
            self._engine = _TorchGradient(graph, sess_options, providers, save_graphs)
        else:
            self._engine = ort_gradient.TrainingGraph(
                self.onnx_model, self.weights_to_train, self.input_names, self.output_names, sess_options, providers
            )
        self.apply = _function_of(self).apply

    def weights(self) -> list[torch.Tensor]:
        initializers = {i.name: i for i in self.onnx_model.graph.initializer}
        return [torch.from_numpy(numpy_helper.to_array(initializers[n]).copy()) for n in self.weights_to_train]

    def new_instance(self):
        return self._engine.new_instance()


class _TorchGradient:
    """The backward graph from torch: OrtModule captures the graph run as torch operators."""

    def __init__(self, graph: OnnxGraphModule, sess_options, providers, save_graphs):
        self.runner = OrtModule(graph, session_options=sess_options, providers=providers, save_graphs=save_graphs)

    def new_instance(self) -> ForwardBackward:
        return ForwardBackward(self.runner)


class OnnxModule(torch.nn.Module):
    """An ONNX model (a path, bytes or a ModelProto) as a torch module that trains: its
    `weights_to_train` (default: every floating-point initializer) are Parameters, named as the
    ONNX initializers in `named_parameters()` and `state_dict()`; the other initializers stay
    constants. ONNX Runtime runs the forward graph and, when a loss is backpropagated, the
    backward graph; every input that requires grad gets its gradient. `input_names` (default:
    every graph input that no initializer fills) and `output_names` (default: the graph outputs)
    choose the module's arguments and results; `gradient_builder`, `session_options`,
    `providers` as for OrtGradientForwardBackward. Under torch.no_grad (or when nothing needs a
    gradient) only the forward runs, keeping no autograd context. `to_onnx()` gives the model
    with the current weights.
    """

    def __init__(
        self,
        model,
        weights_to_train: list[str] | None = None,
        *,
        input_names: list[str] | None = None,
        output_names: list[str] | None = None,
        session_options: ort.SessionOptions | None = None,
        providers: list | None = None,
        gradient_builder: str = "auto",
        save_graphs=None,
    ):
        super().__init__()
        # (not a submodule: this module's Parameters are its weights, by ONNX name)
        object.__setattr__(
            self,
            "forward_backward",
            OrtGradientForwardBackward(
                model,
                weights_to_train,
                input_names,
                output_names,
                session_options,
                providers,
                gradient_builder,
                save_graphs,
            ),
        )
        self.weights = torch.nn.ParameterList(self.forward_backward.weights())

    @property
    def onnx_model(self) -> onnx.ModelProto:
        return self.forward_backward.onnx_model

    @property
    def input_names(self) -> list[str]:
        return list(self.forward_backward.input_names)

    @property
    def output_names(self) -> list[str]:
        return list(self.forward_backward.output_names)

    def forward(self, *inputs):
        arguments = [*inputs, *self.weights]
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in arguments):
            return self.forward_backward.apply(*arguments)
        outputs = self.forward_backward.new_instance().forward(arguments, training=False)
        return outputs if len(outputs) > 1 else outputs[0]

    def _onnx_weights(self) -> dict[str, torch.nn.Parameter]:
        return dict(zip(self.forward_backward.weights_to_train, self.weights))

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in self._onnx_weights().items():
            yield prefix + name, p

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        state = destination if destination is not None else collections.OrderedDict()
        for name, p in self._onnx_weights().items():
            state[prefix + name] = p if keep_vars else p.detach()
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        weights = self._onnx_weights()
        missing = [n for n in weights if n not in state_dict]
        unexpected = [n for n in state_dict if n not in weights]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"state_dict does not fit the ONNX model's weights to train: missing {missing}, unexpected {unexpected}"
            )
        with torch.no_grad():
            for name, p in weights.items():
                if name in state_dict:
                    p.copy_(state_dict[name])
        return IncompatibleKeys(missing, unexpected)

    def to_onnx(self, path: str | os.PathLike | None = None) -> onnx.ModelProto:
        """The ONNX model with its trained initializers set to the current weights; saved to
        `path` when given."""
        model = onnx.ModelProto()
        model.CopyFrom(self.onnx_model)
        weights = self._onnx_weights()
        for init in model.graph.initializer:
            if init.name in weights:
                init.CopyFrom(numpy_helper.from_array(weights[init.name].detach().cpu().numpy(), init.name))
        if path is not None:
            onnx.save(model, os.fspath(path))
        return model


class ForwardBackward:
    """One forward (and its backward) of an OrtGradientForwardBackward on the torch path."""

    def __init__(self, runner: OrtModule):
        self._runner = runner
        self._arguments = self._outputs = None

    def forward(self, inputs, training: bool = False) -> tuple:
        if not training:
            with torch.no_grad():
                return _as_tuple(self._runner(*inputs))
        # Leaves of this forward's own graph: backward gives their gradients.
        self._arguments = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        with torch.enable_grad():
            self._outputs = _as_tuple(self._runner(*self._arguments))
        return tuple(o.detach() for o in self._outputs)

    def backward(self, grad_outputs) -> tuple:
        if self._outputs is None:
            raise RuntimeError("backward needs a forward with training=True first (and runs once per forward)")
        pairs = [(o, g) for o, g in zip(self._outputs, grad_outputs) if g is not None and o.requires_grad]
        wanted = [a for a in self._arguments if a.requires_grad]
        grads = iter(
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
        result = tuple(next(grads) if a.requires_grad else None for a in self._arguments)
        self._arguments = self._outputs = None  # (the contexts ORT kept for backward are gone now)
        return result


def _function_of(owner: OrtGradientForwardBackward) -> type:
    """A torch.autograd.Function running `owner`'s forward and backward."""

    class OnnxGraphFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *arguments):
            ctx.instance = owner.new_instance()
            outputs = ctx.instance.forward(arguments, training=True)
            return outputs if len(outputs) > 1 else outputs[0]

        @staticmethod
        def backward(ctx, *grad_outputs):
            return ctx.instance.backward(grad_outputs)

    return OnnxGraphFunction
