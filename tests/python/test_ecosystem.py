"""OrtModule on the paths around a model that the ecosystem takes: torch.func's functional_call
(MAML loops), torch.func transforms, and other models compiled with torch.compile in the same
process. Each side by side with eager PyTorch: eager's results, or a refusal naming OrtModule."""

from __future__ import annotations

import copy
import logging
import threading

import pytest
import torch
import transformers
from conftest import needs_bfloat16_binding
from side_by_side import assert_close, train_side_by_side
from torch.func import functional_call

import ortbridge
from ortbridge.training.fx_passes import DECOMPOSITIONS

nn = torch.nn
F = torch.nn.functional


@pytest.fixture
def captures(caplog):
    """How many captures the test's OrtModules have made so far."""
    caplog.set_level(logging.INFO, logger="ortbridge")
    return lambda: sum(r.getMessage().startswith("capturing ") for r in caplog.records)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _maml_outer_step(model, x_support, y_support, x_query, y_query, inner_steps: int = 3, lr: float = 0.1):
    """One outer step of first-order MAML: inner SGD steps on adapted tensors through
    functional_call, the query loss of the adapted parameters, its gradients on the model's.
    (Second-order MAML, create_graph=True, differentiates the captured backward: refused.)"""
    params = dict(model.named_parameters())
    for _ in range(inner_steps):
        loss = nn.functional.mse_loss(functional_call(model, params, (x_support,)), y_support)
        grads = torch.autograd.grad(loss, list(params.values()))
        params = {name: p - lr * g for (name, p), g in zip(params.items(), grads)}
    outer = nn.functional.mse_loss(functional_call(model, params, (x_query,)), y_query)
    return outer, torch.autograd.grad(outer, list(model.parameters()))


@pytest.mark.parametrize(
    "autocast",
    [pytest.param(False, id="float32"), pytest.param(True, id="bf16-autocast", marks=needs_bfloat16_binding)],
)
def test_functional_call_runs_the_tensors_it_is_given_as_eager_does(autocast, captures):
    torch.manual_seed(0)
    eager = Mlp()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    x_support, y_support, x_query, y_query = (torch.randn(16, n) for n in (8, 4, 8, 4))
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        for step in range(3):  # (the first outer step captures; the next ones reuse it)
            expected = _maml_outer_step(eager, x_support, y_support, x_query, y_query)
            actual = _maml_outer_step(wrapped, x_support, y_support, x_query, y_query)
            tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else {}
            assert_close(actual, expected, f"outer loss and gradients, step {step}", **tolerance)
            with torch.no_grad():  # (the same outer update on both)
                for p, q, g in zip(eager.parameters(), wrapped.parameters(), expected[1]):
                    p -= 0.1 * g
                    q.copy_(p)
            for b, c in zip(eager.buffers(), wrapped.buffers()):
                c.copy_(b)
    # Adapted tensors are other tensors of the same dtypes and sizes: the captures run them.
    assert captures() == 1, "adapted parameters captured again"
    # And the module's own parameters again after functional_call restored them.
    x = torch.randn(4, 8)
    assert_close(wrapped(x), eager(x), "a plain call after functional_call")


def test_functional_call_swaps_a_top_level_parameter_of_the_wrapped_module():
    torch.manual_seed(0)
    eager = nn.Linear(4, 2)
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    x = torch.randn(3, 4)
    wrapped(x)
    new = {name: p.detach() + 1.0 for name, p in eager.named_parameters()}
    assert_close(functional_call(wrapped, new, (x,)), functional_call(eager, new, (x,)), "swapped parameters")
    assert isinstance(wrapped.module.weight, nn.Parameter), "functional_call put the parameter back"
    assert_close(wrapped(x), eager(x), "the module's own parameters again")


