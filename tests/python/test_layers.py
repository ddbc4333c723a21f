"""One layer or operator at a time under ortbridge.OrtModule against eager PyTorch: a table of
(name, module factory, input factory). Each case runs one forward and one backward in both and
compares the outputs (integer ones too), every input gradient, every parameter gradient and the
buffers after (batch-norm running statistics). Sizes are tiny; a module is built after
torch.manual_seed(0), inputs from a seeded generator."""

from __future__ import annotations

import copy

import pytest
import torch
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

import ortbridge
from ortbridge._compat.torch_private import RELEASE

nn = torch.nn
F = torch.nn.functional

RTOL, ATOL = 1e-4, 1e-5


class Fn(nn.Module):
    """A module whose forward is `fn(self, *args)`; keyword arguments become parameters (tensors
    that need a gradient), buffers (other tensors) or submodules."""

    def __init__(self, fn, **members):
        super().__init__()
        self.fn = fn
        for name, value in members.items():
            if isinstance(value, nn.Module):
                setattr(self, name, value)
            elif isinstance(value, torch.Tensor) and value.requires_grad:
                setattr(self, name, nn.Parameter(value.detach()))
            else:
                self.register_buffer(name, value)

    def forward(self, *args):
        return self.fn(self, *args)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape, grad: bool = True, seed: int = 0, scale: float = 1.0):
    """A float input from a seeded generator (distinct values, so no ties in max/sort)."""
    return (scale * torch.randn(*shape, generator=_gen(seed))).requires_grad_(grad)


def ints(high: int, *shape, seed: int = 1):
    return torch.randint(0, high, shape, generator=_gen(seed))


def signs(*shape, seed: int = 2):
    return torch.randint(0, 2, shape, generator=_gen(seed)).float() * 2 - 1


def probs(*shape, seed: int = 3):
    return torch.rand(*shape, generator=_gen(seed))


def inputs(*make):
    """An input factory: each argument is a zero-argument callable or a constant."""
    return lambda: tuple(m() if callable(m) else m for m in make)


def x(*shape, **kw):
    return lambda: rand(*shape, **kw)


def case(name, module, make_inputs, marks=(), **tolerance):
    return pytest.param(module, make_inputs, tolerance, id=name, marks=marks)


# (a clear error, not a result: the test fails where the capture succeeds)
_LSTM_SQUEEZE = pytest.mark.xfail(
    RELEASE < (2, 13),
    strict=True,
    raises=Fail,
    reason="torch 2.9 to 2.12 trace this LSTM with a squeeze of a dim of size 2, which ONNX Runtime's Squeeze "
    "refuses (torch 2.11's own export of it gives h_n a shape of [2, 1, 2, 5], eager [2, 2, 5])",
)


# --- the table --------------------------------------------------------------------------------

CONV = [
    case("conv1d", lambda: nn.Conv1d(3, 4, 3, padding=1), inputs(x(2, 3, 8))),
    case("conv2d_stride_padding", lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), inputs(x(2, 3, 8, 8))),
    case("conv2d_dilation_no_bias", lambda: nn.Conv2d(3, 4, 3, dilation=2, bias=False), inputs(x(2, 3, 8, 8))),
    case("conv2d_padding_same", lambda: nn.Conv2d(3, 4, (3, 3), padding="same"), inputs(x(2, 3, 6, 7))),
    case("conv3d", lambda: nn.Conv3d(2, 3, 3, padding=1), inputs(x(1, 2, 4, 5, 5))),
    case("conv2d_grouped", lambda: nn.Conv2d(4, 6, 3, groups=2), inputs(x(2, 4, 6, 6))),
    case("conv2d_depthwise", lambda: nn.Conv2d(4, 4, 3, groups=4, padding=1), inputs(x(2, 4, 6, 6))),
    case("conv2d_depthwise_multiplier", lambda: nn.Conv2d(3, 6, 3, groups=3, stride=2), inputs(x(2, 3, 7, 7))),
    case(
        "conv_transpose1d",
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
        inputs(x(2, 3, 5)),
    ),
    case("conv_transpose2d", lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1), inputs(x(2, 3, 4, 4))),
    case(
        "conv_transpose2d_grouped_dilated",
        lambda: nn.ConvTranspose2d(4, 6, 2, groups=2, dilation=2),
        inputs(x(1, 4, 3, 3)),
    ),
    case("conv_transpose3d", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), inputs(x(1, 2, 2, 3, 3))),
]

