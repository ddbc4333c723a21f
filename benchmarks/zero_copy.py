"""Cost of moving tensors through an ortbridge PythonOp, against size.

What is measured
----------------
A one-node ONNX graph, x -> PythonOp -> y (training_mode=0), runs a registered Function on a
float32 tensor of 4 KiB .. 256 MiB (powers of 4). Two Functions:

  clone  forward returns x.clone(): torch allocates and fills a new tensor, then the kernel
         copies it into the output buffer ORT allocated. Two copies in all.
  view   forward returns x.view_as(x), a view of ORT's own input buffer (inputs reach torch
         zero-copy through DLPack): the only copy is the kernel's one memcpy into ORT's output
         buffer, so this is the floor for "a Function produced a tensor, ORT owns it".

ORT is driven through IOBinding: the input is bound to the data pointer of an existing torch
tensor, the output is bound to the CPU device (ORT allocates it, from its arena, on every run),
so no numpy conversion of the input or output is timed. References, timed in the same run:

  torch.clone  x.clone() in eager torch: what the clone variant computes, minus the bridge.
  copy_        out.copy_(x) into a preallocated tensor: one copy with no allocation, roughly
               the memory-bandwidth floor for one pass.
  clone+copy_  out.copy_(x.clone()): what "clone" must do at the least, all in torch: the
               Function's clone, then one copy into a buffer that was already there (ORT's).
               "clone/floor" = ORT clone / this: what the bridge adds to that floor.

How to read it
--------------
Each row gives median microseconds per call (median over repeats of N back-to-back calls),
ratio = ORT / torch.clone for each variant ("clone/tc", "view/tc"), "floor/tc" = clone+copy_ /
torch.clone (the two copies alone, in torch), "clone/floor" = ORT clone / clone+copy_ (what the
bridge adds to them), and "view GB/s" = size / ORT view time (bytes delivered into ORT's output
per second). For small tensors the bridge's fixed cost (session run, GIL, DLPack,
Function.apply: ~10 us) dominates and the ratios are large. For large tensors the cost is
bandwidth: "clone" costs torch.clone plus one copy, and "view" costs about one copy_, so view/tc
near or below 1 means the bridge adds nothing beyond the one unavoidable copy into ORT's buffer.
Around 1-16 MiB, clone/tc (and floor/tc) can exceed 2: the two copies touch three buffers
(input, torch's clone, ORT's output) where torch.clone touches two, and fall out of cache
sooner. From 64 MiB torch.clone gets fresh pages from the kernel on every call (glibc serves
blocks above its mmap threshold, at most 32 MiB, with mmap/munmap) and pays a page fault per 4
KiB page (partly so already at 4-16 MiB, where glibc trims the heap), while ORT's arena reuses
output memory that is already mapped; that is why "view" beats torch.clone there, and why
clone/tc drops towards 1.

torch and ORT intra-op threads are both set to --threads (default 1), so that every copy runs
on one core, like the kernel's memcpy. Peak resident memory is printed at the end.

--device cuda
-------------
The same on the GPU (device 0): the node runs on ORT's CUDA execution provider, the input bound to
a torch CUDA tensor, the output bound to the cuda device (ORT allocates it from its CUDA arena);
the Function gets a CUDA tensor viewing ORT's buffer and runs on ORT's stream, and the kernel
copies its result into ORT's output on that stream (a device-to-device copy, the one copy of
"view"). torch.clone and copy_ run on the same GPU. ORT's run ends by synchronizing its stream
(ORT's default), so each torch call ends with torch.cuda.current_stream().synchronize() too, and
each timed loop is bracketed by torch.cuda.synchronize(). For small tensors the fixed cost is
the bridge plus a launch and a synchronization; for large ones, device memory bandwidth ("view
GB/s" counts the bytes delivered, each read once and written once). Peak memory: host RSS and
torch's CUDA allocator (ORT's CUDA arena is not in it). Without a GPU and onnxruntime-gpu's
CUDAExecutionProvider, --device cuda exits with status 2 and says what is missing.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys

import numpy as np
import torch
from common import Clone, View, cuda_versions, medians, python_op, require_device, session, versions

SIZES = [4**k for k in range(6, 15)]  # bytes: 4 KiB .. 256 MiB


def make_session(func: type, threads: int, device: str = "cpu"):
    return session([python_op(func, "x", "y", "ctx", "op")], [("x", [None])], [("y", [None])], threads, device)


def bound_call(sess, x: torch.Tensor, device: str = "cpu"):
    io = sess.io_binding()
    io.bind_input("x", device, 0, np.float32, list(x.shape), x.data_ptr())
    io.bind_output("y", device)
    run = sess.run_with_iobinding
    return io, (lambda: run(io))


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement (median reported)")
    p.add_argument("--target", type=float, default=0.15, help="seconds per repeat (sets N)")
    p.add_argument("--large-repeats", type=int, default=5, help="repeats for 64 MiB and up (N is 1-2 there)")
    p.add_argument("--max-size", default="256M", help="largest tensor, e.g. 16M (default 256M)")
    p.add_argument("--threads", type=int, default=1, help="torch and ORT intra-op threads")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 repeats of ~0.02 s, up to 64M")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default) or cuda: the node on ORT's CUDA execution provider, torch on the GPU",
    )
    args = p.parse_args(argv)
    repeats, target, large_repeats, max_size = args.repeats, args.target, args.large_repeats, args.max_size
    if args.quick:
        repeats, target, large_repeats, max_size = 3, 0.02, 2, "64M" if max_size == "256M" else max_size
    units = {"K": 1 << 10, "M": 1 << 20}
    try:
        max_bytes = int(max_size[:-1]) * units[max_size[-1].upper()] if max_size[-1].upper() in units else int(max_size)
    except ValueError:
        p.error(f"bad --max-size {max_size!r}")
    sizes = [s for s in SIZES if s <= max_bytes]
    require_device(args.device, "zero_copy.py")
    device = args.device
    on_cuda = device == "cuda"
    sync = torch.cuda.synchronize if on_cuda else None

    torch.set_num_threads(args.threads)
    sess_clone = make_session(Clone, args.threads, device)
    sess_view = make_session(View, args.threads, device)

    print(versions())
    if on_cuda:
        print(cuda_versions())
    print(
        f"torch/ORT intra-op threads {args.threads}  repeats {repeats} "
        f"({large_repeats} from 64M)  ~{target:g} s/repeat  feed: IOBinding (input bound to a torch pointer, "
        f"output ORT-allocated on {device})"
    )
    if on_cuda:
        print("each call (ORT run, torch.clone, copy_) ends with its stream synchronized")
    print("times: median microseconds per call; ratio = ORT / torch.clone")
    print()
    print(
        f"{'size':>5} {'ORT clone':>11} {'ORT view':>11} {'torch.clone':>12} {'copy_':>11} {'clone+copy_':>12} "
        f"{'clone/tc':>9} {'floor/tc':>9} {'clone/floor':>11} {'view/tc':>8} {'view GB/s':>10}"
    )

    for nbytes in sizes:
        numel = nbytes // 4
        x = torch.rand(numel, dtype=torch.float32, device=device)
        out = torch.empty_like(x)
        io_c, ort_clone = bound_call(sess_clone, x, device)
        io_v, ort_view = bound_call(sess_view, x, device)

        if on_cuda:
            stream = torch.cuda.current_stream()

            def torch_clone():
                y = x.clone()
                stream.synchronize()
                return y

            def copy_():
                out.copy_(x)
                stream.synchronize()
                return out

            def clone_copy():
                out.copy_(x.clone())
                stream.synchronize()
                return out

            torch.cuda.synchronize()  # ORT's stream does not wait for torch's: x is ready before any run
        else:

            def torch_clone():
                return x.clone()

            def copy_():
                return out.copy_(x)

            def clone_copy():
                return out.copy_(x.clone())

        # Correctness, once per size: both variants return x, in a buffer that is not x's.
        for io, call in ((io_c, ort_clone), (io_v, ort_view)):
            call()
            y = io.get_outputs()[0]
            assert y.shape() == [numel], y.shape()
            assert y.data_ptr() != x.data_ptr(), "ORT output aliases the input"
            if on_cuda:
                assert y.device_name().lower() == "cuda", y.device_name()
                assert np.array_equal(io.copy_outputs_to_cpu()[0], x.cpu().numpy()), "ORT output differs from the input"
            else:
                assert np.array_equal(y.numpy(), x.numpy()), "ORT output differs from the input"
            del y

        fns = [ort_clone, ort_view, torch_clone, copy_, clone_copy]
        large = nbytes >= (64 << 20)
        # warm-up covers arena growth, page mapping and allocator caches
        t_clone, t_view, t_tc, t_copy, t_floor = medians(
            fns, large_repeats if large else repeats, target, 2 if large else 10, sync
        )
        print(
            f"{fmt_size(nbytes):>5} {t_clone * 1e6:>11.1f} {t_view * 1e6:>11.1f} {t_tc * 1e6:>12.1f} "
            f"{t_copy * 1e6:>11.1f} {t_floor * 1e6:>12.1f} {t_clone / t_tc:>9.2f} {t_floor / t_tc:>9.2f} "
            f"{t_clone / t_floor:>11.2f} {t_view / t_tc:>8.2f} {nbytes / t_view / 1e9:>10.2f}",
            flush=True,
        )
        del io_c, io_v, ort_clone, ort_view, fns
        gc.collect()

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print()
    print(f"peak RSS {peak / 1024:.0f} MiB")
    if on_cuda:
        print(f"peak CUDA memory of torch's allocator {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
