// The entry point ONNX Runtime calls when the library is registered with a session:
// SessionOptions.register_custom_ops_library(ortbridge.library_path()).
#include <cstdio>
#include <mutex>
#include <string>

#include <onnxruntime_cxx_api.h>

#include "custom_op.h"

namespace ortbridge {

const OrtCustomOp* PythonOp();
const OrtCustomOp* PythonOpGrad();

namespace {
const OrtApi* g_api = nullptr;
}

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
  // One domain serves every session; ORT keeps pointers to it, so it lives as long as the process.
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* domain_error = nullptr;
  static std::once_flag once;
  std::call_once(once, [&] {
    g_api = api;
    Ort::InitApi(api);
    domain_error = api->CreateCustomOpDomain(kDomain, &domain);
    if (!domain_error) domain_error = api->CustomOpDomain_Add(domain, PythonOp());
    if (!domain_error) domain_error = api->CustomOpDomain_Add(domain, PythonOpGrad());
  });
  if (domain_error) return api->CreateStatus(ORT_FAIL, api->GetErrorMessage(domain_error));
  return api->AddCustomOpDomain(options, domain);
}
