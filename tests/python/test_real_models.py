"""Real models trained under ortbridge.OrtModule (and torch.compile(backend="ortbridge")) against
an eager deep copy: timm CNNs whose activations are timm's memory-efficient autograd Functions,
a timm ViT, a Hugging Face BERT from a tiny config, activation checkpointing through
torch.utils.checkpoint's reentrant Function. Each model is trained three optimizer steps on the
same inputs (side_by_side.train_side_by_side); after every step outputs, loss, every parameter
gradient (and input gradient) are compared, and parameters and buffers after training. No
weights are loaded: every model is built from its config (pretrained=False), nothing is downloaded.

timm and transformers are test-only dependencies; scripts/setup.sh installs them (see docs/building.md,
"Test dependencies")."""

from __future__ import annotations

import os
import pathlib
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
from side_by_side import tensors_of, train_side_by_side
from tiny_bert import tiny_bert_config
from torch.utils.checkpoint import CheckpointFunction, checkpoint

import ortbridge

with warnings.catch_warnings():
    # timm imports torchvision, whose C extensions are not loaded against CPU torch (docs/building.md, Test dependencies).
    warnings.simplefilter("ignore")
    import timm
    import timm.layers
    import transformers
    from timm.layers import activations_me as me
    from timm.models import checkpoint_seq
    from timm.models.resnet import BasicBlock, ResNet

nn = torch.nn
F = torch.nn.functional


# --- helpers ----------------------------------------------------------------------------------


def _images(batch: int = 8, size: int = 64):
    """batch(step) -> ((images,), {}): images that need a gradient, so the first layer's input
    gradient is compared too. For the CNNs 8x3x64x64, not smaller: at 32x32 their last stages are
    1x1 and batch norm over 2-4 values makes training chaotic (float32 against float64 eager
    differ by 1e2..1e6 times the tolerance after 3 steps); at 8x64x64 well within it."""

    def make(step: int):
        g = torch.Generator().manual_seed(1000 + step)
        return (torch.randn(batch, 3, size, size, generator=g).requires_grad_(),), {}

    return make


def _labels(n: int, classes: int, step: int) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(2000 + step))


def _ce_loss(out, step):
    return F.cross_entropy(out, _labels(out.shape[0], out.shape[-1], step))


def _weighted_sum(out, step):
    """A loss that weighs every element of every float output differently."""
    floats = [o for o in tensors_of(out) if o.is_floating_point() and o.requires_grad]
    return sum((o * torch.cos(torch.arange(o.numel(), dtype=o.dtype) + step).reshape(o.shape)).sum() for o in floats)


def python_op_functions(wrapped: ortbridge.OrtModule) -> set:
    """Registered names of the Functions that the captured graphs run as PythonOp nodes."""
    names = set()
    for captures in wrapped._captures.values():
        for capture in captures:
            for session in capture.sessions:
                for node in session.model.graph.node:
                    if node.op_type == "PythonOp":
                        names.add(next(a.s.decode() for a in node.attribute if a.name == "func_name"))
    return names


def assert_runs_functions(wrapped, *functions):
    names = python_op_functions(wrapped)
    for f in functions:
        assert ortbridge.registry.registered_name(f) in names, f"{f.__qualname__} is no PythonOp in {names}"


def assert_checkpoints_run_as_segments(wrapped):
    """torch's reentrant checkpoints run as the segments they checkpoint: no PythonOp of theirs."""
    names = python_op_functions(wrapped)
    assert ortbridge.registry.qualified_name(CheckpointFunction) not in names, names


def swap_modules(model: nn.Module, mapping: dict) -> nn.Module:
    """Replaces every submodule of a type in `mapping` by an instance of the mapped type."""
    for name, child in list(model.named_children()):
        if type(child) in mapping:
            setattr(model, name, mapping[type(child)]())
        else:
            swap_modules(child, mapping)
    return model


def module_types(model: nn.Module) -> set:
    return {type(m) for m in model.modules()}


