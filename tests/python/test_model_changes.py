"""What training scripts do to a model between calls, on OrtModule and torch.compile(backend=
"ortbridge") side by side with eager PyTorch: each change is one row of CHANGES. After the change,
outputs (with their dtypes), gradients of parameters and inputs, and buffers equal eager's, or
the call is refused with the error the row names. Never a silent difference."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import pickle
import subprocess
import sys
import types
import warnings
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from conftest import needs_bfloat16_binding
from side_by_side import assert_close, tensors_of

import ortbridge

nn = torch.nn


class Block(nn.Module):
    """Conv -> BatchNorm -> Linear: train/eval and running statistics matter."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).flatten(1))


class Tokens(nn.Module):
    """Embedding -> Linear: integer inputs, so its dtype can change without changing them."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50)

    def forward(self, ids):
        return self.head(self.embed(ids))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Configured(nn.Module):
    """Reads plain values of its own and of a config object it holds, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.config = types.SimpleNamespace(scale=1.0, act="relu")
        self.shape = [3, 2, 2]
        self.dtype = torch.float32

    def forward(self, x):
        y = self.fc(x) * self.config.scale
        y = torch.relu(y) if self.config.act == "relu" else torch.tanh(y)
        return y.reshape(self.shape).to(self.dtype)


def image():
    return (torch.randn(2, 3, 8, 8, requires_grad=True),)


def ids():
    return (torch.randint(0, 50, (4, 6)),)


def vector():
    return (torch.randn(3, 8, requires_grad=True),)


class Change(NamedTuple):
    """`change(model)` between the first and second call (on eager's and the wrapped one; with
    `replaces`, what it returns is called instead: a copy), the second call inside `during` (a context
    manager factory), the first inside `first`. `refused`: the error OrtModule gives instead
    (a regex of CaptureError's message); `compile_refused` likewise for torch.compile."""

    model: Callable
    inputs: Callable
    change: Callable = lambda m: None
    during: Callable = contextlib.nullcontext
    first: Callable = contextlib.nullcontext
    prepare: Callable = lambda m: None  # (before the wrapper is made)
    refused: str | None = None
    compile_refused: str | None = None
    rtol: float = 1e-4
    replaces: bool = False


def _set(attr: str, value):
    def change(m):
        setattr(m, attr, value)

    return change


def _hook(kind: str, **kwargs):
    def change(m):
        getattr(m.fc1, f"register_{kind}")(lambda *args: None, **kwargs)

    return change


def _hooked_then_removed(m):
    m.fc1.register_forward_hook(lambda *args: None).remove()


def _freeze(m):
    for p in m.fc1.parameters():
        p.requires_grad_(False)


def _resize(m):
    g = torch.Generator().manual_seed(1)  # (fc2 keeps its parameter objects, with other sizes)
    m.fc2.weight.data = torch.randn(6, 16, generator=g)
    m.fc2.bias.data = torch.randn(6, generator=g)


def _reload(m):
    torch.manual_seed(1)  # (a compiled module's own names have a prefix: its module's are loaded)
    getattr(m, "_orig_mod", m).load_state_dict(Block().state_dict())


