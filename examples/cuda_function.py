"""A custom CUDA kernel as a torch.autograd.Function, run by ONNX Runtime's CUDA execution provider.

The Function is x * sigmoid(alpha * x) (a scaled GELU), forward and backward each one CUDA kernel
of its own, compiled at first use with torch.utils.cpp_extension.load_inline (nvcc needed, about a
minute the first time; the build is cached in TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions). A model Linear -> ScaledGeluCuda -> Linear is exported to ONNX and run
in ortbridge.InferenceSession on the CUDA execution provider, next to eager PyTorch on the GPU;
then it trains a few AdamW steps as an ortbridge.OrtModule (ONNX Runtime runs the forward and
backward graphs on the GPU, the Function runs in PyTorch on ORT's stream) beside an eager copy.
Exits 1 if ORT and eager disagree beyond a tolerance; without a GPU it says what is missing and
exits 0.

The kernels launch on torch's current stream (c10::cuda::getCurrentCUDAStream()): inside an ORT
session that is ORT's compute stream, so they are ordered with ORT's own kernels and nothing needs
a synchronization.

    python examples/cuda_function.py

tests/python/test_cuda.py imports this file (build_extension, ScaledGeluCuda, Model).
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import tempfile

import numpy as np
import torch

import ortbridge

# The .cu file: load_inline puts torch/types.h, cuda.h and cuda_runtime.h in front of it.
CUDA_SOURCE = r"""
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // (not ATen/cuda/CUDAContext.h: that one needs cuBLAS's and cuSPARSE's headers)

#include <algorithm>

namespace {

__device__ __forceinline__ float sigmoid_of(float z) { return 1.0f / (1.0f + expf(-z)); }
__device__ __forceinline__ double sigmoid_of(double z) { return 1.0 / (1.0 + exp(-z)); }

// y = x * s, s = sigmoid(alpha * x), for float and double (at::opmath_type: the type to compute in).
template <typename scalar_t>
__global__ void scaled_gelu_forward_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y,
                                           double alpha, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t a = static_cast<acc_t>(alpha);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const acc_t v = static_cast<acc_t>(x[i]);
    y[i] = static_cast<scalar_t>(v * sigmoid_of(a * v));
  }
}

// dy/dx = s + alpha * x * s * (1 - s)
template <typename scalar_t>
__global__ void scaled_gelu_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ x,
                                            scalar_t* __restrict__ grad_x, double alpha, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t a = static_cast<acc_t>(alpha);
  const acc_t one = static_cast<acc_t>(1);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const acc_t v = static_cast<acc_t>(x[i]);
    const acc_t s = sigmoid_of(a * v);
    grad_x[i] = static_cast<scalar_t>(static_cast<acc_t>(grad[i]) * (s + a * v * s * (one - s)));
  }
}

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

}  // namespace

torch::Tensor scaled_gelu_forward(torch::Tensor x, double alpha) {
  TORCH_CHECK(x.is_cuda(), "scaled_gelu_forward: x must be a CUDA tensor, got one on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  const int64_t n = xc.numel();
  if (n == 0) return y;
  // torch's current stream on x's device: ORT's compute stream when ORT runs the Function.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(xc.scalar_type(), "scaled_gelu_forward", [&] {
    scaled_gelu_forward_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
        xc.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), alpha, n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

torch::Tensor scaled_gelu_backward(torch::Tensor grad, torch::Tensor x, double alpha) {
  TORCH_CHECK(x.is_cuda() && grad.device() == x.device(),
              "scaled_gelu_backward: grad and x must be CUDA tensors on one device, got ", grad.device(),
              " and ", x.device());
  TORCH_CHECK(grad.sizes() == x.sizes(), "scaled_gelu_backward: grad has shape ", grad.sizes(),
              ", x has shape ", x.sizes());
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), "scaled_gelu_backward: grad is ", grad.scalar_type(),
              ", x is ", x.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor xc = x.contiguous();
  const torch::Tensor gc = grad.contiguous();
  torch::Tensor gx = torch::empty_like(xc);
  const int64_t n = xc.numel();
  if (n == 0) return gx;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(xc.scalar_type(), "scaled_gelu_backward", [&] {
    scaled_gelu_backward_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
        gc.const_data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(), gx.mutable_data_ptr<scalar_t>(), alpha, n);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return gx;
}
"""

# The .cpp file (after torch/extension.h): declarations; load_inline writes the bindings.
CPP_SOURCE = r"""
torch::Tensor scaled_gelu_forward(torch::Tensor x, double alpha);
torch::Tensor scaled_gelu_backward(torch::Tensor grad, torch::Tensor x, double alpha);
"""

EXTENSION_NAME = "ortbridge_example_scaled_gelu"

# ORT's CUDA execution provider runs float32 MatMul/Gemm/Conv in TF32 by default (provider option
# use_tf32=1), eager torch's matmuls do not (torch.backends.cuda.matmul.allow_tf32 is False): full
# float32 here so that ORT and eager agree to float32 rounding. OrtModule(model.cuda()) alone also
# runs on the CUDA execution provider (with ORT's default options).
PROVIDERS = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]


def missing() -> str | None:
    """What this machine lacks to run the example, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install ortbridge[gpu])"
    return None


