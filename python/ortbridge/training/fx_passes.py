"""The FX side of a capture, before any graph becomes ONNX: the decompositions AOTAutograd's trace
applies (operators torch's ONNX exporter writes wrongly for training, norms of low-precision
inputs computed as torch's CPU kernels compute them), and the rewrite of a traced graph into
forms ONNX Runtime runs fast (tiled_pads_as_cat)."""

from __future__ import annotations

import math

import torch

from .._compat.torch_private import decomposition_table, get_decompositions

aten = torch.ops.aten

# Operators torch's ONNX exporter writes wrongly for training, traced as the operators they are
# made of instead: the total weight that nll_loss_forward gives its backward came out as 1
# (gradients of a mean loss multiplied by the batch size); batch norm in training mode became
# BatchNormalization in inference mode, so it runs in PyTorch (fallback.PYTORCH_PREFERRED: one
# node each way, where its decomposition made ~60 small ONNX nodes per layer). (Likewise
# attention: on the CPU its fused kernel runs in PyTorch, a fallback node each way; elsewhere the
# capture asks for the math kernel, as the fused ones' outputs saved for backward got other
# shapes than torch's in ONNX.)
DECOMPOSITIONS = get_decompositions([aten._native_batch_norm_legit, aten.native_batch_norm, aten.nll_loss_forward])
_batch_norm_backward = decomposition_table[aten.native_batch_norm_backward.default]


def _eval_batch_norm_backward(
    grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
):
    """Batch norm's backward from batch statistics stays one operator (a fallback node); from
    running statistics (eval mode) it is decomposed, reading them rather than the empty batch
    statistics that the exporter writes with other shapes."""
    if train:
        return NotImplemented
    return _batch_norm_backward(
        grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
    )


DECOMPOSITIONS[aten.native_batch_norm_backward.default] = _eval_batch_norm_backward


def _select_backward(grad, input_sizes, dim, index):
    """The gradient of x.select(dim, index) as a Pad of `grad`: ONNX Runtime runs the
    ScatterElements torch's exporter writes for it (q, k, v of attention) many times slower."""
    dim %= len(input_sizes)
    index %= input_sizes[dim]
    pad = [0, 0] * (len(input_sizes) - 1 - dim) + [index, input_sizes[dim] - 1 - index]
    return aten.constant_pad_nd.default(grad.unsqueeze(dim), pad)


DECOMPOSITIONS[aten.select_backward.default] = _select_backward


def _in_float32(op, otherwise=None):
    """A norm `op` (its input first, weights and statistics among its other arguments) of a
    bfloat16 or float16 input on the CPU, run in float32 as torch's kernel computes it, each output
    cast to the type that kernel gives it: the input's; for the saved statistics float32 where
    the weights are (as CPU autocast leaves them), else the input's; for updated running statistics
    theirs. Torch's meta functions give other types there (which the trace, and a fallback node,
    would give), torch's exporter too (float32 statistics of LayerNormalization), and ONNX's
    norms take one type for input and weights. `otherwise`: what runs any other call (a
    decomposition of torch's; None: the operator). (Their backward stays torch's own.)"""

    def norm(x, *args):
        if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
            return NotImplemented if otherwise is None else otherwise(x, *args)
        params = [a for a in args if isinstance(a, torch.Tensor)]
        stats = torch.float32 if any(p.dtype != x.dtype for p in params) else x.dtype
        out, mean, rstd, *running = (otherwise or op)(
            x.float(), *(a.float() if isinstance(a, torch.Tensor) else a for a in args)
        )
        return out.to(x.dtype), mean.to(stats), rstd.to(stats), *(r.to(p.dtype) for r, p in zip(running, params[-2:]))

    return norm


for _op in (
    aten.native_layer_norm.default,
    aten.native_group_norm.default,
    aten._native_batch_norm_legit_functional.default,
    aten._native_batch_norm_legit_no_training.default,
):
    DECOMPOSITIONS[_op] = _in_float32(_op)
_no_stats = aten._native_batch_norm_legit.no_stats  # (instance norm, batch norm without running statistics)
DECOMPOSITIONS[_no_stats] = _in_float32(_no_stats, DECOMPOSITIONS[_no_stats])


