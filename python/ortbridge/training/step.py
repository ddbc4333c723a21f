"""A captured training step's glue into torch autograd: one autograd.Function whose forward runs
the forward graph's session and whose backward runs the backward graph's.

AOTAutograd's own runtime does this for every graph it can trace (outputs that alias inputs,
metadata mutations, tensor subclasses, RNG state, effect tokens), through layers of wrappers in
Python that cost about a third of a small step's fixed cost (benchmarks/overhead.py). Where the
capture's metadata shows a step needs none of that, only data mutations of inputs that need no
gradient (batch norm's running statistics), this runtime takes its place; otherwise AOTAutograd's
stays.
"""

from __future__ import annotations

import torch

from .._compat.torch_private import (
    MutationType,
    OutputType,
    direct_apply,
    functorch_transforms_active,
    is_any_autocast_enabled,
    is_tangent,
    is_traceable_wrapper_subclass,
    leave_non_differentiable_gradients_absent,
    opaque_objects_saved,
    saved_for_backward,
)
from .._copying import NotCopyable
from .stages import StagedBackward


class Step(NotCopyable):
    """The forward and backward sessions of a training capture, called as the module's flat
    function: `step(params_and_buffers + tensors)` gives the module's output tensors. (`meta`:
    the capture's ViewAndMutationMeta, AOTAutograd's metadata of inputs and outputs.)"""

    def __init__(self, meta, forward, backward):
        self.forward_graph, self.backward_graph = forward, backward
        self.mutated = meta.mutated_inp_runtime_indices  # each updated by the output at its position
        self.outputs = slice(len(self.mutated), len(self.mutated) + meta.num_outputs)
        self.returned = meta.num_forward_returns
        self.non_differentiable = [
            k
            for k, info in enumerate([meta.input_info[i] for i in self.mutated] + meta.output_info)
            if not info.requires_grad
        ]
        # (the unchecked ones as eager saved them: no version check)
        self.saved, self.unchecked, self.symints = saved_for_backward(meta)
        # The backward graph's gradient inputs: of the outputs that have one.
        self.tangents = [
            len(self.mutated) + k
            for k, info in enumerate(meta.output_info)
            if issubclass(info.raw_type, torch.Tensor) and is_tangent(info)
        ]
        # Inputs with a history whose gradient the backward graph never computes: detached, as
        # AOTAutograd does, so that torch's backward does not walk into that history.
        self.detached = [
            i
            for i, info in enumerate(meta.input_info)
            if not backward.computes(i) and info.requires_grad and not info.is_leaf
        ]
        self.runs_contexts = backward.runs_contexts  # (its Functions' contexts: released by a run)
        # A backward graph in stages (stages.py): the inputs whose gradients a later stage gives
        # reach the step through that stage's _Stage node.
        self.staged = backward if isinstance(backward, StagedBackward) else None
        # What only the step saves for backward is written into the last step's buffers where
        # nothing holds them any more (GraphSession.recycle).
        computed = [j for kind, j, *_ in forward.graph.sources[self.saved] if kind == "onnx"]
        returned = {j for kind, j, *_ in forward.graph.sources[: self.returned] if kind == "onnx"}
        forward.recycle([j for j in computed if j not in returned])

    @staticmethod
    def of(meta, sessions: list, args: list) -> Step | None:
        """The step for a capture of `args` (parameters, buffers, then tensor arguments), or None
        where AOTAutograd's runtime must stay."""
        if len(sessions) != 2 or not _plain(meta) or is_any_autocast_enabled():
            return None  # (under autocast, AOTAutograd's runtime runs the graphs with autocast off)
        if len(args) != len(meta.input_info) or any(is_traceable_wrapper_subclass(t) for t in args):
            # (inputs merged: a tensor given twice that the step mutates, views of one base; a
            # tensor subclass, whose metadata the trace gives as that of its inner tensors)
            return None
        return Step(meta, *sessions)

    def __call__(self, args: list) -> list:
        for i in self.detached:
            args[i] = args[i].detach()
        # (torch's Python wrapper of apply only passes the arguments on, unless functorch is active)
        if self.staged is not None:
            returned = self._apply_staged(args)
        else:
            returned = (_StepFunction.apply if _functorch_active() else _apply_step)(self, *args)
        for k, i in enumerate(self.mutated):
            args[i].copy_(returned[k])
        return returned[self.outputs]

    def _apply_staged(self, args: list) -> tuple:
        staged, pending, carrier = self.staged, _Pending(self.staged), None
        given = list(args)
        for k in range(staged.count - 1, 0, -1):
            carrier = _Stage.apply(pending, k, carrier, *(args[i] for i in staged.gradients[k]))
            for i in staged.gradients[k]:
                given[i] = args[i].detach()  # (its gradient is the _Stage node's to give)
        return _StagedStepFunction.apply(self, pending, carrier, *given)