POOL = [
    case("max_pool1d", lambda: nn.MaxPool1d(3, stride=2), inputs(x(2, 3, 9))),
    case("max_pool2d", lambda: nn.MaxPool2d(2), inputs(x(2, 3, 6, 6))),
    case(
        "max_pool2d_padding_ceil_mode",
        lambda: nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        inputs(x(2, 3, 6, 6)),
    ),
    case("max_pool2d_return_indices", lambda: nn.MaxPool2d(2, return_indices=True), inputs(x(1, 2, 4, 4))),
    case("max_pool3d", lambda: nn.MaxPool3d(2), inputs(x(1, 2, 4, 4, 4))),
    case("avg_pool1d", lambda: nn.AvgPool1d(3, stride=2), inputs(x(2, 3, 9))),
    case("avg_pool2d", lambda: nn.AvgPool2d(2), inputs(x(2, 3, 6, 6))),
    case(
        "avg_pool2d_padding_exclude_pad",
        lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
        inputs(x(2, 3, 6, 6)),
    ),
    case("avg_pool3d", lambda: nn.AvgPool3d(2), inputs(x(1, 2, 4, 4, 4))),
    case("adaptive_avg_pool1d", lambda: nn.AdaptiveAvgPool1d(3), inputs(x(2, 3, 7))),
    case("adaptive_avg_pool2d", lambda: nn.AdaptiveAvgPool2d((3, 2)), inputs(x(2, 3, 7, 5))),
    case("adaptive_avg_pool2d_global", lambda: nn.AdaptiveAvgPool2d(1), inputs(x(2, 3, 5, 5))),
    case("adaptive_avg_pool3d", lambda: nn.AdaptiveAvgPool3d(2), inputs(x(1, 2, 5, 4, 3))),
    case("adaptive_max_pool2d", lambda: nn.AdaptiveMaxPool2d(3), inputs(x(2, 3, 7, 5))),
    case("lp_pool2d", lambda: nn.LPPool2d(2, 2), inputs(x(2, 3, 6, 6))),
]

INTERPOLATE = [
    case("upsample_nearest", lambda: nn.Upsample(scale_factor=2, mode="nearest"), inputs(x(1, 2, 3, 4))),
    case(
        "upsample_bilinear_align_corners",
        lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
        inputs(x(1, 2, 3, 4)),
    ),
    case(
        "upsample_bilinear",
        lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
        inputs(x(1, 2, 3, 4)),
    ),
    case(
        "interpolate_bilinear_size",
        lambda: Fn(lambda m, t: F.interpolate(t, size=(7, 5), mode="bilinear")),
        inputs(x(1, 2, 3, 4)),
    ),
    case("upsample_bicubic", lambda: nn.Upsample(scale_factor=2, mode="bicubic"), inputs(x(1, 2, 4, 4))),
    case("upsample_nearest_exact", lambda: nn.Upsample(size=(5, 7), mode="nearest-exact"), inputs(x(1, 2, 3, 4))),
    case("upsample_linear_1d", lambda: nn.Upsample(scale_factor=3, mode="linear"), inputs(x(1, 2, 4))),
    case("upsample_trilinear", lambda: nn.Upsample(scale_factor=2, mode="trilinear"), inputs(x(1, 2, 2, 3, 2))),
    case(
        "interpolate_downsample_area",
        lambda: Fn(lambda m, t: F.interpolate(t, size=(2, 3), mode="area")),
        inputs(x(1, 2, 4, 6)),
    ),
]

EMBEDDING = [
    case(
        "embedding_padding_idx",
        lambda: nn.Embedding(10, 4, padding_idx=0),
        inputs(torch.tensor([[0, 3, 3, 9], [1, 0, 7, 3]])),
    ),
    case("embedding_bag_sum", lambda: nn.EmbeddingBag(10, 4, mode="sum"), inputs(lambda: ints(10, 3, 4))),
    case("embedding_bag_mean", lambda: nn.EmbeddingBag(10, 4, mode="mean"), inputs(lambda: ints(10, 3, 4))),
    case("embedding_bag_max", lambda: nn.EmbeddingBag(10, 4, mode="max"), inputs(lambda: ints(10, 3, 4))),
    case(
        "embedding_bag_offsets_per_sample_weights",
        lambda: nn.EmbeddingBag(10, 4, mode="sum"),
        inputs(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 5]), x(8, seed=5)),
    ),
]