CHANGES = {
    "double": Change(Tokens, ids, lambda m: m.double()),
    "half": Change(Tokens, ids, lambda m: m.half(), rtol=1e-2),
    "bfloat16": Change(Tokens, ids, lambda m: m.to(torch.bfloat16), rtol=2e-2),
    "autocast on": Change(Mlp, vector, during=lambda: torch.autocast("cpu", torch.float16), rtol=1e-2),
    "autocast off": Change(Mlp, vector, first=lambda: torch.autocast("cpu", torch.float16), rtol=1e-2),
    "autocast bfloat16": Change(Mlp, vector, during=lambda: torch.autocast("cpu", torch.bfloat16), rtol=2e-2),
    "submodule eval": Change(Block, image, lambda m: m.bn.eval()),
    "model eval": Change(Block, image, lambda m: m.eval()),
    "eval then train": Change(Block, image, lambda m: m.bn.train(), prepare=lambda m: m.bn.eval()),
    "frozen layer": Change(Mlp, vector, _freeze),
    "no_grad": Change(Mlp, vector, during=torch.no_grad),
    "deterministic": Change(Mlp, vector, during=lambda: _deterministic()),
    "parameter resized": Change(Mlp, vector, _resize),
    "weights loaded": Change(Block, image, _reload),
    "deepcopy": Change(Block, image, copy.deepcopy, replaces=True),
    "pickle": Change(Block, image, lambda m: pickle.loads(pickle.dumps(m)), replaces=True),
    "torch.save": Change(Block, image, lambda m: _saved_and_loaded(m), replaces=True),
    "forward hook": Change(Mlp, vector, _hook("forward_hook"), refused="submodule 'fc1' .* has a forward hook"),
    "forward hook with kwargs": Change(
        Mlp, vector, _hook("forward_hook", with_kwargs=True), refused="has a forward hook"
    ),
    "forward pre-hook": Change(Mlp, vector, _hook("forward_pre_hook"), refused="has a forward pre hook"),
    "backward hook": Change(Mlp, vector, _hook("full_backward_hook"), refused="has a backward hook"),
    "hook removed": Change(Mlp, vector, _hooked_then_removed),
    "parameter hook": Change(Mlp, vector, lambda m: m.fc1.weight.register_hook(lambda g: g * 2)),
    "weight_norm": Change(Mlp, vector, lambda m: nn.utils.weight_norm(m.fc1)),
    "attribute set": Change(Mlp, vector, _set("scale", 3.0)),
    # (torch.compile: dynamo makes a float that changed an input of its graph, whose .item() a capture cannot trace)
    "config value": Change(
        Configured, vector, lambda m: setattr(m.config, "scale", 2.0), compile_refused="needs a value"
    ),
    "config string": Change(Configured, vector, lambda m: setattr(m.config, "act", "tanh")),
    "list attribute in place": Change(Configured, vector, lambda m: m.shape.__setitem__(0, 1) or m.shape.insert(0, 3)),
    "dtype attribute": Change(Configured, vector, _set("dtype", torch.float64)),
}


def _deterministic():
    @contextlib.contextmanager
    def context():
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(False)

    return context()


def _saved_and_loaded(m):
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _call(model, inputs, context):
    with context():
        out = model(*inputs)
    floats = [o for o in tensors_of(out) if o.requires_grad]
    if floats:
        sum((o.float() * (1 + torch.arange(o.numel()).reshape(o.shape))).sum() for o in floats).backward()
    return out


def _state(model, inputs) -> list:
    """Gradients of parameters and inputs, parameters and buffers."""
    inner = getattr(model, "module", getattr(model, "_orig_mod", model))
    return [*(p.grad for p in inner.parameters()), *(x.grad for x in inputs), *inner.parameters(), *inner.buffers()]


WRAPPERS = {"OrtModule": ortbridge.OrtModule, "compile": lambda m: torch.compile(m, backend="ortbridge")}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=needs_bfloat16_binding) if "bfloat16" in n else n for n in CHANGES]
)
def test_a_change_between_calls_gives_eagers_result_or_a_named_error(name, wrapper):
    row = CHANGES[name]
    torch._dynamo.reset()  # (dynamo keeps what it saw change per code object: each row starts afresh)
    torch.manual_seed(0)
    eager = row.model()
    row.prepare(eager)
    ours = WRAPPERS[wrapper](copy.deepcopy(eager))
    inputs = row.inputs()
    theirs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    tolerance = dict(rtol=row.rtol, atol=row.rtol)
    assert_close(_call(ours, theirs, row.first), _call(eager, inputs, row.first), f"{name}: first call", **tolerance)
    assert_close(_state(ours, theirs), _state(eager, inputs), f"{name}: after the first call", **tolerance)
    for m in (eager, ours):
        m.zero_grad()
    changed = [row.change(m) for m in (eager, ours)]
    if row.replaces:
        eager, ours = changed
    inputs = row.inputs()
    theirs = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    refused = row.refused if wrapper == "OrtModule" else row.compile_refused
    if refused:
        with pytest.raises(ortbridge.CaptureError, match=refused):
            _call(ours, theirs, row.during)
        return
    expected = _call(eager, inputs, row.during)
    assert_close(_call(ours, theirs, row.during), expected, f"{name}: second call", **tolerance)
    assert_close(_state(ours, theirs), _state(eager, inputs), f"{name}: after the second call", **tolerance)


# --- Hooks on the OrtModule itself; Python state a forward changes ---------------------------------


