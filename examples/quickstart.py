"""A model whose forward calls a custom autograd.Function: export it and run it in ONNX Runtime,
then train it with ONNX Runtime running the forward and backward graphs; both compared with
eager PyTorch."""

import copy

import numpy as np
import torch

import ortbridge


@ortbridge.register
class ScaledGelu(torch.autograd.Function):
    """x * sigmoid(alpha * x), with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return x * torch.sigmoid(alpha * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(ctx.alpha * x)
        return grad * (s + ctx.alpha * x * s * (1 - s)), None


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 6)

    def forward(self, x):
        return ScaledGelu.apply(self.linear(x), 1.702) * 2


def inference():
    torch.manual_seed(0)
    model = Model().eval()
    # Exported once with a dynamic batch dim, run below at another batch size.
    ortbridge.export(model, (torch.randn(4, 8),), "quickstart.onnx", dynamic_shapes=({0: "batch"},))
    session = ortbridge.InferenceSession("quickstart.onnx")
    x = torch.randn(7, 8)
    (ort_out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        eager_out = model(x).numpy()
    print("ONNX Runtime:", np.round(ort_out[0], 5))
    print("eager torch: ", np.round(eager_out[0], 5))
    print("max abs diff:", float(np.abs(ort_out - eager_out).max()))
    assert np.allclose(ort_out, eager_out, atol=1e-6), "ORT and eager PyTorch disagree"


def training(steps=5):
    torch.manual_seed(0)
    eager = Model()
    model = ortbridge.OrtModule(copy.deepcopy(eager))  # ORT runs forward and backward; ScaledGelu runs in torch
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (model, eager)]
    x, y = torch.randn(16, 8), torch.randn(16, 6)
    print("step  OrtModule loss  eager loss")
    for step in range(steps):
        losses = []
        for m, opt in zip((model, eager), optimizers):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        print(f"{step:4d}  {losses[0]:14.6f}  {losses[1]:10.6f}")
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]) + 1e-6, "OrtModule and eager PyTorch disagree"
    assert ortbridge.context_pool_size() == 0


if __name__ == "__main__":
    inference()
    training()