@functools.cache
def build_extension():
    """The compiled extension (scaled_gelu_forward, scaled_gelu_backward); built on first call
    (ORTBRIDGE_VERBOSE_BUILD=1 shows the compiler's commands)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=EXTENSION_NAME,
        cpp_sources=CPP_SOURCE,
        cuda_sources=CUDA_SOURCE,
        functions=["scaled_gelu_forward", "scaled_gelu_backward"],
        extra_cuda_cflags=["-O3"],
        verbose=os.environ.get("ORTBRIDGE_VERBOSE_BUILD") == "1",
    )


@ortbridge.register
class ScaledGeluCuda(torch.autograd.Function):
    """x * sigmoid(alpha * x) on CUDA tensors, with its own CUDA kernel for the backward."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.save_for_backward(x)
        ctx.alpha = alpha
        return build_extension().scaled_gelu_forward(x, alpha)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return build_extension().scaled_gelu_backward(grad, x, ctx.alpha), None


def reference(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """What ScaledGeluCuda computes, in torch operators."""
    return x * torch.sigmoid(alpha * x)


class Model(torch.nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, width)
        self.fc2 = torch.nn.Linear(width, 8)

    def forward(self, x):
        return self.fc2(ScaledGeluCuda.apply(self.fc1(x), 1.702))


def check_kernels() -> bool:
    """The kernels against torch's operators (forward and gradient)."""
    x = torch.randn(1000, device="cuda", requires_grad=True)
    y = ScaledGeluCuda.apply(x, 1.702)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    xr = x.detach().requires_grad_()
    yr = reference(xr, 1.702)
    (gr,) = torch.autograd.grad(yr, xr, torch.ones_like(yr))
    err = max(float((y - yr).abs().max()), float((gx - gr).abs().max()))
    print(f"kernels against torch operators: max abs diff {err:.2e}")
    return err <= 1e-5


def inference(path: str) -> bool:
    torch.manual_seed(0)
    model = Model().cuda().eval()
    # Exported on the GPU, once, with a dynamic batch dim; run below at another batch size.
    ortbridge.export(model, (torch.randn(4, 16, device="cuda"),), path, dynamic_shapes=({0: "batch"},))
    session = ortbridge.InferenceSession(path, providers=PROVIDERS)
    print("session providers:", session.get_providers())
    x = torch.randn(7, 16, device="cuda")
    with torch.no_grad():
        eager = model(x)

    # 1. numpy in and out: ORT copies the input to the GPU and the output back.
    (ort_out,) = session.run(None, {session.get_inputs()[0].name: x.cpu().numpy()})
    diff_numpy = float(np.abs(ort_out - eager.cpu().numpy()).max())

    # 2. IOBinding on torch's device tensors: no copy in or out. ORT runs on its own stream, which
    #    does not wait for torch's: the input must be ready before the run (hence the synchronize).
    #    run_with_iobinding returns after ORT's stream has finished (its default), so the output
    #    tensor is ready too.
    out = torch.empty_like(eager)
    binding = session.io_binding()
    binding.bind_input(session.get_inputs()[0].name, "cuda", x.device.index, np.float32, list(x.shape), x.data_ptr())
    binding.bind_output(
        session.get_outputs()[0].name, "cuda", out.device.index, np.float32, list(out.shape), out.data_ptr()
    )
    torch.cuda.current_stream().synchronize()
    session.run_with_iobinding(binding)
    diff_bound = float((out - eager).abs().max())

    print("ONNX Runtime (CUDA EP):", np.round(ort_out[0, :4], 5))
    print("eager torch (GPU):     ", np.round(eager[0, :4].cpu().numpy(), 5))
    print(f"max abs diff: numpy feeds {diff_numpy:.2e}, IOBinding {diff_bound:.2e}")
    return diff_numpy <= 1e-5 and diff_bound <= 1e-5


def training(steps: int = 5) -> bool:
    torch.manual_seed(0)
    eager = Model().cuda()
    model = ortbridge.OrtModule(copy.deepcopy(eager), providers=PROVIDERS)  # ORT on the GPU; the Function in torch
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, eager)]
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 8, device="cuda")
    ok = True
    print("step  OrtModule loss  eager loss")
    for step in range(steps):
        losses = []
        for m, opt in zip((model, eager), optimizers):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        print(f"{step:4d}  {losses[0]:14.7f}  {losses[1]:10.7f}")
        ok &= abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[1]) + 1e-6
    weight_diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), eager.parameters()))
    print(f"max abs diff of the weights after {steps} steps: {weight_diff:.2e}")
    live = ortbridge.context_pool_size()
    if live:
        print(f"{live} autograd contexts left live")
    return ok and weight_diff <= 1e-4 and live == 0


def main() -> int:
    reason = missing()
    if reason is not None:
        print(
            f"cuda_function.py: nothing run: {reason}. This example needs an NVIDIA GPU, a CUDA build of "
            "torch, nvcc and onnxruntime-gpu (pip install 'ortbridge[gpu]')."
        )
        return 0
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__} (CUDA {torch.version.cuda})")
    print("building the CUDA extension (cached after the first build)...", flush=True)
    build_extension()
    ok = check_kernels()
    with tempfile.TemporaryDirectory() as folder:
        ok &= inference(os.path.join(folder, "cuda_function.onnx"))
    ok &= training()
    if not ok:
        print("ERROR: ONNX Runtime and eager PyTorch disagree", file=sys.stderr)
        return 1
    print("OK: ONNX Runtime on the CUDA execution provider matches eager PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