def _group_norm_backward_in_float32(grad, x, mean, rstd, weight, *args):
    """Group norm's backward likewise: torch's meta function gives the input's gradient float32
    beside float32 weights, its CPU kernel the input's type."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return NotImplemented
    grads = aten.native_group_norm_backward.default(
        grad.float(), x.float(), mean.float(), rstd.float(), None if weight is None else weight.float(), *args
    )
    dtypes = (x.dtype, *[torch.float32 if weight is None else weight.dtype] * 2)
    return tuple(None if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes))


DECOMPOSITIONS[aten.native_group_norm_backward.default] = _group_norm_backward_in_float32


def _layer_norm_backward_in_float32(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """Layer norm's backward likewise: each gradient in its input's type (torch 2.9's meta function
    gave the weights' gradients the input's type beside float32 weights, its CPU kernel theirs)."""
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return NotImplemented
    grads = aten.native_layer_norm_backward.default(
        grad.float(),
        x.float(),
        normalized_shape,
        mean.float(),
        rstd.float(),
        *(None if w is None else w.float() for w in (weight, bias)),
        output_mask,
    )
    return tuple(None if g is None else g.to(like.dtype) for g, like in zip(grads, (x, weight, bias)))


DECOMPOSITIONS[aten.native_layer_norm_backward.default] = _layer_norm_backward_in_float32


def _as_strided_scatter(base, src, size, stride, storage_offset=None):
    """as_strided_scatter, the gradient of an as_strided view (which AOTAutograd traces for a view
    of a tensor in another memory format: flatten of a channels_last (N, C, 1, 1) pooling output),
    in operators ONNX has: `src` written into `base`'s row-major elements at the view's positions;
    where those are all of them in order, `src` reshaped. (A base of another layout, a view whose
    elements overlap or symbolic sizes stay the operator, which the export refuses.)"""
    offset = storage_offset or 0
    dims = [(n, s) for n, s in zip(size, stride) if n != 1]
    if not base.is_contiguous() or not all(type(v) is int for v in (*size, *stride, offset, *base.shape)):
        return NotImplemented
    extent = 0  # (the elements a view's dims of smaller strides span: each stride must pass it)
    for n, s in sorted(dims, key=lambda d: d[1]):
        if s <= extent:
            return NotImplemented
        extent += (n - 1) * s
    if (
        offset == 0
        and base.numel() == src.numel()
        and all(s == math.prod(n for n, _ in dims[k + 1 :]) for k, (_, s) in enumerate(dims))
    ):
        return src.reshape(base.shape).clone()
    positions = torch.full(tuple(size), offset, dtype=torch.int64, device=base.device)
    for d, (n, s) in enumerate(zip(size, stride)):
        positions = (
            positions + torch.arange(n, device=base.device).reshape([n if k == d else 1 for k in range(len(size))]) * s
        )
    return base.reshape(-1).index_put((positions.reshape(-1),), src.reshape(-1)).reshape(base.shape)


DECOMPOSITIONS[aten.as_strided_scatter.default] = _as_strided_scatter


def tiled_pads_as_cat(gm: torch.fx.GraphModule) -> None:
    """A sum of zero pads whose inputs tile one dim (the gradient of q, k, v = qkv[0], qkv[1],
    qkv[2]: a _select_backward per slot, added) becomes one cat of those inputs: one write of
    the result instead of a padded copy and an add per slot."""
    graph, erased = gm.graph, set()
    for node in reversed(list(graph.nodes)):
        if node in erased or node.target is not aten.add.Tensor or node.kwargs:
            continue
        adds, leaves = _sum_tree(node)
        slots = _tiling_slots(leaves, node.meta["val"].shape) if len(leaves) > 1 else None
        if slots is None:
            continue
        dim, ordered = slots
        with graph.inserting_before(node):
            cat = graph.call_function(aten.cat.default, ([leaf.args[0] for leaf in ordered], dim))
        cat.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(cat)
        for n in (*adds, *leaves):
            if not n.users:
                graph.erase_node(n)
                erased.add(n)
    gm.recompile()


def _sum_tree(node: torch.fx.Node) -> tuple[list, list]:
    """(the add nodes of the sum rooted at `node`; its terms), or no terms where one is a
    scalar: an inner add belongs to the sum when the sum is its only user."""
    adds, leaves, todo = [], [], [node]
    while todo:
        n = todo.pop()
        if n is node or (n.target is aten.add.Tensor and not n.kwargs and len(n.users) == 1):
            if len(n.args) != 2 or not all(isinstance(a, torch.fx.Node) for a in n.args):
                return adds, []  # (a scalar term)
            adds.append(n)
            todo.extend(n.args)
        else:
            leaves.append(n)
    return adds, leaves


def _tiling_slots(leaves: list, shape) -> tuple[int, list] | None:
    """(the dim, the leaves by position) where every leaf is a zero constant_pad_nd of one dim,
    of the sum's shape, and their inputs tile that dim; otherwise None."""
    dims, spans = set(), []
    for leaf in leaves:
        if (
            leaf.target is not aten.constant_pad_nd.default
            or leaf.args[2:] not in ((), (0,), (0.0,))
            or leaf.kwargs
            or leaf.meta["val"].shape != shape
        ):
            return None
        pad, size = leaf.args[1], leaf.args[0].meta["val"].shape
        padded = {len(size) - 1 - k // 2 for k, p in enumerate(pad) if p != 0}
        if len(padded) != 1 or not all(isinstance(p, int) for p in pad):
            return None
        (dim,) = padded
        dims.add(dim)
        before = pad[2 * (len(size) - 1 - dim)]
        spans.append((before, size[dim], leaf))
    if len(dims) != 1:
        return None
    spans.sort(key=lambda span: span[0])
    end = 0
    for before, length, _ in spans:
        if before != end or not isinstance(length, int):
            return None
        end += length
    (dim,) = dims
    return (dim, [leaf for _, _, leaf in spans]) if end == shape[dim] else None
