// The entry point ONNX Runtime calls when the library is registered with a session:
// SessionOptions.register_custom_ops_library(ortbridge.library_path()).
#include <cstdio>
#include <initializer_list>
#include <mutex>
#include <string>

#include <onnxruntime_cxx_api.h>

#include "custom_op.h"

namespace ortbridge {

namespace {

const OrtApi* g_api = nullptr;

// Session config entries ("1") that choose the kernels a session gets: the CPU ones only (for
// Functions that need host tensors even where the CUDA provider runs the rest of the graph), or
// the CPU ones on the CUDA kernels' code path (how the tests run that path without a GPU).
constexpr const char* kCpuOnlyKey = "ortbridge.cpu_kernels_only";
constexpr const char* kCpuViaTorchKey = "ortbridge.cpu_kernels_via_torch";

bool ConfigFlag(const OrtApi& api, const OrtSessionOptions* options, const char* key) {
  int has = 0;
  if (OrtStatus* status = api.HasSessionConfigEntry(options, key, &has)) {
    api.ReleaseStatus(status);
    return false;
  }
  if (!has) return false;
  char value[8] = {};
  size_t size = sizeof(value);
  OrtStatus* status = api.GetSessionConfigEntry(options, key, value, &size);
  if (status) api.ReleaseStatus(status);
  return !status && std::string(value) == "1";
}

// One domain of kernels for the given backends, made once (ORT keeps pointers to it, so it lives
// as long as the process); the error of making it, if any.
struct Domain {
  OrtCustomOpDomain* domain = nullptr;
  OrtStatus* error = nullptr;

  Domain(const OrtApi& api, std::initializer_list<Backend> backends) {
    error = api.CreateCustomOpDomain(kDomain, &domain);
    for (Backend backend : backends) {
      if (!error) error = api.CustomOpDomain_Add(domain, PythonOp(backend));
      if (!error) error = api.CustomOpDomain_Add(domain, PythonOpGrad(backend));
    }
  }
};

const Domain& DomainFor(const OrtApi& api, const OrtSessionOptions* options) {
  if (ConfigFlag(api, options, kCpuViaTorchKey)) {
    static const Domain via_torch(api, {Backend::kCpuViaTorch, Backend::kCuda});
    return via_torch;
  }
  if (ConfigFlag(api, options, kCpuOnlyKey)) {
    static const Domain cpu_only(api, {Backend::kCpu});
    return cpu_only;
  }
  static const Domain both(api, {Backend::kCpu, Backend::kCuda});
  return both;
}

}  // namespace

const OrtApi& Api() { return *g_api; }

}  // namespace ortbridge

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* api_base) {
  using namespace ortbridge;
  const OrtApi* api = api_base->GetApi(kOrtApiVersion);
  if (!api || !IsSupportedOrtVersion(api_base->GetVersionString())) {
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, ("ortbridge needs ONNX Runtime 1." + std::to_string(kMinOrtMinorVersion) +
                   " or newer; this is " + api_base->GetVersionString())
                      .c_str());
  }
  static std::once_flag once;
  std::call_once(once, [&] {
    g_api = api;
    Ort::InitApi(api);
    InitShapeReference(api_base);
  });
  const Domain& kernels = DomainFor(*api, options);
  if (kernels.error) return api->CreateStatus(ORT_FAIL, api->GetErrorMessage(kernels.error));
  return api->AddCustomOpDomain(options, kernels.domain);
}