def _plain(meta) -> bool:
    """Whether a step with this metadata needs nothing of AOTAutograd's runtime but the graphs'
    calls and copies into mutated inputs that need no gradient."""
    return (
        not meta.tokens
        and not meta.num_backward_tokens
        and not meta.is_rng_op_functionalized
        and not meta.num_graphsafe_rng_states
        and not meta.num_intermediate_bases
        and not opaque_objects_saved(meta)
        and meta.grad_enabled_mutation is None
        and all(info.output_type is OutputType.non_alias for info in meta.output_info)
        and all(
            info.mutation_type in (MutationType.NOT_MUTATED, MutationType.MUTATED_OUT_GRAPH)
            and not info.mutates_metadata
            and not info.requires_grad
            for info in (meta.input_info[i] for i in meta.mutated_inp_runtime_indices)
        )
    )


def _forward(ctx, step: Step, args: tuple) -> tuple:
    outputs = step.forward_graph(list(args))
    ctx.step = step
    ctx.save_for_backward(*(t.detach() if t._is_view() else t for t in outputs[step.saved]))
    ctx.unchecked = outputs[step.unchecked]
    ctx.symints = outputs[step.symints]
    returned = tuple(outputs[: step.returned])
    ctx.mark_non_differentiable(*(returned[k] for k in step.non_differentiable))
    leave_non_differentiable_gradients_absent(ctx)  # (their gradients are not inputs of the backward graph)
    return returned


def _backward_inputs(ctx, grads: tuple) -> list:
    """The backward graph's inputs: what the forward saved, then the outputs' gradients."""
    step = ctx.step
    if step.runs_contexts:
        if getattr(ctx, "ran", False):
            raise RuntimeError(
                "ortbridge: a second backward through a captured step (retain_graph=True) whose "
                "graph calls Functions: their contexts were released by the first backward. "
                "Call the module again for another backward."
            )
        ctx.ran = True
    return [*ctx.symints, *ctx.saved_tensors, *ctx.unchecked, *(grads[k] for k in step.tangents)]


class _StepFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: Step, *args):
        return _forward(ctx, step, args)

    @staticmethod
    def backward(ctx, *grads):
        args = _backward_inputs(ctx, grads)
        if torch.is_grad_enabled():  # (create_graph=True: first-order gradients, as AOTAutograd gives)
            return (None, *_first_order(ctx.step.backward_graph, args))
        return (None, *ctx.step.backward_graph(args))


_functorch_active = functorch_transforms_active
_apply_step = direct_apply(_StepFunction) or _StepFunction.apply


class _StagedStepFunction(torch.autograd.Function):
    """A step whose backward graph runs in stages: its backward runs stage 0 and leaves what the
    later stages read in `pending`, for the _Stage nodes; `carrier`: the output of stage 1's."""

    @staticmethod
    def forward(ctx, step: Step, pending: _Pending, carrier, *args):
        ctx.pending = pending
        return _forward(ctx, step, args)

    @staticmethod
    def backward(ctx, *grads):
        gradients = [None] * (len(ctx.needs_input_grad) - 3)
        for i, gradient in zip(ctx.step.staged.gradients[0], ctx.pending.start(_backward_inputs(ctx, grads))):
            gradients[i] = gradient
        return (None, None, torch.empty(0), *gradients)  # (the carrier's: so that autograd runs stage 1 next)


class _Pending:
    """One forward call's staged backward: the values later stages read, from its stage 0 on."""

    def __init__(self, staged: StagedBackward):
        self.staged = staged
        self.values = None

    def start(self, args: list) -> list:
        self.values = dict(enumerate(args))
        return self.run(0)

    def run(self, k: int) -> list:
        return self.staged.run(k, self.values, _first_order if torch.is_grad_enabled() else None)


class _Stage(torch.autograd.Function):
    """Stage k (> 0) of a staged backward, between the node of stage k - 1 and the tensors whose
    gradients stage k gives: its forward gives a carrier (an empty tensor, which that node takes,
    so that autograd runs this one after it); its backward runs the stage."""

    @staticmethod
    def forward(ctx, pending: _Pending, k: int, carrier, *tensors):
        ctx.pending, ctx.k, ctx.carries = pending, k, carrier is not None
        return torch.empty(0)

    @staticmethod
    def backward(ctx, carried):
        gradients = ctx.pending.run(ctx.k)
        return (None, None, torch.empty(0) if ctx.carries else None, *gradients)


def _first_order(backward_graph, args: list) -> tuple:
    return _FirstOrder.apply(backward_graph, torch.empty(0, requires_grad=True), *args)


class _FirstOrder(torch.autograd.Function):
    """A backward graph's run under create_graph=True: its gradients have a history whose own
    backward refuses to run (the graph has no derivative), where it would give wrong results."""

    @staticmethod
    def forward(ctx, backward_graph, anchor, *args):  # (anchor: a tensor that needs a gradient, so the outputs do)
        return tuple(backward_graph(list(args)))

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("ortbridge: double backward through a captured step is not supported")