def test_hooks_on_the_ort_module_run_on_every_call_with_real_tensors():
    seen = []
    wrapped = ortbridge.OrtModule(Mlp())
    wrapped.register_forward_pre_hook(lambda m, args: seen.append(("pre", type(args[0]))))
    wrapped.register_forward_hook(lambda m, args, out: seen.append(("post", type(out))))
    for _ in range(3):
        wrapped(*vector())
    assert seen == [("pre", torch.Tensor), ("post", torch.Tensor)] * 3


class Counting(Mlp):
    def __init__(self):
        super().__init__()
        self.fc1.calls = 0

    def forward(self, x):
        self.fc1.calls += 1
        return super().forward(x)


class Appending(Mlp):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(len(self.seen))
        return super().forward(x) * len(self.seen)


def test_a_forward_that_changes_a_list_in_place_is_refused_and_the_list_put_back():
    model = Appending()
    with pytest.raises(ortbridge.CaptureError, match=r"changes its Python attribute seen \(\[\] -> \[0\]\)"):
        ortbridge.OrtModule(model)(*vector())
    assert model.seen == []


class LazilySet(Mlp):
    """Sets an attribute at its first call, as transformers' output capturing does; or counts
    calls from an attribute it sets at the first (`counts`)."""

    def __init__(self, counts: bool):
        super().__init__()
        self.counts = counts

    def forward(self, x):
        if self.counts:
            self.calls = getattr(self, "calls", 0) + 1
        elif not hasattr(self, "ready"):
            self.ready = True
        return super().forward(x)


def test_an_attribute_a_forward_sets_once_is_lazy_initialization_one_it_keeps_changing_is_refused():
    torch.manual_seed(0)
    eager = LazilySet(counts=False)
    ours = ortbridge.OrtModule(copy.deepcopy(eager))
    for step in range(2):
        x = torch.randn(3, 8)
        assert_close(ours(x), eager(x), f"call {step}")
    assert ours.module.ready is True
    counting = LazilySet(counts=True)
    with pytest.raises(ortbridge.CaptureError, match=r"changes its Python attribute calls \(1 -> "):
        ortbridge.OrtModule(counting)(*vector())
    assert counting.calls == 1  # (as the eager record run left it)


def test_a_hugging_face_model_whose_config_asks_for_hidden_states_after_the_first_call():
    """transformers collects hidden states with forward hooks it installs at the first call that
    asks for them (and marks the model with an attribute): both are traced, the states returned."""
    transformers = pytest.importorskip("transformers", reason="the model is transformers'")
    config = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=3
    )
    torch.manual_seed(0)
    eager = transformers.BertForSequenceClassification(config)
    ours = ortbridge.OrtModule(copy.deepcopy(eager))
    ids, mask = torch.randint(0, 100, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    for hidden_states in (False, True, True, False):
        for m in (eager, ours):
            m.config.output_hidden_states = hidden_states
        torch.manual_seed(1)
        expected = eager(input_ids=ids, attention_mask=mask)
        torch.manual_seed(1)
        out = ours(input_ids=ids, attention_mask=mask)
        assert (out.hidden_states is None) == (not hidden_states)
        assert_close(_tensors_in(out), _tensors_in(expected), f"output_hidden_states={hidden_states}")


def test_an_attribute_value_changing_on_every_call_keeps_a_bounded_number_of_captures():
    torch.manual_seed(0)
    eager = Configured()
    ours = ortbridge.OrtModule(copy.deepcopy(eager))
    x = torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10):
            for m in (eager, ours):
                m.config.scale = 1.0 + step
            assert_close(ours(x), eager(x), f"step {step}")
    assert sum(map(len, ours._captures.values())) == 8
    assert any("captured Configured 8 times for one signature" in str(w.message) for w in caught)


def test_pickling_an_ort_module_with_session_options_is_refused_and_deepcopy_shares_them():
    import onnxruntime

    options = onnxruntime.SessionOptions()
    wrapped = ortbridge.OrtModule(Mlp(), session_options=options)
    wrapped(*vector())
    with pytest.raises(TypeError, match="an OrtModule with session_options cannot be pickled"):
        pickle.dumps(wrapped)
    copied = copy.deepcopy(wrapped)
    assert copied.options["session_options"] is options
    x = torch.randn(3, 8)
    assert_close(copied(x), wrapped(x), "the copy")