RECURRENT = [
    case(
        "lstm_two_layers",
        lambda: nn.LSTM(4, 5, num_layers=2, batch_first=True),
        inputs(x(2, 3, 4)),
        marks=_LSTM_SQUEEZE,
    ),
    case(
        "lstm_initial_state",
        lambda: nn.LSTM(4, 5),
        inputs(x(3, 2, 4), lambda: (rand(1, 2, 5, seed=6), rand(1, 2, 5, seed=7))),
        marks=_LSTM_SQUEEZE,
    ),
    case("gru_bidirectional", lambda: nn.GRU(4, 5, bidirectional=True, batch_first=True), inputs(x(2, 3, 4))),
    case("rnn_tanh", lambda: nn.RNN(4, 5), inputs(x(3, 2, 4))),
    case("rnn_relu", lambda: nn.RNN(4, 5, nonlinearity="relu", num_layers=2), inputs(x(3, 2, 4))),
]

NORM = [
    case("batch_norm1d_2d_input", lambda: nn.BatchNorm1d(4), inputs(x(6, 4))),
    case("batch_norm1d_3d_input", lambda: nn.BatchNorm1d(4), inputs(x(3, 4, 5))),
    case("batch_norm2d", lambda: nn.BatchNorm2d(3), inputs(x(2, 3, 4, 4))),
    case("batch_norm2d_eval", lambda: nn.BatchNorm2d(3).eval(), inputs(x(2, 3, 4, 4))),
    case("layer_norm", lambda: nn.LayerNorm([4, 5]), inputs(x(2, 3, 4, 5))),
    case("layer_norm_no_affine", lambda: nn.LayerNorm(5, elementwise_affine=False), inputs(x(2, 3, 5))),
    case("group_norm", lambda: nn.GroupNorm(2, 4), inputs(x(2, 4, 3, 3))),
    case("instance_norm2d_affine", lambda: nn.InstanceNorm2d(3, affine=True), inputs(x(2, 3, 4, 4))),
    case(
        "instance_norm2d_track_running_stats",
        lambda: nn.InstanceNorm2d(3, track_running_stats=True),
        inputs(x(2, 3, 4, 4)),
    ),
    case("local_response_norm", lambda: nn.LocalResponseNorm(2), inputs(x(2, 5, 3, 3))),
]

LOSS = [
    case(
        "cross_entropy_label_smoothing_ignore_index",
        lambda: nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=2),
        inputs(x(6, 4), torch.tensor([0, 2, 3, 1, 2, 3])),
    ),
    case(
        "cross_entropy_class_weights_spatial",
        lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 1.5])),
        inputs(x(2, 4, 3), torch.tensor([[0, 1, 3], [2, 2, 1]])),
    ),
    case(
        "cross_entropy_probability_targets",
        lambda: nn.CrossEntropyLoss(),
        inputs(x(3, 4), lambda: probs(3, 4).softmax(1)),
    ),
    case(
        "nll_loss",
        lambda: Fn(lambda m, t, y: F.nll_loss(F.log_softmax(t, 1), y)),
        inputs(x(5, 4), torch.tensor([0, 3, 1, 1, 2])),
    ),
    case("mse_loss", lambda: nn.MSELoss(), inputs(x(3, 4), x(3, 4, grad=False, seed=9))),
    case("l1_loss", lambda: nn.L1Loss(), inputs(x(3, 4), x(3, 4, grad=False, seed=9))),
    case("smooth_l1_loss", lambda: nn.SmoothL1Loss(beta=0.5), inputs(x(3, 4), x(3, 4, grad=False, seed=9))),
    case("huber_loss", lambda: nn.HuberLoss(delta=0.7), inputs(x(3, 4), x(3, 4, grad=False, seed=9))),
    case(
        "bce_loss",
        lambda: Fn(lambda m, t, y: F.binary_cross_entropy(torch.sigmoid(t), y)),
        inputs(x(3, 4), lambda: probs(3, 4)),
    ),
    case(
        "bce_with_logits_pos_weight",
        lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([1.0, 2.0, 0.5, 3.0])),
        inputs(x(3, 4), lambda: probs(3, 4).round()),
    ),
    case(
        "kl_div_batchmean",
        lambda: Fn(lambda m, t, y: F.kl_div(F.log_softmax(t, 1), y, reduction="batchmean")),
        inputs(x(3, 4), lambda: probs(3, 4).softmax(1)),
    ),
    case(
        "kl_div_log_target",
        lambda: nn.KLDivLoss(reduction="sum", log_target=True),
        inputs(
            lambda: F.log_softmax(rand(3, 4, grad=False), 1).requires_grad_(),
            lambda: F.log_softmax(rand(3, 4, grad=False, seed=4), 1),
        ),
    ),
    case(
        "cosine_embedding_loss",
        lambda: nn.CosineEmbeddingLoss(margin=0.1),
        inputs(x(4, 5), x(4, 5, seed=4), lambda: signs(4)),
    ),
    case("margin_ranking_loss", lambda: nn.MarginRankingLoss(margin=0.2), inputs(x(6), x(6, seed=4), lambda: signs(6))),
]


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).triu(1)  # True: not attended


