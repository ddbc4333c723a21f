// Small helpers over the ONNX Runtime C API: errors as exceptions inside the library and as
// OrtStatus at its edge, and attribute access for kernel creation and shape inference.
#pragma once

#include <cxxabi.h>
#include <onnxruntime_c_api.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "attributes.h"
#include "small_vector.h"

namespace ortbridge {

// The lowest ORT API the kernels use: V2 (status) callbacks, shape inference, node names.
constexpr uint32_t kOrtApiVersion = 17;
// OrtCustomOp::version: ORT reads the callbacks of that version and no newer. 18 adds MayInplace.
constexpr uint32_t kCustomOpVersion = 18;
// The oldest ORT release the kernels work on: 1.18 loads them, but its graphs ignore the types
// their shape inference sets, so every PythonOp output fails type inference.
constexpr int kMinOrtMinorVersion = 19;

// OrtApi::GetTensorElementTypeAndShapeDataReference (API 24, ORT 1.24): a tensor's type and a view
// of its shape, where GetTensorTypeAndShape allocates an info object and its dims per call. ORT's
// API table only grows, each version appending to it, so the entry has this index from 24 on;
// the header the library builds with may be older (the compiler checks the index where it is not).
using ShapeReferenceFn = OrtStatus*(ORT_API_CALL*)(const OrtValue*, ONNXTensorElementDataType*,
                                                   const int64_t**, size_t*);
constexpr uint32_t kShapeReferenceApiVersion = 24;
constexpr size_t kShapeReferenceIndex = 414;
#if ORT_API_VERSION >= 24
static_assert(offsetof(OrtApi, GetTensorElementTypeAndShapeDataReference) ==
              kShapeReferenceIndex * sizeof(void*));
#endif
// Looks the entry up once, at registration: null where ORT is older than 1.24.
void InitShapeReference(const OrtApiBase* base);

// Whether an ORT version string ("1.19.2") names a release the kernels work on.
inline bool IsSupportedOrtVersion(const char* version) {
  int major = 0, minor = 0;
  if (std::sscanf(version, "%d.%d", &major, &minor) != 2) return false;
  return major > 1 || (major == 1 && minor >= kMinOrtMinorVersion);
}

// An ORT call that failed inside a kernel; turned back into an OrtStatus at the C boundary.
class OrtError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws OrtError carrying the message of a failed ORT call, releasing the status.
void ThrowOnError(const OrtApi& api, OrtStatus* status);

// Runs `body`, turning any exception into an ORT error status whose text starts with `prefix`.
// The forced unwind that ends a thread (pthread_exit; CPython uses it for a daemon thread that
// wants the GIL during interpreter exit) is not an error: it must travel on, or the process aborts.
template <class F>
OrtStatus* Guarded(const OrtApi& api, const std::string& prefix, F&& body) {
  try {
    body();
    return nullptr;
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (const std::exception& e) {
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, (prefix + e.what()).c_str());
  } catch (...) {
    return api.CreateStatus(ORT_RUNTIME_EXCEPTION, (prefix + "unknown C++ exception").c_str());
  }
}

// Attributes of a node at kernel creation.
class KernelInfoAttributes : public AttributeSource {
 public:
  KernelInfoAttributes(const OrtApi& api, const OrtKernelInfo* info) : api_(api), info_(info) {}
  bool Has(const char* name) const override;
  bool GetInt(const char* name, int64_t* out) const override;
  bool GetString(const char* name, std::string* out) const override;
  bool GetInts(const char* name, std::vector<int64_t>* out) const override;
  bool GetFloats(const char* name, std::vector<float>* out) const override;

 private:
  const OrtApi& api_;
  const OrtKernelInfo* info_;
};

// Attributes of a node during shape inference (only the integer lists are needed there); an
// optional one that is absent reads as empty.
std::vector<int64_t> ShapeInferInts(const OrtApi& api, OrtShapeInferContext* ctx, const char* name,
                                    bool required = true);

// Gives output `output` the inferred type and shape of input `input`, when that input has
// `elem_type` and `rank`; returns whether it did.
bool CopyInputTypeShape(const OrtApi& api, OrtShapeInferContext* ctx, size_t input, size_t output,
                        int64_t elem_type, int64_t rank);

// Sets output `index` to a tensor of `elem_type` and `rank` unknown dimensions.
void SetOutputTypeAndRank(const OrtApi& api, OrtShapeInferContext* ctx, size_t index, int64_t elem_type,
                          int64_t rank);

std::string NodeName(const OrtApi& api, const OrtKernelInfo* info);

// What the graph declares for one input or output of the node: its value name ("" where the
// node leaves the slot empty) and element type (0 where the graph gives it none).
struct DeclaredValue {
  std::string name;
  int64_t elem_type = 0;
};
std::vector<DeclaredValue> DeclaredInputs(const OrtApi& api, const OrtKernelInfo* info);
std::vector<DeclaredValue> DeclaredOutputs(const OrtApi& api, const OrtKernelInfo* info);

// A tensor's element type (0: no tensor) and shape.
struct TensorMeta {
  int64_t elem_type = 0;
  Shape shape;

  size_t byte_size() const {
    size_t bytes = ElementSize(elem_type);
    for (int64_t d : shape) bytes *= static_cast<size_t>(d);
    return bytes;
  }
};

// A tensor input or output of the kernel as raw memory.
struct TensorView : TensorMeta {
  void* data = nullptr;
};
// A call's inputs, outputs or gradients.
using TensorViews = SmallVector<TensorView, 4>;
// Returns false when the (optional) input is absent.
bool GetInputTensor(const OrtApi& api, OrtKernelContext* ctx, size_t index, TensorView* out);
// Allocates output `index` with `shape` and returns its buffer; with `check`, after checking that
// ORT gave it `elem_type` and room for every element (what the caller then writes).
void* AllocateOutput(const OrtApi& api, OrtKernelContext* ctx, size_t index, const Shape& shape,
                     int64_t elem_type, bool check = true);

// The outputs of one kernel whose allocation has been checked. One check per output suffices:
// ORT allocates an output by its graph type, the same in every run, with the shape the kernel
// asks for, and refuses a pre-bound buffer of another type or shape itself. (Asking ORT for an
// output's type and shape costs ~800 instructions, ~2% of a small PythonOp call.)
class CheckedOutputs {
 public:
  explicit CheckedOutputs(size_t outputs) : checked_(outputs) {}
  // Whether output `index` is still to be checked; true once per output.
  bool FirstAllocation(size_t index) {
    return index >= checked_.size() || !checked_[index].exchange(true, std::memory_order_relaxed);
  }

 private:
  std::vector<std::atomic<bool>> checked_;  // (sessions may run a kernel on several threads at once)
};

}  // namespace ortbridge