def test_a_forward_that_changes_python_state_is_refused_naming_it_and_leaves_it_as_it_was():
    model = Counting()
    with pytest.raises(ortbridge.CaptureError, match=r"changes its Python attribute fc1\.calls \(0 -> 1\)"):
        ortbridge.OrtModule(model)(*vector())
    assert model.fc1.calls == 0
    assert torch.compile(model, backend="ortbridge")(*vector()).shape == (3, 4)  # (dynamo runs that Python)
    assert model.fc1.calls == 1


def test_a_multi_layer_rnn_with_dropout_is_refused_where_torchs_trace_leaves_the_dropout_out():
    lstm = nn.LSTM(4, 5, num_layers=2, dropout=0.3)
    x = torch.randn(3, 2, 4, requires_grad=True)
    with pytest.raises(
        ortbridge.CaptureError,
        match=r"submodule '' \(LSTM, 2 layers, dropout=0.3\) would train "
        r"without its dropout between layers",
    ):
        ortbridge.OrtModule(lstm)(x)


# --- Structured outputs and arguments --------------------------------------------------------------


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple
    note: str = "plain"


@dataclasses.dataclass(frozen=True)
class FrozenOutput:
    logits: torch.Tensor


class Pair(NamedTuple):
    logits: torch.Tensor
    hidden: torch.Tensor


try:  # (imported here: transformers registers its outputs with pytree unless imported while compiling)
    from transformers.modeling_outputs import BaseModelOutput
except ImportError:
    BaseModelOutput = None


def _model_output(logits, hidden):
    return BaseModelOutput(last_hidden_state=logits, hidden_states=(hidden,))


STRUCTURES = {
    "dataclass": lambda y, h: Output(y, (h, h * 2)),
    "frozen dataclass": lambda y, h: FrozenOutput(y + h.sum()),
    "namedtuple": Pair,
    "nested containers": lambda y, h: {"out": [y, (h, {"deep": h + 1})], "n": 3},
    "ModelOutput": _model_output,
}


class Structured(Mlp):
    def __init__(self, structure):
        super().__init__()
        self.structure = structure

    def forward(self, x):
        hidden = torch.relu(self.fc1(x))
        return self.structure(self.fc2(hidden), hidden)


def _tensors_in(x) -> list:
    """The tensors in x, walked without pytree (which ortbridge may have taught a dataclass)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in _tensors_in(getattr(x, f.name))]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors_in(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors_in(v)]
    return []


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("structure", STRUCTURES)
def test_structured_outputs_come_back_as_eager_returns_them(structure, wrapper):
    if structure == "ModelOutput" and BaseModelOutput is None:
        pytest.skip("transformers is not installed (ModelOutput is its)")
    torch.manual_seed(0)
    eager = Structured(STRUCTURES[structure])
    ours = WRAPPERS[wrapper](copy.deepcopy(eager))
    for _ in range(2):
        x = torch.randn(3, 8)
        out, expected = _call(ours, (x,), contextlib.nullcontext), _call(eager, (x,), contextlib.nullcontext)
        assert type(out) is type(expected)
        got, want = _tensors_in(out), _tensors_in(expected)
        assert len(got) == len(want) > 0 and all(type(t) is torch.Tensor for t in got), "trace tensors came back"
        assert_close(got, want, structure)
        assert_close(_state(ours, ()), _state(eager, ()), f"{structure}: gradients")
        if dataclasses.is_dataclass(expected):
            assert out.__dict__.keys() == expected.__dict__.keys() and getattr(out, "note", 0) == getattr(
                expected, "note", 0
            )


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float


class TakesBatch(Mlp):
    def forward(self, batch: Batch):
        return super().forward(batch.x) * batch.scale


def test_a_dataclass_argument_is_its_fields_not_a_constant():
    """Its tensors are arguments of one capture; its other fields part of the signature."""
    torch.manual_seed(0)
    eager = TakesBatch()
    ours = ortbridge.OrtModule(copy.deepcopy(eager))
    for step, scale in enumerate((1.0, 1.0, 1.0, 2.0)):
        batch = Batch(torch.randn(3, 8), scale)
        assert_close(ours(batch), eager(batch), f"call {step}")
    assert sum(map(len, ours._captures.values())) == 2  # (one per scale)


# --- Nesting, export --------------------------------------------------------------------------------


def _parent(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(collections.OrderedDict(body=ortbridge.OrtModule(Mlp()), head=nn.Linear(4, 2)))


def test_a_nested_ort_modules_state_dict_loads_back():
    source, target = _parent(0), _parent(1)
    state = source.state_dict()
    assert "body.fc1.weight" in state  # (OrtModule's names: the wrapped module's)
    loaded = target.load_state_dict(state)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    target.body(*vector())  # (used, then loaded again: still the wrapped module's tensors, updated)
    target.load_state_dict(_parent(2).state_dict())
    torch.testing.assert_close(target.body.fc1.weight, _parent(2).body.fc1.weight)


def test_export_of_an_ort_module_exports_the_module_it_wraps(tmp_path):
    torch.manual_seed(0)
    model = Mlp()
    wrapped = ortbridge.OrtModule(model)
    x = torch.randn(3, 8)
    wrapped(x)  # (used: it holds captures)
    ortbridge.export(wrapped, (x,), tmp_path / "wrapped.onnx")
    session = ortbridge.InferenceSession(str(tmp_path / "wrapped.onnx"))
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), model(x).detach())


# --- The eager record run and the trace agree ------------------------------------------------------


class WritesItsDict(torch.autograd.Function):
    """As fairscale's checkpoint_wrapper: forward tells its caller through a dict argument."""

    @staticmethod
    def forward(ctx, notes: dict, x):
        notes["output_requires_grad"] = x.requires_grad
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return None, grad * 2


