"""Every way users write a custom kernel, each exported, run by ONNX Runtime at two batch sizes and
trained 3 steps under OrtModule and torch.compile(backend="ortbridge") against eager:
- a torch.autograd.Function;
- torch.library.custom_op with register_fake and register_autograd: one output, several outputs;
- a custom op that writes into its arguments (mutates_args), on a buffer and on an activation;
- a C++ TORCH_LIBRARY op with its autograd registered from Python, and one with C++ autograd
  (built with load_inline).
A custom op is one fallback node forward (its namespace allowed with ortbridge.allow_operators), its
registered backward traced into the backward graph; no torch-internal Function is ever registered."""

import copy
import os

import numpy as np
import onnx
import pytest
import torch
from side_by_side import train_side_by_side

import ortbridge

nn = torch.nn
NAMESPACE = "kernel_styles"
ortbridge.allow_operators(NAMESPACE)


# -- torch.library.custom_op, functional: x * sin(w), its backward registered -----------------------
@torch.library.custom_op(f"{NAMESPACE}::scale", mutates_args=())
def scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w.sin()


@scale.register_fake
def _(x, w):
    return torch.empty_like(x)


def _scale_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scale_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad * w.sin(), (grad * x * w.cos()).sum(0)


scale.register_autograd(_scale_backward, setup_context=_scale_setup)


# -- several outputs: (x * 2, x.exp()) -------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::twice_and_exp", mutates_args=())
def twice_and_exp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x.exp()


@twice_and_exp.register_fake
def _(x):
    return torch.empty_like(x), torch.empty_like(x)


def _twice_and_exp_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _twice_and_exp_backward(ctx, grad_twice, grad_exp):
    (exp,) = ctx.saved_tensors
    return grad_twice * 2 + grad_exp * exp


twice_and_exp.register_autograd(_twice_and_exp_backward, setup_context=_twice_and_exp_setup)


# -- writes into its first argument: total += x.sum(0) ---------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::accumulate_", mutates_args=("total",))
def accumulate_(total: torch.Tensor, x: torch.Tensor) -> None:
    total.add_(x.sum(0))


@accumulate_.register_fake
def _(total, x):
    return None


class Softsign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / (1 + x.abs())

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (1 + x.abs()) ** 2


ortbridge.register(Softsign)

CPP_SOURCE = r"""
#include <torch/extension.h>

// x.tanh() * s: its autograd registered from Python.
torch::Tensor scaled_tanh(const torch::Tensor& x, double s) { return x.tanh() * s; }

// x * x * x: its autograd a torch::autograd::Function, registered for the Autograd key.
torch::Tensor cubed(const torch::Tensor& x) { return x * x * x; }

class Cubed : public torch::autograd::Function<Cubed> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kernel_styles::cubed", "")
                         .typed<torch::Tensor(const torch::Tensor&)>();
    return op.call(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto x = ctx->get_saved_variables()[0];
    return {grads[0] * 3 * x * x};
  }
};

torch::Tensor cubed_autograd(const torch::Tensor& x) { return Cubed::apply(x); }

TORCH_LIBRARY_FRAGMENT(kernel_styles, m) {
  m.def("scaled_tanh(Tensor x, float s) -> Tensor");
  m.def("cubed(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(kernel_styles, CPU, m) {
  m.impl("scaled_tanh", &scaled_tanh);
  m.impl("cubed", &cubed);
}
TORCH_LIBRARY_IMPL(kernel_styles, Autograd, m) { m.impl("cubed", &cubed_autograd); }
"""


@pytest.fixture(scope="module")
def cpp_ops():
    """The two C++ operators (compiled once per torch release; torch caches the build)."""
    from torch.utils.cpp_extension import load_inline

    if not hasattr(torch.ops.kernel_styles, "cubed"):
        load_inline(
            f"ortbridge_kernel_styles_{torch.__version__.replace('.', '_').replace('+', '_')}",
            cpp_sources=CPP_SOURCE,
            is_python_module=False,
            extra_cflags=["-O1"],
        )
        torch.library.register_fake(f"{NAMESPACE}::scaled_tanh")(lambda x, s: torch.empty_like(x))
        torch.library.register_fake(f"{NAMESPACE}::cubed")(lambda x: torch.empty_like(x))

        def setup(ctx, inputs, output):
            ctx.save_for_backward(output)
            ctx.s = inputs[1]

        def backward(ctx, grad):
            (out,) = ctx.saved_tensors
            return grad * (ctx.s - out * out / ctx.s), None

        torch.library.register_autograd(f"{NAMESPACE}::scaled_tanh", backward, setup_context=setup)
    return torch.ops.kernel_styles


class Model(nn.Module):
    """Linear, the kernel, Linear."""

    def __init__(self, kernel):
        super().__init__()
        torch.manual_seed(0)
        self.kernel = kernel
        self.first, self.last = nn.Linear(4, 6), nn.Linear(6, 3)
        self.w = nn.Parameter(torch.randn(6))
        self.register_buffer("total", torch.zeros(6))

    def forward(self, x):
        return self.last(self.kernel(self, self.first(x)))


def _with_mutation(m, h):
    """Writes into a buffer and into an activation, and reads both after."""
    torch.ops.kernel_styles.accumulate_(m.total, h.detach())
    doubled = h.detach().clone()
    torch.ops.kernel_styles.accumulate_(doubled, h.detach())
    return h.relu() * doubled.sigmoid() + m.total


