// A C++ host that embeds Python and runs a PythonOp node through ONNX Runtime's C API, the way
// an application without onnxruntime's Python API would: ORT's C library is dlopen'ed from the
// installed onnxruntime wheel and the ortbridge library is registered with it by path.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <onnxruntime_c_api.h>
#include <pybind11/embed.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

// The Functions under test and the model builder, run once in __main__.
constexpr const char* kPythonSetup = R"(
import glob
import os

import onnxruntime  # only to locate the C library its wheel ships
import torch
from onnx import TensorProto, helper

import ortbridge


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2 + 1

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Picky(Twice):
    @staticmethod
    def forward(ctx, x):
        if bool((x < 0).any()):
            raise ValueError("Picky refuses negative input")
        return x * 2 + 1


ortbridge.register(Twice, name="test.Twice")
ortbridge.register(Picky, name="test.Picky")


def ort_library():
    capi = os.path.join(os.path.dirname(onnxruntime.__file__), "capi")
    found = sorted(glob.glob(os.path.join(capi, "libonnxruntime.so*")))
    if not found:
        raise FileNotFoundError(f"no libonnxruntime.so* in {capi}")
    return found[0]


def python_op_model(func_name, training_mode):
    node = helper.make_node(
        "PythonOp", ["x"], ["ctx", "y"], name="twice", domain="ortbridge", func_name=func_name,
        input_convention="d", input_tensor_types=[TensorProto.FLOAT], input_tensor_ranks=[1],
        output_tensor_types=[TensorProto.FLOAT], output_tensor_ranks=[1], training_mode=training_mode)
    graph = helper.make_graph(
        [node], "python_op", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("ctx", TensorProto.INT64, []),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ortbridge", 1)])
    model.ir_version = 8  # opset 17's IR version, which any ORT that has the V2 API reads
    return model.SerializeToString()
)";

const OrtApi* g_api = nullptr;
OrtEnv* g_env = nullptr;

// The message of `status` ("" for success); releases it.
std::string Message(OrtStatus* status) {
  if (!status) return "";
  std::string message = g_api->GetErrorMessage(status);
  g_api->ReleaseStatus(status);
  return message;
}

template <class T, auto Release>
struct Releaser {
  void operator()(T* p) const { (g_api->*Release)(p); }
};
using SessionOptions =
    std::unique_ptr<OrtSessionOptions, Releaser<OrtSessionOptions, &OrtApi::ReleaseSessionOptions>>;
using Session = std::unique_ptr<OrtSession, Releaser<OrtSession, &OrtApi::ReleaseSession>>;
using Value = std::unique_ptr<OrtValue, Releaser<OrtValue, &OrtApi::ReleaseValue>>;
using MemoryInfo = std::unique_ptr<OrtMemoryInfo, Releaser<OrtMemoryInfo, &OrtApi::ReleaseMemoryInfo>>;
using ShapeInfo =
    std::unique_ptr<OrtTensorTypeAndShapeInfo,
                    Releaser<OrtTensorTypeAndShapeInfo, &OrtApi::ReleaseTensorTypeAndShapeInfo>>;

// One interpreter per process (gtest_discover_tests runs each test in a process of its own).
// The main thread holds the GIL except inside ORT calls, which may enter the kernels.
class EmbeddedRuntime : public ::testing::Environment {
 public:
  void SetUp() override {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.parse_argv = 0;
    // Start as the configured interpreter, so that its prefix (a venv's included) is found.
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, ORTBRIDGE_TEST_PYTHON);
    ASSERT_FALSE(PyStatus_Exception(status));
    interpreter_ = std::make_unique<py::scoped_interpreter>(&config);
    std::string library;
    try {
      py::exec(kPythonSetup);
      library = py::eval("ort_library()").cast<std::string>();
    } catch (const py::error_already_set& e) {
      FAIL() << "Python setup failed: " << e.what();
    }

    // RTLD_LOCAL: the onnxruntime Python module (imported by ortbridge) holds a copy of ORT of
    // its own, and the two must not resolve symbols against each other. Never unloaded.
    void* ort = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(ort, nullptr) << dlerror();
    auto get_api_base = reinterpret_cast<const OrtApiBase*(ORT_API_CALL*)()>(dlsym(ort, "OrtGetApiBase"));
    ASSERT_NE(get_api_base, nullptr) << dlerror();
    const OrtApiBase* base = get_api_base();
    g_api = base->GetApi(ORT_API_VERSION);
    ASSERT_NE(g_api, nullptr) << library << " (ONNX Runtime " << base->GetVersionString()
                              << ") does not offer C API version " << ORT_API_VERSION << " of the headers";
    // Errors reach the tests as statuses; ORT's log would only repeat the expected ones.
    ASSERT_EQ(Message(g_api->CreateEnv(ORT_LOGGING_LEVEL_FATAL, "ortbridge_test", &g_env)), "");
  }

  void TearDown() override {
    if (g_env) g_api->ReleaseEnv(g_env);
    g_env = nullptr;
    interpreter_.reset();
  }

 private:
  std::unique_ptr<py::scoped_interpreter> interpreter_;
};

::testing::Environment* const g_environment = ::testing::AddGlobalTestEnvironment(new EmbeddedRuntime);

std::string Model(const std::string& func_name, int training_mode = 0) {
  return py::globals()["python_op_model"](func_name, training_mode).cast<std::string>();
}