class ReadsTheDict(Mlp):
    def forward(self, x):
        notes = {}
        y = WritesItsDict.apply(notes, self.fc1(x))
        return self.fc2(y) * (3 if notes["output_requires_grad"] else 1)


class PutsATensorInItsDict(WritesItsDict):
    @staticmethod
    def forward(ctx, notes: dict, x):
        notes["y"] = x + 1
        return x * 2


class ReadsATensorFromTheDict(Mlp):
    def forward(self, x):
        notes = {}
        return PutsATensorInItsDict.apply(notes, self.fc1(x)) + notes["y"]


class KorniaLike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.log_softmax(-1)

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("the eager branch is the Function's; the exported one is log_softmax")


class BranchesOnExporting(Mlp):
    def forward(self, x):
        y = self.fc2(self.fc1(x))
        return y.log_softmax(-1) if torch.compiler.is_exporting() else KorniaLike.apply(y)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_what_a_function_writes_into_its_dict_argument_reaches_its_caller(wrapper):
    torch.manual_seed(0)
    eager = ReadsTheDict()
    ours = WRAPPERS[wrapper](copy.deepcopy(eager))
    x = torch.randn(3, 8, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    assert_close(_call(ours, (y,), contextlib.nullcontext), _call(eager, (x,), contextlib.nullcontext), "output")
    assert_close(_state(ours, (y,)), _state(eager, (x,)), "gradients")


def test_a_function_putting_a_tensor_into_its_dict_argument_is_refused():
    with pytest.raises(
        ortbridge.ExportError,
        match=r"PutsATensorInItsDict.forward put a tensor into its argument "
        r"0 \(a dict\)",
    ):
        ortbridge.OrtModule(ReadsATensorFromTheDict())(*vector())


def test_library_code_branching_on_exporting_takes_one_branch_in_the_record_run_and_the_trace():
    torch.manual_seed(0)
    model = BranchesOnExporting()
    x = torch.randn(3, 8)
    out = ortbridge.OrtModule(model)(x)
    torch.testing.assert_close(out, model.fc2(model.fc1(x)).log_softmax(-1))
    out.sum().backward()  # (log_softmax's gradient: KorniaLike's backward would raise)


# --- Copies at exit -----------------------------------------------------------------------------


def test_a_used_ort_module_copied_or_changed_in_dtype_leaves_a_process_that_exits_cleanly():
    script = (
        "import copy, torch, ortbridge\n"
        "m = ortbridge.OrtModule(torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)))\n"
        "x = torch.randint(0, 50, (4, 8)); m(x)\n"
        "c = copy.deepcopy(m); c(x); m.half(); m(x); m.double(); m(x)\n"
        "print('done')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-3000:]
