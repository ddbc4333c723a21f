// Tensors in and out of both kernels: ORT inputs become borrowed DLPack capsules, and tensors
// returned by Python are checked against the node's declared types and ranks, then written
// into ORT-allocated outputs.
#pragma once

#include <onnxruntime_c_api.h>

#include <vector>

#include "ort_util.h"
#include "proxy.h"

namespace ortbridge {

// Input `index`, which must be present, of element type `type` and of rank `rank` (-1: any).
// Read before the GIL is taken.
TensorView ReadInput(const OrtApi& api, OrtKernelContext* context, size_t index, int64_t type, int64_t rank);

// Outputs written without a copy because the Function wrote into the buffer ORT gave the output.
uint64_t SkippedOutputCopies();

// A tuple of capsules viewing the inputs (None for an empty view, elem_type 0). GIL held.
py::tuple BorrowInputs(const std::vector<TensorView>& inputs);

// Writes `capsule` (a tensor from Python) to output `index`, after checking that it lives on
// the CPU and has `type` and `rank` (and `expected_shape`, when given); returns the output.
// Errors call it "<kind> <index>" ("gradient output 2"). GIL held.
TensorView WriteOutput(const OrtApi& api, OrtKernelContext* context, size_t index, PyObject* capsule, int64_t type,
                       int64_t rank, const char* kind, const std::vector<int64_t>* expected_shape = nullptr);

// Node output `index` is `input` updated in place: allocates it with the input's shape and
// points `input` at that buffer. Where ORT gave the output the input's own buffer nothing moves;
// elsewhere the input is copied there first, so the Function never writes into a buffer other
// nodes may read. Before the GIL is taken.
void RedirectToOutput(const OrtApi& api, OrtKernelContext* context, size_t index, TensorView* input);

// Output `index` as zeros of `meta`'s type and shape.
void WriteZeros(const OrtApi& api, OrtKernelContext* context, size_t index, const TensorMeta& meta);

}  // namespace ortbridge
