// The entry point ONNX Runtime calls when the library is registered with a session:
// SessionOptions.register_custom_ops_library(ortbridge.library_path()).
#include <cstdio>
#include <mutex>
#include <string>

#include <onnxruntime_cxx_api.h>

#include "custom_op.h"

namespace ortbridge {

namespace {

const OrtApi* g_api = nullptr;

// A session config entry under which the CPU kernels take the CUDA kernels' code path: tests run
// it without a GPU.
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

// The kernels of both execution providers, in one domain (ORT keeps pointers to it, so it lives
// as long as the process); the error of making it, if any.
struct Domain {
  OrtCustomOpDomain* domain = nullptr;
  OrtStatus* error = nullptr;

  Domain(const OrtApi& api, Backend cpu) {
    error = api.CreateCustomOpDomain(kDomain, &domain);
    for (Backend backend : {cpu, Backend::kCuda}) {
      if (!error) error = api.CustomOpDomain_Add(domain, PythonOp(backend));
      if (!error) error = api.CustomOpDomain_Add(domain, PythonOpGrad(backend));
    }
  }
};

}  // namespace

const OrtApi& Api() { return *g_api; }

}  // namespace ortbridge

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const OrtApiBase* api_base) {
  using namespace ortbridge;
  const OrtApi* api = api_base->GetApi(kOrtApiVersion);
  if (!api || !IsSupportedOrtVersion(api_base->GetVersionString())) {
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, ("ortbridge needs ONNX Runtime 1." + std::to_string(kMinOrtMinorVersion) + " or newer; this is " +
                   api_base->GetVersionString())
                      .c_str());
  }
  static std::once_flag once;
  std::call_once(once, [&] {
    g_api = api;
    Ort::InitApi(api);
  });
  static const Domain kernels(*api, Backend::kCpu);  // one domain serves every session
  static const Domain* via_torch = nullptr;          // made on first use: tests only
  static std::once_flag via_torch_once;
  const Domain* chosen = &kernels;
  if (ConfigFlag(*api, options, kCpuViaTorchKey)) {
    std::call_once(via_torch_once, [&] { via_torch = new Domain(*api, Backend::kCpuViaTorch); });
    chosen = via_torch;
  }
  if (chosen->error) return api->CreateStatus(ORT_FAIL, api->GetErrorMessage(chosen->error));
  return api->AddCustomOpDomain(options, chosen->domain);
}