ATTENTION = [
    case(
        "multihead_attention_weights",
        lambda: Fn(lambda m, q: m.attn(q, q, q), attn=nn.MultiheadAttention(8, 2)),
        inputs(x(5, 2, 8)),
    ),
    case(
        "multihead_attention_cross_batch_first",
        lambda: Fn(
            lambda m, q, kv: m.attn(q, kv, kv, need_weights=False)[0],
            attn=nn.MultiheadAttention(8, 2, batch_first=True, kdim=6, vdim=6),
        ),
        inputs(x(2, 4, 8), x(2, 5, 6, seed=4)),
    ),
    case(
        "multihead_attention_key_padding_mask",
        lambda: Fn(
            lambda m, q, pad: m.attn(q, q, q, key_padding_mask=pad)[0],
            attn=nn.MultiheadAttention(8, 2, batch_first=True),
        ),
        inputs(x(2, 5, 8), torch.tensor([[False] * 5, [False, False, False, True, True]])),
    ),
    case(
        "multihead_attention_causal_mask",
        lambda: Fn(
            lambda m, q: m.attn(q, q, q, attn_mask=m.mask, need_weights=False)[0],
            attn=nn.MultiheadAttention(8, 2, batch_first=True),
            mask=_causal(5),
        ),
        inputs(x(2, 5, 8)),
    ),
    case(
        "multihead_attention_float_mask_per_head_weights",
        lambda: Fn(
            lambda m, q: m.attn(q, q, q, attn_mask=m.mask, average_attn_weights=False),
            attn=nn.MultiheadAttention(8, 2, batch_first=True),
            mask=rand(5, 5, grad=False, seed=8),
        ),
        inputs(x(2, 5, 8)),
    ),
    case(
        "sdpa",
        lambda: Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v)),
        inputs(x(2, 2, 5, 4), x(2, 2, 6, 4, seed=4), x(2, 2, 6, 4, seed=5)),
    ),
    case(
        "sdpa_is_causal",
        lambda: Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        inputs(x(2, 2, 5, 4), x(2, 2, 5, 4, seed=4), x(2, 2, 5, 4, seed=5)),
    ),
    case(
        "sdpa_bool_attn_mask",
        lambda: Fn(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        inputs(x(2, 2, 5, 4), x(2, 2, 5, 4, seed=4), x(2, 2, 5, 4, seed=5), lambda: ~_causal(5)),
    ),
    case(
        "sdpa_float_attn_mask_scale",
        lambda: Fn(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)),
        inputs(x(2, 2, 5, 4), x(2, 2, 5, 4, seed=4), x(2, 2, 5, 4, seed=5), x(2, 1, 5, 5, seed=6)),
    ),
]