# --- timm CNNs with memory-efficient activations (autograd Functions) -------------------------
# With torch's native silu / hardswish / hardsigmoid / mish, timm's get_act_layer never picks the
# *Me variants by name, whatever set_layer_config says: only 'hard_mish' maps to HardMishMe (when
# neither scriptable nor exportable). The others are used when the class is passed as act_layer.


def mobilenetv3_me() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10, act_layer=me.HardSwishMe)
    # The squeeze-excite gates are built from the string 'hard_sigmoid' (nn.Hardsigmoid).
    return swap_modules(model, {nn.Hardsigmoid: me.HardSigmoidMe})


def tinynet_me() -> nn.Module:
    """The smallest EfficientNet (tinynet_e: width 0.51, depth 0.6), SiLU as SwishMe."""
    torch.manual_seed(0)
    return timm.create_model("tinynet_e", pretrained=False, num_classes=10, act_layer=me.SwishMe)


def test_timm_mobilenetv3_with_hard_swish_and_hard_sigmoid_functions():
    model = mobilenetv3_me()
    assert {me.HardSwishMe, me.HardSigmoidMe} <= module_types(model)
    assert nn.Hardswish not in module_types(model) and nn.Hardsigmoid not in module_types(model)
    wrapped = train_side_by_side(model, _images(), _ce_loss, lr=1e-3)
    assert_runs_functions(wrapped, me.HardSwishAutoFn, me.HardSigmoidAutoFn)


def test_timm_efficientnet_with_swish_function():
    model = tinynet_me()
    assert me.SwishMe in module_types(model) and nn.SiLU not in module_types(model)
    # rtol 1e-3 / atol 1e-4: conv_stem's gradient (up to ~60) sums 8x32x32 positions through 16
    # batch norms; float32 eager differs from float64 eager by 4.6x the 1e-4 / 1e-5 tolerance.
    wrapped = train_side_by_side(model, _images(), _ce_loss, lr=1e-3, rtol=1e-3, atol=1e-4)
    assert_runs_functions(wrapped, me.SwishAutoFn)


def test_timm_resnet_with_hard_mish_function_from_the_layer_config():
    """act_layer='hard_mish' resolves to HardMishMe through timm's layer config (not exportable,
    not scriptable: the defaults, set here explicitly)."""
    timm.layers.set_layer_config(scriptable=False, exportable=False, no_jit=True)
    torch.manual_seed(0)
    model = ResNet(
        BasicBlock,
        [1, 1, 1, 1],
        num_classes=10,
        channels=(8, 16, 32, 64),
        stem_width=8,
        act_layer="hard_mish",
        zero_init_last=False,
    )
    assert me.HardMishMe in module_types(model)
    wrapped = train_side_by_side(model, _images(), _ce_loss, lr=1e-3)
    assert_runs_functions(wrapped, me.HardMishAutoFn)


# --- timm ViT ---------------------------------------------------------------------------------


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8, depth=2
    )


def test_timm_vit_trains_every_parameter_patch_embedding_included():
    model = tiny_vit()
    assert all(p.requires_grad for p in model.parameters())
    assert model.patch_embed.proj.weight.requires_grad and model.pos_embed.requires_grad
    train_side_by_side(model, _images(batch=2, size=32), _ce_loss)


def test_timm_vit_with_reentrant_gradient_checkpointing():
    """timm's set_grad_checkpointing runs each block through checkpoint_seq; with reentrant
    checkpoints each is a torch.utils.checkpoint.CheckpointFunction call (run as its segment)."""
    model = tiny_vit()
    model.set_grad_checkpointing(True)
    previous = timm.layers.use_reentrant_ckpt()
    timm.layers.set_reentrant_ckpt(True)
    try:
        wrapped = train_side_by_side(model, _images(batch=2, size=32), _ce_loss)
    finally:
        timm.layers.set_reentrant_ckpt(previous)
    assert_checkpoints_run_as_segments(wrapped)


