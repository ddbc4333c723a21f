# Finds ONNX Runtime's C API header (onnxruntime_c_api.h). Sets ORT_INCLUDE_DIR.
# Search order: -DORT_INCLUDE_DIR, the ORT_INCLUDE_DIR environment variable, the system include
# path, then third_party/onnxruntime/include (filled by scripts/fetch_ort_headers.sh).
if(NOT ORT_INCLUDE_DIR AND DEFINED ENV{ORT_INCLUDE_DIR})
  set(ORT_INCLUDE_DIR "$ENV{ORT_INCLUDE_DIR}")
endif()
find_path(ORT_INCLUDE_DIR onnxruntime_c_api.h
  PATH_SUFFIXES onnxruntime onnxruntime/core/session
  HINTS ${ORT_INCLUDE_DIR}
  PATHS ${CMAKE_CURRENT_LIST_DIR}/../third_party/onnxruntime/include)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(OrtHeaders
  REQUIRED_VARS ORT_INCLUDE_DIR
  FAIL_MESSAGE "ONNX Runtime's C headers (onnxruntime_c_api.h) were not found. Run scripts/fetch_ort_headers.sh \
(takes them from Debian's libonnxruntime-dev into third_party/), install libonnxruntime-dev, or point \
-DORT_INCLUDE_DIR / the ORT_INCLUDE_DIR environment variable at a folder holding them.")
mark_as_advanced(ORT_INCLUDE_DIR)