INDEXING = [
    case("index_select", lambda: Fn(lambda m, t, i: t.index_select(0, i)), inputs(x(5, 3), torch.tensor([4, 0, 4, 2]))),
    case("gather", lambda: Fn(lambda m, t, i: t.gather(1, i)), inputs(x(3, 5), torch.tensor([[0, 4], [1, 1], [3, 2]]))),
    case(
        "scatter_add",
        lambda: Fn(lambda m, t, i, s: t.scatter_add(1, i, s)),
        inputs(x(3, 5), torch.tensor([[0, 4, 0], [1, 1, 2], [3, 2, 3]]), x(3, 3, seed=4)),
    ),
    case(
        "scatter_reduce_amax",
        lambda: Fn(lambda m, t, i, s: t.scatter_reduce(1, i, s, "amax", include_self=False)),
        inputs(x(3, 5), torch.tensor([[0, 4, 0], [1, 1, 2], [3, 2, 3]]), x(3, 3, seed=4)),
    ),
    case(
        "advanced_index_read_repeated",
        lambda: Fn(lambda m, t, i, j: t[i, j]),
        inputs(x(4, 5), torch.tensor([0, 3, 0, 2]), torch.tensor([1, 1, 1, 4])),
    ),
    case(
        "advanced_index_assign",
        lambda: Fn(lambda m, t, i, v: _assign(t, i, v)),
        inputs(x(5, 3), torch.tensor([4, 1]), x(2, 3, seed=4)),
    ),
    case(
        "index_put_accumulate",
        lambda: Fn(lambda m, t, i, v: t.index_put((i,), v, accumulate=True)),
        inputs(x(5, 3), torch.tensor([4, 1, 4]), x(3, 3, seed=4)),
    ),
    case(
        "masked_fill",
        lambda: Fn(lambda m, t, mask: t.masked_fill(mask, -2.0) * t),
        inputs(x(3, 4), lambda: probs(3, 4) > 0.5),
    ),
    case(
        "where",
        lambda: Fn(lambda m, c, a, b: torch.where(c, a, b)),
        inputs(lambda: probs(3, 4) > 0.5, x(3, 4), x(3, 4, seed=4)),
    ),
    case("where_scalar_broadcast", lambda: Fn(lambda m, a: torch.where(a > 0, a, 0.1 * a.sum(0))), inputs(x(3, 4))),
    case("cumsum", lambda: Fn(lambda m, t: t.cumsum(1)), inputs(x(3, 5))),
    case("cumprod", lambda: Fn(lambda m, t: t.cumprod(0)), inputs(x(4, 3))),
    case("sort", lambda: Fn(lambda m, t: t.sort(dim=1, descending=True)), inputs(x(3, 5))),
    case("topk", lambda: Fn(lambda m, t: t.topk(2, dim=-1)), inputs(x(3, 5))),
    case("max_dim", lambda: Fn(lambda m, t: t.max(dim=0)), inputs(x(4, 3))),
    case("pad_constant", lambda: Fn(lambda m, t: F.pad(t, (1, 2, 0, 1), value=0.5)), inputs(x(1, 2, 4, 4))),
    case("pad_reflect", lambda: Fn(lambda m, t: F.pad(t, (1, 2, 2, 1), mode="reflect")), inputs(x(1, 2, 4, 4))),
    case("pad_replicate", lambda: Fn(lambda m, t: F.pad(t, (1, 2, 2, 1), mode="replicate")), inputs(x(1, 2, 4, 4))),
    case("pad_circular", lambda: Fn(lambda m, t: F.pad(t, (1, 2, 2, 1), mode="circular")), inputs(x(1, 2, 4, 4))),
    case("pad_reflect_1d", lambda: Fn(lambda m, t: F.pad(t, (2, 1), mode="reflect")), inputs(x(2, 3, 5))),
    case(
        "pad_replicate_3d",
        lambda: Fn(lambda m, t: F.pad(t, (1, 0, 0, 1, 1, 1), mode="replicate")),
        inputs(x(1, 2, 3, 3, 3)),
    ),
    case("pixel_shuffle", lambda: nn.PixelShuffle(2), inputs(x(1, 8, 3, 3))),
    case("pixel_unshuffle", lambda: nn.PixelUnshuffle(2), inputs(x(1, 2, 4, 6))),
    case("unfold_im2col", lambda: nn.Unfold(kernel_size=2, stride=1, padding=1), inputs(x(2, 3, 4, 4))),
    case("fold_col2im", lambda: nn.Fold(output_size=(4, 5), kernel_size=2), inputs(x(2, 12, 12))),
    case("tensor_unfold", lambda: Fn(lambda m, t: t.unfold(2, 3, 2)), inputs(x(2, 3, 7))),
]


def _assign(t, i, v):
    y = t * 1.0
    y[i] = v
    return y


def _masked_assign(t, mask, v):
    y = t * 1.0
    y[mask] = v
    return y