def test_a_parameter_written_into_the_module_directly_is_run_without_capturing_again(captures):
    torch.manual_seed(0)
    eager = Mlp()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    x = torch.randn(4, 8)
    wrapped(x), wrapped(x)
    for module in (eager, wrapped.module):  # (no registration: what torch.nn.utils.stateless does)
        module.fc2._parameters["weight"] = nn.Parameter(torch.full((4, 16), 0.5))
    assert_close(wrapped(x), eager(x), "after the write")
    assert captures() == 1
    # Another dtype is another graph: captured again, never bound as the old one.
    for module in (eager, wrapped.module):
        module.fc2._parameters["weight"] = nn.Parameter(torch.full((4, 16), 0.5, dtype=torch.float64))
        module.fc2.bias.data = module.fc2.bias.data.double()
    with pytest.raises(RuntimeError) as expected:
        eager(x)
    with pytest.raises(RuntimeError) as actual:
        wrapped(x)
    assert type(actual.value) is type(expected.value)


@pytest.mark.parametrize(
    "transform",
    [
        lambda o, x: torch.func.grad(lambda p: functional_call(o, p, (x,)).sum())(
            {n: p.detach() for n, p in o.named_parameters()}
        ),
        lambda o, x: torch.func.vmap(o)(x.unsqueeze(1)),
        lambda o, x: torch.func.jacrev(o)(x),
    ],
    ids=["grad", "vmap", "jacrev"],
)
def test_torch_func_transforms_over_an_ort_module_are_refused_naming_it(transform):
    wrapped = ortbridge.OrtModule(nn.Linear(4, 2))
    x = torch.randn(3, 4)
    wrapped(x)
    with pytest.raises(RuntimeError, match=r"OrtModule cannot run inside a torch\.func transform"):
        transform(wrapped, x)
    assert_close(wrapped(x), wrapped.module(x), "after the refusal")


class _Sliced(nn.Module):
    """A forward that builds a module on each call (a ModuleList slice, as Hugging Face's Llama
    slices its layers): dynamo inlines ModuleList's construction, registration included."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        return x


def test_other_models_compiled_in_the_process_compile_once():
    # (ortbridge imported and used: captures on several threads at once, which left process-wide
    # state behind when captures set torch.compiler's stance)
    def capture():
        ortbridge.OrtModule(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))(torch.randn(2, 8)).sum().backward()

    threads = [threading.Thread(target=capture) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(_Sliced(), backend=counting)
    x = torch.randn(2, 8)
    for _ in range(6):
        compiled(x)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 6 identical calls: ortbridge changed what dynamo guards on"


class _Parent(nn.Module):
    """Eager layers around a block (the one an OrtModule wraps) and a custom Function."""

    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16))

    def forward(self, x):
        return self.head(torch.tanh(self.block(self.stem(x))))


def _compiled_parent(parent: _Parent, backend) -> nn.Module:
    parent.block = ortbridge.OrtModule(parent.block)
    return torch.compile(parent, backend=backend)


COMPOSITIONS = {
    "compile(OrtModule(m))": lambda m, backend: torch.compile(ortbridge.OrtModule(m), backend=backend),
    "OrtModule(compile(m))": lambda m, backend: ortbridge.OrtModule(torch.compile(m, backend=backend)),
    "compiled parent of an OrtModule": _compiled_parent,
}


@pytest.mark.parametrize("backend", ["inductor", "ortbridge"])
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_torch_compile_composed_with_ort_module_trains_as_eager(composition, backend, captures):
    """ONNX Runtime runs the OrtModule's graphs whichever way round: dynamo ends its graphs around
    an OrtModule's call, and an OrtModule runs a compiled module's own code. One capture, and the
    compiled graphs compile once, for steps of one signature."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    graphs = []

    def counting(gm, example_inputs):  # (dynamo's graphs, then the backend's compiler)
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    wrapped = train_side_by_side(
        _Parent(),
        lambda step: ((x + step,), {}),
        lambda out, step: out.square().mean(),
        steps=4,
        wrap=lambda m: COMPOSITIONS[composition](m, counting),
    )
    # (one capture of the OrtModule's; the ortbridge backend captures each of dynamo's graphs too)
    assert captures() == 1 + (len(graphs) if backend == "ortbridge" else 0)
    compiled_graphs = len(graphs)
    wrapped(x)
    assert len(graphs) == compiled_graphs, "a step of the same signature compiled again"