STYLES = {
    "function": (lambda m, h: Softsign.apply(h) * m.w, ortbridge.registry.qualified_name(Softsign)),
    "custom_op": (lambda m, h: torch.ops.kernel_styles.scale(h, m.w), f"{NAMESPACE}::scale.default"),
    "custom_op_outputs": (
        lambda m, h: torch.mul(*torch.ops.kernel_styles.twice_and_exp(h * 0.1)),
        f"{NAMESPACE}::twice_and_exp.default",
    ),
    "custom_op_mutating": (_with_mutation, f"{NAMESPACE}::accumulate_.default"),
    "cpp_op_python_autograd": (
        lambda m, h: torch.ops.kernel_styles.scaled_tanh(h, 1.5) * m.w,
        f"{NAMESPACE}::scaled_tanh.default",
    ),
    "cpp_op_cpp_autograd": (lambda m, h: torch.ops.kernel_styles.cubed(h * 0.5), f"{NAMESPACE}::cubed.default"),
}


@pytest.fixture(params=list(STYLES))
def style(request):
    if request.param.startswith("cpp_"):
        request.getfixturevalue("cpp_ops")
    return request.param


def _python_ops(proto: onnx.ModelProto) -> list[str]:
    return [
        next(a.s.decode() for a in n.attribute if a.name == "func_name")
        for n in proto.graph.node
        if n.domain == "ortbridge"
    ]


def test_exports_and_runs_at_two_batch_sizes(style, tmp_path):
    kernel, node = STYLES[style]
    model = Model(kernel).eval()
    path = tmp_path / "model.onnx"
    ortbridge.export(model, (torch.randn(3, 4),), path, dynamic_shapes=({0: "batch"},))
    assert _python_ops(onnx.load(path)) == [node] * (2 if style == "custom_op_mutating" else 1)
    session = ortbridge.InferenceSession(path)
    for batch in (3, 7):
        x = torch.randn(batch, 4)
        expected = copy.deepcopy(model)(x)  # (a copy: the mutating style writes into its buffer)
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        np.testing.assert_allclose(got, expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert not any("GeneratedBackwardFor" in name for name in ortbridge.registered_names())


def _batch(step):
    torch.manual_seed(100 + step)
    return (torch.randn(5, 4),), {}


@pytest.mark.parametrize("wrapper", ["OrtModule", "compile"])
def test_trains_equal_to_eager(style, wrapper, tmp_path):
    kernel, node = STYLES[style]
    if wrapper == "OrtModule":
        wrap = lambda m: ortbridge.OrtModule(m, save_graphs=tmp_path)  # noqa: E731
    else:
        wrap = lambda m: torch.compile(m, backend="ortbridge", options={"save_graphs": str(tmp_path)})  # noqa: E731
    train_side_by_side(Model(kernel), _batch, lambda out, step: (out**2).mean(), wrap=wrap)
    forward = onnx.load(tmp_path / next(f for f in sorted(os.listdir(tmp_path)) if f.endswith("_forward.onnx")))
    # One node forward; the registered backward traced into the backward graph (no node of its own).
    # (dynamo inlines a Function it can trace, as Softsign: ORT runs its operators)
    nodes = 0 if (style, wrapper) == ("function", "compile") else 2 if style == "custom_op_mutating" else 1
    assert _python_ops(forward).count(node) == nodes
    assert not any("GeneratedBackwardFor" in name for name in ortbridge.registered_names())


class Shifted(torch.autograd.Function):
    """Called with a new object at each call (as torch's own Function for a custom op's autograd,
    which ortbridge now leaves alone, was): a capture cannot match its traced call to the eager one."""

    @staticmethod
    def forward(ctx, x, tag):
        return x + 1

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Tag:
    pass


class CallsWithNewObjects(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return Shifted.apply(self.lin(x), Tag())


def test_a_failed_capture_leaves_nothing_behind():
    """The failing call, then a working one, in one process: the failed capture registered no
    Function and left apply unrouted."""
    before = ortbridge.registered_names()
    with pytest.raises(ortbridge.ExportError, match="another object than in the eager run"):
        ortbridge.OrtModule(CallsWithNewObjects())(torch.randn(2, 4, requires_grad=True))
    assert ortbridge.registered_names() == before
    assert not ortbridge._compat.torch_private.apply_routed()
    with pytest.raises(ortbridge.ExportError, match="another object than in the eager run"):
        ortbridge.export(CallsWithNewObjects(), (torch.randn(2, 4),), all_functions=True)
    assert ortbridge.registered_names() == before
    train_side_by_side(Model(STYLES["custom_op"][0]), _batch, lambda out, step: out.sum())


def test_a_node_of_a_mutating_op_never_writes_into_its_inputs():
    """A file may name a custom op that writes into its arguments: its node runs it on copies,
    and refuses the call forms that would write into ONNX Runtime's buffers (positional arguments,
    torch's _only_clone_these_* keywords); aten's in-place operators stay refused."""
    function = ortbridge._kernel.lookup.lookup(f"{NAMESPACE}::accumulate_.default")
    total, x = torch.zeros(3), torch.ones(2, 3)
    (new_total,) = function.apply((-1, -1), ("total", "x"), total, x)
    assert torch.equal(new_total, torch.full((3,), 2.0)) and torch.equal(total, torch.zeros(3))
    with pytest.raises(TypeError, match="writes into its arguments"):
        function.apply((-1, -1), (), total, x)
    with pytest.raises(TypeError, match="writes into its arguments"):
        function.apply((-1, -1, -1), ("total", "x", "_only_clone_these_tensors"), total, x, ())
    assert torch.equal(total, torch.zeros(3))
    with pytest.raises(ortbridge.UnknownFunctionError, match="writes into its arguments is not allowed"):
        ortbridge._kernel.lookup.lookup("aten::add_.Tensor")