# Layers a capture cannot trace: an operator whose output shape depends on tensor values, which
# the fake tensors of the trace do not have. The capture names the operator (and the model's line,
# where the forward asks; a mask assignment asks in its backward) and says what to do (train the
# layer inside a torch.autograd.Function; for a mask assignment, torch.where).
CANNOT_CAPTURE = [
    case(
        "ctc_loss",
        lambda: Fn(lambda m, t, y, tl, yl: F.ctc_loss(t.log_softmax(2), y, tl, yl)),
        inputs(x(6, 2, 5), torch.tensor([[1, 2, 2], [3, 4, 0]]), torch.tensor([6, 5]), torch.tensor([3, 2])),
    ),
    case(
        "ctc_loss_int_lengths",
        lambda: Fn(lambda m, t, y, tl, yl: F.ctc_loss(t.log_softmax(2), y, tl, yl)),
        inputs(x(6, 2, 5), torch.tensor([[1, 2, 2], [3, 4, 0]]), (6, 5), (3, 2)),
    ),
    case(
        "boolean_mask_assign",
        lambda: Fn(lambda m, t, mask, v: _masked_assign(t, mask, v)),
        inputs(x(3, 4), lambda: probs(3, 4) > 0.5, x(1, seed=4)),
    ),
]

TABLE = CONV + POOL + INTERPOLATE + EMBEDDING + RECURRENT + NORM + LOSS + ATTENTION + INDEXING


# --- the test ---------------------------------------------------------------------------------


def _leaves(out) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _loss(out) -> torch.Tensor:
    """Weighs every element of every float output that needs a gradient differently."""
    floats = [o for o in _leaves(out) if o.is_floating_point() and o.requires_grad]
    assert floats, "the case has no output that needs a gradient"
    return sum((o * torch.cos(torch.arange(o.numel(), dtype=o.dtype)).reshape(o.shape)).sum() for o in floats)


def _close(actual, expected, what: str, rtol: float, atol: float):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{list(actual.shape)}, eager {expected.dtype}{list(expected.shape)}"
    )
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("make_module, make_inputs, tolerance", TABLE)
def test_layer_forward_and_backward_like_eager(make_module, make_inputs, tolerance):
    rtol, atol = tolerance.get("rtol", RTOL), tolerance.get("atol", ATOL)
    torch.manual_seed(0)
    eager = make_module()
    wrapped = ortbridge.OrtModule(copy.deepcopy(eager))
    args = make_inputs()
    in_e = copy.deepcopy(args)
    in_w = copy.deepcopy(args)

    versions_e = [t._version for t in _leaves(in_e)]
    versions_w = [t._version for t in _leaves(in_w)]
    out_e = eager(*in_e)
    out_w = wrapped(*in_w)
    bumps_e = [t._version - v for t, v in zip(_leaves(in_e), versions_e)]
    bumps_w = [t._version - v for t, v in zip(_leaves(in_w), versions_w)]
    leaves_e, leaves_w = _leaves(out_e), _leaves(out_w)
    assert len(leaves_w) == len(leaves_e), f"{len(leaves_w)} outputs, eager {len(leaves_e)}"
    for k, (a, e) in enumerate(zip(leaves_w, leaves_e)):
        _close(a, e, f"output {k}", rtol, atol)

    _loss(out_e).backward()
    _loss(out_w).backward()
    assert ortbridge.context_pool_size() == 0, "contexts left after backward"

    for k, (a, e) in enumerate(zip(_leaves(in_w), _leaves(in_e))):
        if e.requires_grad:
            assert a.grad is not None, f"input {k} has no gradient"
            _close(a.grad, e.grad, f"input {k} gradient", rtol, atol)
    for (name, p), q in zip(eager.named_parameters(), wrapped.module.parameters()):
        assert (q.grad is None) == (p.grad is None), f"{name}.grad is {q.grad}, eager {p.grad}"
        if p.grad is not None:
            _close(q.grad, p.grad, f"{name}.grad", rtol, atol)
    for (name, b), c in zip(eager.named_buffers(), wrapped.module.buffers()):
        _close(c, b, f"buffer {name}", rtol, atol)
    # Last, so that the comparisons above run first: the module writes to no input (as in eager);
    # a version bump alone breaks the backward of any other graph that saved that input.
    assert bumps_w == bumps_e, f"inputs' version counters moved by {bumps_w}, in eager by {bumps_e}"


@pytest.mark.parametrize("make_module, make_inputs, tolerance", CANNOT_CAPTURE)
def test_layer_whose_output_shape_depends_on_values_is_refused_naming_the_operator(make_module, make_inputs, tolerance):
    wrapped = ortbridge.OrtModule(make_module())
    with pytest.raises(
        RuntimeError,
        match=r"operator aten\.(_ctc_loss|nonzero)\.\w+ (at .*test_layers.py:\d+ .*)?"
        r"needs a value.*torch.autograd.Function",
    ):
        wrapped(*make_inputs())
    assert ortbridge.context_pool_size() == 0