// Creates a session with the ortbridge kernels; returns ORT's error message, "" on success.
std::string CreateSession(const std::string& model, Session* session) {
  OrtSessionOptions* raw_options = nullptr;
  std::string error = Message(g_api->CreateSessionOptions(&raw_options));
  if (!error.empty()) return error;
  SessionOptions options(raw_options);
  error = Message(g_api->SetIntraOpNumThreads(options.get(), 1));
  if (error.empty()) {
    const std::string library = py::module_::import("ortbridge").attr("library_path")().cast<std::string>();
    error = Message(g_api->RegisterCustomOpsLibrary_V2(options.get(), library.c_str()));
  }
  if (!error.empty()) return error;
  OrtSession* raw_session = nullptr;
  {
    py::gil_scoped_release no_gil;  // session creation builds the kernels, which take the GIL
    error = Message(
        g_api->CreateSessionFromArray(g_env, model.data(), model.size(), options.get(), &raw_session));
  }
  session->reset(raw_session);
  return error;
}

struct Outputs {
  int64_t ctx = -1;
  std::vector<float> y;
};

// Runs the one-node model on x; returns ORT's error message, "" on success.
std::string RunModel(OrtSession* session, std::vector<float> x, Outputs* out) {
  OrtMemoryInfo* raw_info = nullptr;
  std::string error = Message(g_api->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &raw_info));
  if (!error.empty()) return error;
  MemoryInfo info(raw_info);
  const int64_t shape[] = {static_cast<int64_t>(x.size())};
  OrtValue* raw_input = nullptr;
  error = Message(g_api->CreateTensorWithDataAsOrtValue(info.get(), x.data(), x.size() * sizeof(float), shape,
                                                        1, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, &raw_input));
  if (!error.empty()) return error;
  Value input(raw_input);

  const char* input_names[] = {"x"};
  const char* output_names[] = {"ctx", "y"};
  const OrtValue* inputs[] = {input.get()};
  OrtValue* raw_outputs[] = {nullptr, nullptr};
  {
    py::gil_scoped_release no_gil;  // the kernel takes the GIL itself
    error = Message(g_api->Run(session, nullptr, input_names, inputs, 1, output_names, 2, raw_outputs));
  }
  Value ctx(raw_outputs[0]), y(raw_outputs[1]);
  if (!error.empty()) return error;

  void* data = nullptr;
  if (!(error = Message(g_api->GetTensorMutableData(ctx.get(), &data))).empty()) return error;
  out->ctx = *static_cast<int64_t*>(data);
  OrtTensorTypeAndShapeInfo* raw_shape = nullptr;
  if (!(error = Message(g_api->GetTensorTypeAndShape(y.get(), &raw_shape))).empty()) return error;
  ShapeInfo y_shape(raw_shape);
  size_t count = 0;
  if (!(error = Message(g_api->GetTensorShapeElementCount(y_shape.get(), &count))).empty()) return error;
  if (!(error = Message(g_api->GetTensorMutableData(y.get(), &data))).empty()) return error;
  out->y.assign(static_cast<float*>(data), static_cast<float*>(data) + count);
  return "";
}

std::vector<float> TwicePlusOne(const std::vector<float>& x) {
  std::vector<float> y;
  for (float v : x) y.push_back(v * 2 + 1);
  return y;
}

TEST(EmbeddedOrt, RunsPythonOp) {
  Session session;
  ASSERT_EQ(CreateSession(Model("test.Twice"), &session), "");
  // Two runs of different lengths: the kernel reads each input's actual shape.
  for (const std::vector<float>& x :
       {std::vector<float>{1.0f, -2.5f, 0.0f, 3.0f}, std::vector<float>{7.0f}}) {
    Outputs out;
    ASSERT_EQ(RunModel(session.get(), x, &out), "");
    EXPECT_EQ(out.ctx, 0);  // no autograd context outside training mode
    EXPECT_EQ(out.y, TwicePlusOne(x));
  }
}

TEST(EmbeddedOrt, TrainingModeKeepsContextUntilReleased) {
  Session session;
  ASSERT_EQ(CreateSession(Model("test.Twice", /*training_mode=*/1), &session), "");
  py::module_ ortbridge = py::module_::import("ortbridge");
  const size_t before = ortbridge.attr("context_pool_size")().cast<size_t>();
  Outputs out;
  ASSERT_EQ(RunModel(session.get(), {2.0f}, &out), "");
  EXPECT_EQ(out.y, (std::vector<float>{5.0f}));
  EXPECT_NE(out.ctx, 0);
  EXPECT_EQ(ortbridge.attr("context_pool_size")().cast<size_t>(), before + 1);
  EXPECT_TRUE(ortbridge.attr("release_context")(out.ctx).cast<bool>());
  EXPECT_FALSE(ortbridge.attr("release_context")(out.ctx).cast<bool>());
  EXPECT_EQ(ortbridge.attr("context_pool_size")().cast<size_t>(), before);
}

TEST(EmbeddedOrt, UnregisteredFunctionFailsAtSessionCreation) {
  Session session;
  const std::string error = CreateSession(Model("test.NeverRegistered"), &session);
  EXPECT_NE(error.find("test.NeverRegistered"), std::string::npos) << error;
  EXPECT_NE(error.find("no Function is registered under that name"), std::string::npos) << error;
  EXPECT_EQ(session.get(), nullptr);
}

TEST(EmbeddedOrt, PythonExceptionFailsRunAndSessionRecovers) {
  Session session;
  ASSERT_EQ(CreateSession(Model("test.Picky"), &session), "");
  Outputs out;
  const std::string error = RunModel(session.get(), {1.0f, -1.0f}, &out);
  EXPECT_NE(error.find("ValueError: Picky refuses negative input"), std::string::npos) << error;
  EXPECT_NE(error.find("Traceback"), std::string::npos) << error;

  ASSERT_EQ(RunModel(session.get(), {1.0f, 2.0f}, &out), "");
  EXPECT_EQ(out.y, (std::vector<float>{3.0f, 5.0f}));
}

}  // namespace
