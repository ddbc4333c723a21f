"""torch's linear algebra operators that check their input (linalg.inv, cholesky, solve, lu_factor,
ldl_factor, inverse: each an operator of the `_ex` kind and an error check, which torch 2.13 and
later trace behind an effect token and older releases drop from their traces): they export, run
and train equal to eager, and a singular or non-positive-definite input raises as in eager,
never gives inf or NaN silently."""

import re

import numpy as np
import pytest
import torch
from side_by_side import train_side_by_side

import ortbridge

nn = torch.nn

OPS = {
    "inv": lambda a, b: torch.linalg.inv(a),
    "inverse": lambda a, b: torch.inverse(a),
    "cholesky": lambda a, b: torch.linalg.cholesky(a),
    "solve": lambda a, b: torch.linalg.solve(a, a.sin() + 1),
    "lu_factor": lambda a, b: torch.linalg.lu_factor(a)[0],
    "ldl_factor": lambda a, b: torch.linalg.ldl_factor(a)[0],
}


class Linalg(nn.Module):
    """The operator on a positive definite matrix made from the input (h^T h + I, h = lin(x)), or on `x`
    itself with `raw`."""

    def __init__(self, op: str, raw: bool = False):
        super().__init__()
        self.op, self.raw = OPS[op], raw
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        a = x if self.raw else self.lin(x).mT @ self.lin(x) + torch.eye(3)
        return self.op(a, x)


@pytest.mark.parametrize("op", list(OPS))
def test_exports_runs_and_refuses_singular_input(op, tmp_path):
    path = tmp_path / "linalg.onnx"
    ortbridge.export(Linalg(op, raw=True), (torch.eye(3) * 2,), path)
    session = ortbridge.InferenceSession(path)
    x = torch.eye(3) * 2 + 0.1
    (got,) = session.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(got, Linalg(op, raw=True)(x).detach().numpy(), rtol=1e-5, atol=1e-6)
    singular = np.zeros((3, 3), np.float32)
    with pytest.raises(Exception) as eager:
        Linalg(op, raw=True)(torch.from_numpy(singular))
    with pytest.raises(Exception, match=re.escape(str(eager.value).split(":")[-1].strip()[:40])):
        session.run(None, {"x": singular})


@pytest.mark.parametrize("op", ["inv", "cholesky", "solve"])
@pytest.mark.parametrize("wrapper", ["OrtModule", "compile"])
def test_trains_equal_to_eager(op, wrapper):
    def batch(step):
        torch.manual_seed(step)
        return (torch.randn(4, 3),), {}

    wrap = ortbridge.OrtModule if wrapper == "OrtModule" else lambda m: torch.compile(m, backend="ortbridge")
    torch.manual_seed(0)
    train_side_by_side(Linalg(op), batch, lambda out, step: out.square().mean(), wrap=wrap)


def test_a_singular_matrix_in_training_raises_as_in_eager():
    model = ortbridge.OrtModule(Linalg("inv", raw=True))
    model(torch.eye(3, requires_grad=True)).sum().backward()
    with pytest.raises(Exception, match="singular"):
        model(torch.zeros(3, 3, requires_grad=True))
    assert ortbridge.context_pool_size() == 0