# --- Hugging Face BERT from a tiny config ------------------------------------------------------


def _bert_batch(labels: bool):
    def make(step: int):
        g = torch.Generator().manual_seed(3000 + step)
        input_ids = torch.randint(1, 99, (3, 9), generator=g)
        attention_mask = torch.ones(3, 9, dtype=torch.int64)
        attention_mask[1, 6:] = 0  # padding at the end of two rows
        attention_mask[2, 4:] = 0
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask)
        if labels:
            kwargs["labels"] = torch.randint(0, 3, (3,), generator=g)
        return (), kwargs

    return make


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_hf_bert_for_sequence_classification_with_attention_mask_and_labels(attn_implementation):
    """Called as users call it: keyword arguments, a ModelOutput back, its .loss trained."""
    torch.manual_seed(0)
    config = tiny_bert_config(num_labels=3, attn_implementation=attn_implementation)
    model = transformers.BertForSequenceClassification(config)
    model.train()
    train_side_by_side(model, _bert_batch(labels=True), lambda out, step: out.loss, optimizer="adamw")


def test_hf_bert_model_tuple_outputs_weighted_loss():
    """BertModel with return_dict=False: sequence output and pooled output, each element of both
    weighted in the loss."""
    torch.manual_seed(0)
    model = transformers.BertModel(tiny_bert_config())
    model.train()

    def batch(step):
        args, kwargs = _bert_batch(labels=False)(step)
        return args, dict(kwargs, return_dict=False)

    train_side_by_side(model, batch, _weighted_sum)


# --- activation checkpointing (torch.utils.checkpoint's reentrant Function) -------------------


class Checkpointed(nn.Module):
    """input projection, a checkpointed block (LayerNorm, Linear, timm's SwishMe Function,
    Linear), head. `how` says how the block reaches checkpoint()."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), me.SwishMe(), nn.Linear(32, 16))
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        if self.how == "bound_method":
            h = h + checkpoint(self.block.forward, h, use_reentrant=True)
        elif self.how == "lambda":
            h = h + checkpoint(lambda t: self.block(t), h, use_reentrant=True)
        elif self.how == "timm_checkpoint_seq":
            h = checkpoint_seq(self.blocks, h, use_reentrant=True)
        return self.head(h)


def _vectors(step: int):
    g = torch.Generator().manual_seed(4000 + step)
    return (torch.randn(6, 8, generator=g).requires_grad_(),), {}


@pytest.mark.parametrize("how", ["bound_method", "lambda", "timm_checkpoint_seq"])
def test_reentrant_checkpoint(how):
    torch.manual_seed(0)
    wrapped = train_side_by_side(Checkpointed(how), _vectors, _weighted_sum)
    assert_checkpoints_run_as_segments(wrapped)


# --- torch.compile(backend="ortbridge") -------------------------------------------------------


def transformer_block(width: int) -> nn.Module:
    """benchmarks/train_step.py's Block: pre-norm attention + MLP whose activation is a Function."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "benchmarks"))
    try:
        from train_step import Block
    finally:
        sys.path.pop(0)
    return Block(width)


def _compile(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="ortbridge")


def test_compile_timm_cnn():
    train_side_by_side(mobilenetv3_me(), _images(), _ce_loss, lr=1e-3, wrap=_compile)


def test_compile_transformer_block():
    torch.manual_seed(0)

    def batch(step):
        g = torch.Generator().manual_seed(5000 + step)
        return (torch.randn(2, 7, 32, generator=g).requires_grad_(),), {}

    train_side_by_side(transformer_block(32), batch, _weighted_sum, wrap=_compile)


def test_ortmodule_transformer_block():
    torch.manual_seed(0)

    def batch(step):
        g = torch.Generator().manual_seed(5000 + step)
        return (torch.randn(2, 7, 32, generator=g).requires_grad_(),), {}

    train_side_by_side(transformer_block(32), batch, _weighted_sum)