def test_swa_update_bn_on_an_ort_module_is_refused_naming_momentum_and_on_its_module_runs_eagerly():
    torch.manual_seed(0)
    eager = Mlp()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    loader = [torch.randn(16, 8) for _ in range(3)]
    wrapped(loader[0])  # (a capture with the layer's momentum, before update_bn)
    with pytest.raises(ortbridge.CaptureError, match=r"'norm' \(BatchNorm1d\) has momentum=None.*update_bn"):
        torch.optim.swa_utils.update_bn(loader, wrapped)
    wrapped.module.norm.momentum = 0.1  # (update_bn leaves it None when the forward raises)
    torch.optim.swa_utils.update_bn(loader, eager)
    torch.optim.swa_utils.update_bn(loader, wrapped.module)
    assert_close(list(wrapped.buffers()), list(eager.buffers()), "running statistics")
    x = torch.randn(4, 8)
    assert_close(wrapped(x), eager(x), "a training call after update_bn")


@pytest.mark.parametrize("head", [False, True], ids=["conv-block", "pooled-head"])
@pytest.mark.parametrize("wrapper", ["OrtModule", "compile"])
def test_channels_last_outputs_come_back_channels_last(wrapper, head):
    """A channels_last CNN: outputs laid out as eager's, gradients eager's; with a classifier head
    (pool to 1x1, flatten: AOTAutograd traces the flatten as an as_strided view, whose gradient
    is an as_strided_scatter, fx_passes._as_strided_scatter)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    if head:
        eager.extend([nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)])
    eager = eager.to(memory_format=torch.channels_last)
    model = copy.deepcopy(eager)
    wrapped = ortbridge.OrtModule(model) if wrapper == "OrtModule" else torch.compile(model, backend="ortbridge")
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            actual, expected = wrapped(x), eager(x)
        assert actual.stride() == expected.stride(), f"strides {actual.stride()}, eager's {expected.stride()}"
        assert_close(actual, expected, f"outputs (grad {grad})")
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    assert_close([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()], "gradients")


@pytest.mark.parametrize(
    "base_size, size, stride, offset",
    [(16, [2, 8], [8, 1], 0), (16, [2, 8, 1, 1], [8, 1, 8, 8], 0), (20, [2, 3], [5, 2], 3), (12, [3, 4], [1, 3], 0)],
    ids=["all-in-order", "size-1-dims", "part-with-offset", "transposed"],
)
def test_as_strided_scatter_in_onnx_operators_is_torchs(base_size, size, stride, offset):
    """The decomposition the capture traces as_strided_scatter with equals torch's operator; a view
    whose elements overlap is left to the operator (NotImplemented: the export refuses it)."""
    scatter = DECOMPOSITIONS[torch.ops.aten.as_strided_scatter.default]
    base, src = torch.randn(base_size), torch.randn(size)
    expected = torch.as_strided_scatter(base, src, size, stride, offset)
    assert torch.equal(scatter(base, src, size, stride, offset), expected)
    assert scatter(base, torch.randn(2, 3), [2, 3], [1, 1], 0) is NotImplemented


@pytest.fixture
def swap_tensors_mode():
    """torch's swap-tensors mode (load_state_dict and .to() swap each parameter's contents into
    the parameter object), for the test only."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def _dynamo_lets_a_compiled_module_swap() -> bool:
    """Whether torch.compile itself (its eager backend) leaves a compiled module's parameters
    swappable: torch 2.9's dynamo keeps weak references to them."""
    model = nn.Linear(2, 2)
    torch.compile(model, backend="eager")(torch.randn(1, 2))
    try:
        model.load_state_dict(model.state_dict())
    except RuntimeError as e:
        if "weakref" not in str(e):
            raise
        return False
    return True


