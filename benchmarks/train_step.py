"""Training-step time of two small models with a custom Function, a transformer block and a
mobilenet-like CNN: OrtModule and torch.compile(backend="ortbridge") against eager PyTorch.

What is measured
----------------
One step = forward, loss, backward, AdamW step, zero_grad. Two models, each at two sizes:
  Block  a pre-norm transformer block (LayerNorm, 4-head self-attention, LayerNorm, MLP) whose
         MLP activation is a custom autograd.Function (bias + GeLU, hand-written backward);
         mean-squared loss against a random target. Size: batch x seq x width.
  CNN    a mobilenet-like network: a stride-2 3x3 stem conv (3 -> 16) + BatchNorm + activation,
         four inverted-residual blocks (1x1 expand conv, BN, act, depthwise 3x3 conv, two of
         them stride 2, BN, act, squeeze-excite with a hard-sigmoid in two of them, 1x1 project
         conv, BN, residual where the shapes match), global average pool, Linear to 10 classes.
         Its activation is a custom autograd.Function, HardSwishMe (as timm's memory-efficient
         activations: forward x * relu6(x + 3) / 6 saving only x, hand-written backward from x);
         BatchNorm in training mode (batch statistics, running stats updated). Cross-entropy
         loss on random labels. Size: batch x channels x height x width.
--timm adds third-party models as users bring them (timm's, untrained, batch 8): mobilenetv3_small_050
with HardSwishMe and HardSigmoidMe, tinynet_e with SwishMe, resnet10t with HardMishMe (64 x 64
images) and vit_tiny_patch16_224 with SwishMe (32 x 32 images, patch 8), each activation one of
timm's memory-efficient autograd.Functions.
Three copies of the same model, trained on the same batch:
  eager     plain PyTorch
  OrtModule ortbridge.OrtModule: ONNX Runtime runs the forward and backward graphs, the
            Function runs in PyTorch as a PythonOp / PythonOpGrad pair (and so do operators
            torch's ONNX exporter cannot write, such as the CNN's aten::convolution_backward)
  compile   torch.compile(model, backend="ortbridge"): dynamo captures the graph (it inlines these
            traceable Functions, so ONNX Runtime runs their operators), ONNX Runtime runs it
Before timing, each wrapped copy must give eager's loss at the first step (graphs are captured
then, outside the timing). The table gives the median step time over --repeats repeats and the
ratio to eager from the same run (lower is better; 1.0 = as fast as eager). ONNX Runtime and
torch use their default thread counts (torch's; OrtModule gives ONNX Runtime as many), or
--threads for both; --ort-threads for ONNX Runtime alone. --in-pytorch convolution,... adds a
fourth copy, OrtModule with those aten operators (their .default overloads) run in PyTorch as
fallback nodes, as fallback.PYTORCH_PREFERRED has training batch norm run: the A/B, in the same
run, for choosing a fallback by measurement. On a machine whose cores are busy with other work,
use --threads 1: a parallel region waits for each of its threads to be scheduled, which can
make steps many times slower than on an idle machine.
--bf16 model trains every copy in bfloat16 (model and inputs); --bf16 autocast runs each copy's
forward and loss under torch.autocast(bfloat16) on float32 weights (eager's too). ONNX Runtime's CPU
provider has few bfloat16 kernels (no Gemm, MatMul, Conv, Add...): the operators it has none for run
in PyTorch as fallback nodes. The first-step check is then within bfloat16's precision.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from common import medians, versions

import ortbridge
from ortbridge._tracing import fallback

F = torch.nn.functional


class BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return F.gelu(x + bias)

    @staticmethod
    def backward(ctx, g):
        x, bias = ctx.saved_tensors
        y = x + bias
        cdf = 0.5 * (1 + torch.erf(y * 0.7071067811865476))
        pdf = torch.exp(-0.5 * y * y) * 0.3989422804014327
        gy = g * (cdf + y * pdf)
        # (each gradient in its input's dtype: under autocast x is bfloat16 and the bias float32;
        # eager's autograd would cast, a PythonOpGrad node does not)
        return gy.to(x.dtype), gy.reshape(-1, gy.shape[-1]).sum(0).to(bias.dtype)


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int = 4):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(4 * width))
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.down(BiasGelu.apply(self.up(self.norm2(x)), self.bias))


class HardSwishMe(torch.autograd.Function):
    """Hard-swish that saves only its input (timm's memory-efficient activation)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * (x + 3).clamp(min=0, max=6).div(6)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        m = torch.where((x >= -3) & (x <= 3), x / 3 + 0.5, (x > 3).to(x.dtype))
        return g * m


class HardSwish(torch.nn.Module):
    def forward(self, x):
        return HardSwishMe.apply(x)


def conv_bn(cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act: bool = True):
    layers = [
        torch.nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        torch.nn.BatchNorm2d(cout),
    ]
    return torch.nn.Sequential(*layers, HardSwish()) if act else torch.nn.Sequential(*layers)


class SqueezeExcite(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.reduce = torch.nn.Conv2d(channels, channels // 4, 1)
        self.expand = torch.nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x):
        s = F.relu(self.reduce(x.mean((2, 3), keepdim=True)))
        return x * F.hardsigmoid(self.expand(s))


class InvertedResidual(torch.nn.Module):
    def __init__(self, cin: int, expanded: int, cout: int, stride: int, se: bool):
        super().__init__()
        self.expand = conv_bn(cin, expanded)
        self.depthwise = conv_bn(expanded, expanded, 3, stride, groups=expanded)
        self.se = SqueezeExcite(expanded) if se else torch.nn.Identity()
        self.project = conv_bn(expanded, cout, act=False)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class CNN(torch.nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2)
        self.blocks = torch.nn.Sequential(
            InvertedResidual(16, 64, 16, 1, False),
            InvertedResidual(16, 64, 24, 2, True),
            InvertedResidual(24, 96, 24, 1, True),
            InvertedResidual(24, 96, 40, 2, False),
        )
        self.head = torch.nn.Linear(40, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def block_case(batch: int, seq: int, width: int):
    return (
        Block(width),
        torch.randn(batch, seq, width),
        torch.randn(batch, seq, width),
        F.mse_loss,
        f"{batch} x {seq} x {width}",
    )


def cnn_case(batch: int, side: int):
    return (
        CNN(),
        torch.randn(batch, 3, side, side),
        torch.randint(0, 10, (batch,)),
        F.cross_entropy,
        f"{batch} x 3 x {side} x {side}",
    )


def timm_cases() -> list:
    """Third-party models as users bring them (--timm): timm's models built untrained, each with
    timm's memory-efficient activations, which are autograd.Functions (PythonOp / PythonOpGrad
    pairs), 10 classes, cross-entropy, batch 8 of 3 x 64 x 64 images (the ViT: 32 x 32, patch 8)."""
    import warnings

    with warnings.catch_warnings():  # (timm imports torchvision, whose C extension is not loaded; docs/building.md)
        warnings.simplefilter("ignore")
        import timm
        from timm.layers import activations_me as me

    def hard_sigmoid_me(model: torch.nn.Module) -> torch.nn.Module:
        for name, child in model.named_children():  # (squeeze-excite gates: nn.Hardsigmoid by name)
            if type(child) is torch.nn.Hardsigmoid:
                setattr(model, name, me.HardSigmoidMe())
            else:
                hard_sigmoid_me(child)
        return model

    def case(name: str, side: int, **kwargs):
        def make(batch: int):
            model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
            return (
                hard_sigmoid_me(model),
                torch.randn(batch, 3, side, side),
                torch.randint(0, 10, (batch,)),
                F.cross_entropy,
                f"{batch} x 3 x {side} x {side}",
            )

        return make

    return [
        ("mobilenetv3_small_050", case("mobilenetv3_small_050", 64, act_layer=me.HardSwishMe), (8,)),
        ("tinynet_e", case("tinynet_e", 64, act_layer=me.SwishMe), (8,)),
        ("resnet10t", case("resnet10t", 64, act_layer=me.HardMishMe), (8,)),
        ("vit_tiny", case("vit_tiny_patch16_224", 32, img_size=32, patch_size=8, act_layer=me.SwishMe), (8,)),
    ]


def trainer(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, autocast=None):
    """One training step of `model`, its forward and loss under torch.autocast(`autocast`) if given."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        with torch.autocast("cpu", autocast, enabled=autocast is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--target", type=float, default=0.3, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="one small shape per model, few repeats (a smoke test)")
    parser.add_argument("--threads", type=int, help="torch's (and so ONNX Runtime's) thread count")
    parser.add_argument("--ort-threads", type=int, help="ONNX Runtime's intra-op thread count (default: OrtModule's)")
    parser.add_argument(
        "--in-pytorch",
        default="",
        metavar="OPS",
        help="comma-separated aten operators to run in PyTorch (fallback nodes), e.g. convolution",
    )
    parser.add_argument("--timm", action="store_true", help="also timm models with memory-efficient activations")
    parser.add_argument(
        "--bf16",
        choices=["model", "autocast"],
        help="train in bfloat16: the model and inputs, or float32 weights under autocast",
    )
    args = parser.parse_args()
    try:
        in_pytorch = {
            getattr(torch.ops.aten, op).default for op in filter(None, map(str.strip, args.in_pytorch.split(",")))
        }
    except (AttributeError, RuntimeError) as e:
        parser.error(f"--in-pytorch {args.in_pytorch}: not aten operators ({e})")
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {}
    if args.ort_threads:
        from ortbridge.training.threads import default_session_options

        options["session_options"] = default_session_options()
        options["session_options"].intra_op_num_threads = args.ort_threads
    cases = [("Block", block_case, (8, 16, 64)), ("CNN", cnn_case, (8, 32))]
    if not args.quick:
        cases[1:1] = [("Block", block_case, (16, 64, 128))]
        cases.append(("CNN", cnn_case, (16, 64)))
    if args.timm:
        try:
            cases += timm_cases()
        except ImportError as e:
            parser.error(f"--timm needs timm ({e}); scripts/setup.sh installs it")
    repeats, target = (3, 0.05) if args.quick else (args.repeats, args.target)
    print(versions())
    print(
        f"torch threads {torch.get_num_threads()}; ONNX Runtime intra-op threads "
        f"{args.ort_threads or 'OrtModule default (torch, 1 for small graphs)'}; median of {repeats} repeats"
        f"{'; in PyTorch: ' + args.in_pytorch if args.in_pytorch else ''}"
        f"{'; bfloat16 ' + args.bf16 if args.bf16 else ''}\n"
    )
    name_width = max(len(name) for name, _, _ in cases)
    print(
        f"{'model':>{name_width}} {'size':>18} {'eager ms':>9} {'OrtModule ms':>13} {'ratio':>6} "
        f"{'compile ms':>11} {'ratio':>6}" + (f" {'+in PyTorch ms':>15} {'ratio':>6}" if in_pytorch else "")
    )
    for name, case, shape in cases:
        torch.manual_seed(0)
        model, x, y, loss_fn, size = case(*shape)
        if args.bf16 == "model":
            model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
        autocast = torch.bfloat16 if args.bf16 == "autocast" else None
        torch._dynamo.reset()
        steps = [
            trainer(m, x, y, loss_fn, autocast)
            for m in (
                copy.deepcopy(model),
                ortbridge.OrtModule(copy.deepcopy(model), **options),
                torch.compile(copy.deepcopy(model), backend="ortbridge", options=options),
            )
        ]
        first = [s() for s in steps]  # captures the graphs
        if in_pytorch:  # (captured with those operators preferred in PyTorch; the set restored after)
            steps.append(trainer(ortbridge.OrtModule(copy.deepcopy(model), **options), x, y, loss_fn, autocast))
            added = in_pytorch - fallback.PYTORCH_PREFERRED
            fallback.PYTORCH_PREFERRED.update(added)
            try:
                first.append(steps[-1]())
            finally:
                fallback.PYTORCH_PREFERRED.difference_update(added)
        rtol = 4e-2 if args.bf16 else 1e-4  # (bfloat16 keeps 8 significant bits)
        for wrapper, loss in zip(("OrtModule", "compile", "OrtModule +in PyTorch"), first[1:]):
            if not torch.allclose(loss, first[0], rtol=rtol, atol=1e-6):
                print(f"{name} {size}: {wrapper} loss {loss.item()} differs from eager's {first[0].item()}")
                return 1
        eager, *wrapped = (t * 1e3 for t in medians(steps, repeats, target, warmup=3))
        print(
            f"{name:>{name_width}} {size:>18} {eager:9.3f}"
            + "".join(f" {t:{w}.3f} {t / eager:6.2f}" for t, w in zip(wrapped, (13, 11, 15)))
        )
    assert ortbridge.context_pool_size() == 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
