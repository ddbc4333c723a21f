// Tensors in and out of both kernels: ORT inputs become borrowed DLPack capsules, and tensors
// returned by Python are checked against the node's declared types and ranks, then written
// into ORT-allocated outputs.
#pragma once

#include <onnxruntime_c_api.h>

#include <vector>

#include "device.h"
#include "ort_util.h"
#include "proxy.h"

namespace ortbridge {

// Input `index`, which must be present, of element type `type` and of rank `rank` (-1: any).
// Read before the GIL is taken.
TensorView ReadInput(const OrtApi& api, OrtKernelContext* context, size_t index, int64_t type, int64_t rank);

// Outputs written without a copy because the Function wrote into the buffer ORT gave the output.
uint64_t SkippedOutputCopies();

// A tuple of capsules viewing the inputs, on `device` (None for an empty view, elem_type 0). GIL held.
py::tuple BorrowInputs(const std::vector<TensorView>& inputs, dl::Device device);

// The outputs of one kernel call, written where the kernel's placement says: by the kernel (host
// memory) or by torch through the runner, on the current stream (device memory; a StreamScope
// is open). GIL held.
class KernelOutputs {
 public:
  KernelOutputs(const OrtApi& api, OrtKernelContext* context, const Placement& placement, const py::object& runner,
                CheckedOutputs& checked)
      : api_(api), context_(context), placement_(placement), runner_(runner), checked_(checked) {}

  // Writes `capsule` (a tensor from Python) to output `index`, after checking that it lives on
  // the kernel's device and has `type` and `rank` (and `expected_shape`, when given); returns
  // the output. Errors call it "<kind> <index>" ("gradient output 2").
  TensorView Write(size_t index, PyObject* capsule, int64_t type, int64_t rank, const char* kind,
                   const std::vector<int64_t>* expected_shape = nullptr);

  // Output `index` is `input` updated in place: allocates it with the input's shape and points
  // `input` at that buffer. Where ORT gave the output the input's own buffer nothing moves;
  // elsewhere the input is copied there first, so the Function never writes into a buffer other
  // nodes may read.
  void Redirect(size_t index, TensorView* input);

  // Output `index` as zeros of `meta`'s type and shape.
  void Zeros(size_t index, const TensorMeta& meta);

  // Output `index` as a 0-d int64 tensor holding `value` (the context id).
  void Scalar(size_t index, int64_t value);

 private:
  // Whether torch makes a copy of `bytes`: always off the CPU; on it, large ones.
  bool CopiedByTorch(size_t bytes) const;
  void* Allocate(size_t index, const std::vector<int64_t>& shape, int64_t elem_type) {
    return AllocateOutput(api_, context_, index, shape, elem_type, checked_.FirstAllocation(index));
  }

  const OrtApi& api_;
  OrtKernelContext* context_;
  const Placement& placement_;
  const py::object& runner_;
  CheckedOutputs& checked_;
};

}  // namespace ortbridge