@pytest.mark.parametrize("wrapper", ["OrtModule", "compile"])
def test_swap_tensors_loading_and_conversion_train_as_eager(wrapper, swap_tensors_mode, captures):
    if wrapper == "compile" and not _dynamo_lets_a_compiled_module_swap():
        pytest.skip(f"torch {torch.__version__}'s dynamo keeps weak references to a compiled module's parameters")
    torch.manual_seed(0)
    eager = Mlp()
    model = copy.deepcopy(eager)
    wrapped = ortbridge.OrtModule(model) if wrapper == "OrtModule" else torch.compile(model, backend="ortbridge")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    x, y = torch.randn(16, 8), torch.randn(16, 4)

    def step(module, optimizer, inputs, targets):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(module(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss

    assert_close(step(wrapped, optimizers[0], x, y), step(eager, optimizers[1], x, y), "loss before loading")
    checkpoint = {k: v + 0.5 if v.is_floating_point() else v for k, v in eager.state_dict().items()}
    parameters = list(model.parameters())
    for m in (model, eager):
        m.load_state_dict(checkpoint)
    assert all(a is b for a, b in zip(model.parameters(), parameters)), "the optimizer's parameters are swapped into"
    assert_close(list(model.parameters()), list(eager.parameters()), "loaded parameters")
    for k in range(2):
        actual, expected = step(wrapped, optimizers[0], x, y), step(eager, optimizers[1], x, y)
        assert_close(actual, expected, f"loss {k} after loading")
    assert_close(list(model.parameters()), list(eager.parameters()), "parameters after training")
    if wrapper == "OrtModule":
        assert captures() == 1, "loading in place of the parameters keeps the capture"
    for m in (model, eager):
        m.double()
    assert all(a is b for a, b in zip(model.parameters(), parameters)), ".double() swaps into the same parameters"
    actual, expected = wrapped(x.double()), eager(x.double())
    assert actual.dtype == torch.float64
    assert_close(actual, expected, "outputs in float64")


class _SeededNoise(torch.autograd.Function):
    """As transformers' Reformer's reversible Function: its forward sets the layer's seed (a plain
    attribute) and draws with it; its backward draws again with the same seed."""

    @staticmethod
    def forward(ctx, x, layer):
        layer.seed = int(torch.randint(0, 2**31, ()).item())
        ctx.layer, ctx.seed = layer, layer.seed
        generator = torch.Generator().manual_seed(layer.seed)
        return x * torch.rand(x.shape, generator=generator)

    @staticmethod
    def backward(ctx, g):
        generator = torch.Generator().manual_seed(ctx.seed)
        return g * torch.rand(g.shape, generator=generator), None


class _Seeded(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.seed = nn.Linear(8, 8), 0

    def forward(self, x):
        return _SeededNoise.apply(self.fc(x), self)


def test_an_attribute_a_function_running_in_pytorch_writes_is_not_refused(captures):
    torch.manual_seed(0)
    eager = _Seeded()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    x = torch.randn(4, 8)
    for step in range(3):
        torch.manual_seed(step)
        expected = eager(x)
        expected.sum().backward()
        torch.manual_seed(step)
        actual = wrapped(x)
        actual.sum().backward()
        assert wrapped.module.seed == eager.seed, f"step {step}: the Function's write reaches the module"
        assert_close(actual, expected, f"step {step}: outputs")
    assert_close([p.grad for p in wrapped.parameters()], [p.grad for p in eager.parameters()], "gradients")
    assert captures() == 1, "the seed the Function writes is no constant of the capture"


def test_hugging_faces_reformer_trains_as_eager_and_its_cache_is_refused_naming_it():
    """transformers' Reformer: its reversible Function runs as a node and sets the layers' seeds
    (attributes) at every call; without dropout (with it, eager itself is not reproducible:
    torch.seed()) three steps give eager's losses and gradients. With its default use_cache the
    forward makes a cache object anew at each call and passes it to the Function: refused, naming
    it and use_cache=False."""
    config = transformers.ReformerConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, attention_head_size=16, axial_pos_embds=False,
        attn_layers=["local", "local"], feed_forward_size=64, max_position_embeddings=64, local_attn_chunk_length=8,
        is_decoder=True, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.ReformerModelWithLMHead(config).train()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    ids = torch.randint(1, 64, (2, 32))
    for step in range(3):
        for model in (eager, wrapped):
            model.zero_grad()
        actual, expected = (m(ids, labels=ids, use_cache=False).loss for m in (wrapped, eager))
        actual.backward()
        expected.backward()
        assert_close(actual, expected, f"step {step}: loss")
        assert_close([p.grad for p in wrapped.parameters()], [p.grad for p in eager.parameters()], "gradients")
        with torch.no_grad():
            for p, q in zip(wrapped.parameters(), eager.parameters()):
                if q.grad is not None:
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
    with pytest.raises(ortbridge.ExportError, match="a ReformerDynamicCache, is another object.*use_cache=False"):
        wrapped(ids, labels=ids)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hugging_face_gradient_checkpointing_trains_as_eager(reentrant, captures):
    """gradient_checkpointing_enable adds transformers' enable_input_require_grads hook (traced);
    use_reentrant=True runs torch's CheckpointFunction with a partial of the layer's call."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=99, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    eager = transformers.GPT2LMHeadModel(config).train()
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    ids = torch.randint(0, 99, (3, 14))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, -3:] = 0
    for step in range(2):
        expected = eager(input_ids=ids, attention_mask=mask, labels=ids).loss
        actual = wrapped(input_ids=ids, attention_mask=mask, labels=ids).loss
        expected.backward(), actual.backward()
        assert_close(actual, expected, f"step {step}: loss")
        assert_close([p.grad for p in wrapped.parameters()], [p.grad for p in eager.parameters()], "gradients")
    assert captures() == 1


def test_a_reentrant_checkpoint_without_inputs_needing_grad_gives_its_parameters_none_as_eager():
    torch.manual_seed(0)

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True))

    eager = Checkpointed()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    x = torch.randn(4, 8)  # (no gradient: eager's reentrant checkpoint gives the segment none)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        eager(x).sum().backward()
    wrapped(x).sum().backward()
    assert [p.grad is None for p in wrapped.parameters()] == [p.grad is None for p in eager.parameters()]
    assert_close(wrapped.module.head.weight.grad, eager.head.weight.grad, "the head's gradient")


class _RandomMask(torch.autograd.Function):
    """Keeps each element with probability 1/2, drawing from torch's generator in forward."""

    @staticmethod
    def forward(ctx, h):
        mask = (torch.rand_like(h) > 0.5).to(h.dtype)
        ctx.save_for_backward(mask)
        return h * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask


class _Masked(nn.Module):
    """Independent calls of a random Function and dropout: each order draws other values."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        h = self.fc(x)
        return _RandomMask.apply(h) - 2 * _RandomMask.apply(h) + 3 * F.dropout(h, 0.5) + _RandomMask.apply(2 * h)


@pytest.mark.parametrize("wrapper", ["OrtModule", "compile"])
def test_functions_and_random_operators_draw_in_eager_order(wrapper):
    """Under one seed, outputs and gradients are eager's (to rounding: ONNX Runtime computes the
    linear layer): each Function call and each random operator runs after the one before it in the
    program (ordering inputs), which ONNX Runtime's own order of independent nodes does not keep
    (run in another order, the output differed by 15)."""
    torch._dynamo.reset()
    eager = _Masked()
    wrapped = (ortbridge.OrtModule if wrapper == "OrtModule" else lambda m: torch.compile(m, backend="ortbridge"))(
        copy.deepcopy(eager)
    )
    x = torch.randn(128, 64)
    for step in range(3):
        outputs = []
        for model in (eager, wrapped):
            torch.manual_seed(step)
            out = model(x)
            out.square().mean().backward()
            outputs.append(out)
        assert_close(outputs[1], outputs[0], f"step {step}: output")  # (other draws: off by ~15)
        with torch.no_grad():
            torch.manual_seed(step)
            expected = eager(x)
            torch.manual_seed(step)
            assert_close(wrapped(x), expected, f"step {step}: output without grad")
    for p, q in zip(eager.parameters(), wrapped.parameters()):
        assert_close(q.grad, p.grad, "a parameter's gradient")


def _tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=99, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config).eval()


def test_generate_with_an_ort_backbone_gives_eagers_tokens_and_refuses_a_kv_cache(captures):
    """A backbone wrapped in an OrtModule generates eager's tokens without a KV cache; with one (a
    DynamicCache, generate's default), the capture refuses it naming the cache and use_cache=False,
    before the forward ran: the caller's cache holds nothing."""
    eager = _tiny_gpt2()
    model = copy.deepcopy(eager)
    model.transformer = ortbridge.OrtModule(model.transformer)
    ids = torch.randint(1, 99, (2, 5))
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(
        generated, eager.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False, pad_token_id=0)
    )
    assert captures() == 4  # (one per length: dynamic shapes are the shapes issue's)
    cache = transformers.DynamicCache()
    with pytest.raises(
        ortbridge.CaptureError, match="DynamicCache, which the forward updates in place.*use_cache=False"
    ):
        model.transformer(ids, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0


def test_generate_of_an_ort_module_runs_it_in_ort_with_eagers_tokens_and_one_capture(captures):
    """OrtModule(model).generate runs each of generate's calls of the model in ONNX Runtime, with
    symbolic sizes: one capture for every length the sequence grows to and every prompt length.
    Greedy and sampled tokens are eager's (eager with its KV cache: the tokens do not depend on it).
    A KV cache asked for is refused before the model runs."""
    eager = _tiny_gpt2()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    for length, sample in ((5, False), (9, False), (7, True)):
        ids = torch.randint(1, 99, (2, length))
        mask = torch.ones_like(ids)
        options = dict(attention_mask=mask, max_new_tokens=6, do_sample=sample, pad_token_id=0)
        torch.manual_seed(length)
        generated = wrapped.generate(ids, **options)
        torch.manual_seed(length)
        expected = eager.generate(ids, **options)
        assert torch.equal(generated, expected), f"prompt length {length}, sampled {sample}"
    assert captures() == 1, "one capture for every length"
    assert wrapped.module._compiled_call_impl is None, "generate leaves the model's call as it was"
    assert_close(wrapped(ids).logits, eager(ids).logits, "a call after generate")
    with pytest.raises(ortbridge.CaptureError, match="DynamicCache.*use_cache=False"):
        wrapped.generate(ids, max_new_tokens=2, use_cache=True, pad_token_id=0)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_trainer_with_gradient_checkpointing_trains_an_ort_module_as_eager(reentrant, tmp_path):
    """Trainer(gradient_checkpointing=True) enables checkpointing on the wrapped model through the
    OrtModule; three steps log eager's losses and leave eager's parameters."""

    def train(wrap):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=99, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        model = wrap(transformers.GPT2LMHeadModel(config))
        generator = torch.Generator().manual_seed(1)
        rows = [torch.randint(0, 99, (14,), generator=generator) for _ in range(8)]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path),
            max_steps=3,
            per_device_train_batch_size=4,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant},
            report_to=[],
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows]
        )
        trainer.train()
        inner = getattr(model, "module", model)
        assert inner.is_gradient_checkpointing
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], list(model.parameters())

    expected_losses, expected = train(lambda m: m)
    losses, parameters = train(ortbridge.OrtModule)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert_close(parameters, expected, "parameters after 3 steps")
