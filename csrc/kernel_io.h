// Tensors in and out of both kernels: ORT inputs become borrowed DLPack capsules, and tensors
// returned by Python are checked against the node's declared types and ranks, then written
// into ORT-allocated outputs.
#pragma once

#include <onnxruntime_c_api.h>

#include <vector>

#include "device.h"
#include "ort_util.h"
#include "python_call.h"

namespace ortbridge {

// Input `index`, which must be present, of element type `type` and of rank `rank` (-1: any).
// Read before the GIL is taken.
TensorView ReadInput(const OrtApi& api, OrtKernelContext* context, size_t index, int64_t type, int64_t rank);

// Outputs written without a copy because the Function wrote into the buffer ORT gave the output.
uint64_t SkippedOutputCopies();

// A tuple of capsules viewing the inputs, on `device` (None for an empty view, elem_type 0). GIL held.
py::tuple BorrowInputs(const TensorViews& inputs, dl::Device device);

// The outputs of one kernel call, written where the kernel's placement says: by the kernel (host
// memory) or by torch through the runner, on the current stream (device memory; a StreamScope
// is open). GIL held.
class KernelOutputs {
 public:
  KernelOutputs(const OrtApi& api, OrtKernelContext* context, const Placement& placement,
                const py::object& runner, CheckedOutputs& checked)
      : api_(api), context_(context), placement_(placement), runner_(runner), checked_(checked) {}

  // Writes `capsule` (a tensor from Python) to output `index`, after checking that it lives on
  // the kernel's device and has `type` and `rank` (and `expected_shape`, when given); returns
  // the output. Errors call it "<kind> <index>" ("gradient output 2").
  TensorView Write(size_t index, PyObject* capsule, int64_t type, int64_t rank, const char* kind,
                   const Shape* expected_shape = nullptr);

  // Output `index` is `input` updated in place: allocates it with the input's shape and points
  // `input` at that buffer. Where ORT gave the output the input's own buffer nothing moves;
  // elsewhere the input is copied there first, so the Function never writes into a buffer other
  // nodes may read.
  void Redirect(size_t index, TensorView* input);

  // Output `index` as zeros of `meta`'s type and shape.
  void Zeros(size_t index, const TensorMeta& meta);

  // Output `index` as a 0-d int64 tensor holding `value` (the context id).
  void Scalar(size_t index, int64_t value);

  // Output `index` allocated now with `shape` and `type`, as a capsule viewing its buffer: what
  // torch writes there and returns as that output is written without a copy.
  py::object Lend(size_t index, const Shape& shape, int64_t type);

 private:
  // Whether torch makes a copy of `bytes`: always off the CPU; on it, large ones.
  bool CopiedByTorch(size_t bytes) const;
  void* Allocate(size_t index, const Shape& shape, int64_t elem_type) {
    return AllocateOutput(api_, context_, index, shape, elem_type, checked_.FirstAllocation(index));
  }

  struct Lent {
    size_t index;
    const char* begin;
    size_t bytes;
  };
  // The output a lent buffer holds `data` for, where that is not `index` (a lent buffer returned
  // as another output would be overwritten by its own output's copy, or copied over it).
  const Lent* LentElsewhere(size_t index, const void* data) const;

  const OrtApi& api_;
  OrtKernelContext* context_;
  std::vector<Lent> lent_;
  const Placement& placement_;
  const py::object& runner_;
  CheckedOutputs& checked_;
};

// While it lives, the Python code of this kernel call may write outputs straight into the
// buffers ORT gives them (LendOutput), instead of returning tensors of its own for the kernel to
// copy: an operator node's PyTorch implementation that has an out= form. Only in a call without
// autograd (training_mode 0: nothing saves the buffer for backward) on the CPU; every other kernel
// call opens one that lends nothing, so that a call nested in a lending one (a Function may run a
// session itself) is never lent the outer call's buffers. Per thread, the innermost call's. GIL held.
class OutputLending {
 public:
  OutputLending() = default;  // lends nothing
  // `types` and `ranks`: the declared outputs after the first `skipped` ORT outputs.
  OutputLending(KernelOutputs* writer, const std::vector<int64_t>* types, const std::vector<int64_t>* ranks,
                size_t skipped)
      : writer_(writer), types_(types), ranks_(ranks), skipped_(skipped) {}
  OutputLending(const OutputLending&) = delete;
  OutputLending& operator=(const OutputLending&) = delete;
  ~OutputLending();

 private:
  friend py::object LendOutput(size_t output, const std::vector<int64_t>& shape);
  KernelOutputs* writer_ = nullptr;
  const std::vector<int64_t>* types_ = nullptr;
  const std::vector<int64_t>* ranks_ = nullptr;
  size_t skipped_ = 0;
  OutputLending* outer_ = Enter(this);
  static OutputLending* Enter(OutputLending* self);
};

// Output `output` (the Python code's own numbering, from 0) of the innermost kernel call on this
// thread, allocated with `shape`, as a DLPack capsule; None where that call lends nothing, or
// outside any. The buffer is valid until the call returns, like an input's: ORT then reuses it.
// Returned as that output, it is written without a copy; as another output, it is an error. GIL held.
py::object LendOutput(size_t output, const std::vector<int64_t>& shape);

}  // namespace ortbridge
