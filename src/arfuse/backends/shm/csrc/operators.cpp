// The torch operators (operators.h): torch.ops.arfuse.shm_fused_allreduce(_functional) and the
// compiled graph's CPU route, and the Python error bridge.
//
// Errors: the kernel throws ShmError; here it becomes arfuse.errors.CallTimeout (timeout, dead
// peer), MismatchedCall or WorkspaceBroken, the classes build.py hands over once through
// set_error_types (RuntimeError before that).
#include "operators.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>

namespace arfuse {

PyObject* g_error_types[3] = {nullptr, nullptr, nullptr};  // by ShmError::Kind; never freed

void set_error_types(py::object timeout, py::object mismatch, py::object broken) {
  PyObject* given[3] = {timeout.ptr(), mismatch.ptr(), broken.ptr()};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(PyType_Check(given[i]) && PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(
                                              given[i]), reinterpret_cast<PyTypeObject*>(
                                              PyExc_Exception)),
                "arfuse shm: error types must be exception classes");
    Py_INCREF(given[i]);
    Py_XDECREF(g_error_types[i]);
    g_error_types[i] = given[i];
  }
}

// Sets the Python error for e (the GIL held). CallTimeout takes its ready-made text as
// message= and the silent ranks; the others take the text.
void set_python_error(const ShmError& e) {
  PyObject* type = g_error_types[e.kind];
  if (type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return;
  }
  try {
    py::object cls = py::reinterpret_borrow<py::object>(type);
    py::object error;
    if (e.kind == ShmError::kTimeout) {
      py::list silent;
      for (int r : e.silent) silent.append(r);
      error = cls(py::arg("phase") = "call", py::arg("backend") = "shm",
                  py::arg("silent") = silent, py::arg("timeout_s") = e.timeout_s,
                  py::arg("message") = e.what());
    } else {
      error = cls(e.what());
    }
    PyErr_SetObject(type, error.ptr());
  } catch (py::error_already_set& failed) {  // the class refused its arguments: say so
    failed.restore();
  }
}

// For the torch operator: torch releases the GIL around operators, and maps only its own C++
// errors to Python classes, so the Python error is made here and travels as
// py::error_already_set, which torch's and pybind11's handlers restore as is.
[[noreturn]] void raise_python(const ShmError& e) {
  if (!Py_IsInitialized()) throw std::runtime_error(e.what());
  py::gil_scoped_acquire gil;
  set_python_error(e);
  throw py::error_already_set();
}

Tensors tensors_of(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& out,
                   const std::optional<at::Tensor>& residual_out) {
  Tensors t;
  t.x = &x;
  t.residual = residual ? &*residual : nullptr;
  t.weight = weight ? &*weight : nullptr;
  t.out = out ? &*out : nullptr;
  t.residual_out = residual_out ? &*residual_out : nullptr;
  return t;
}

Numbers numbers_of(double eps, double weight_bias, int64_t quant, double scale,
                   int64_t group_size) {
  Numbers n;
  n.group_size = group_size;
  n.eps = eps;
  n.weight_bias = weight_bias;
  n.output = quant_output(quant) != nullptr ? int(quant) : -1;  // -1: refused by the checks
  n.scale = scale;
  return n;
}

// torch.ops.arfuse.shm_fused_allreduce: [out] (+ [residual_out] with weight) (+ [quant_out]
// and [scale_out] where the output's row of kQuantOutputs has them); `quant` is the output code
// (signature.h); see ShmWorkspace.handle in workspace.py.
std::vector<at::Tensor> op_fused_allreduce(
    int64_t handle, const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, double eps, double weight_bias, int64_t quant,
    double scale, const std::optional<at::Tensor>& out,
    const std::optional<at::Tensor>& residual_out, int64_t group_size) {
  const std::shared_ptr<ShmComm> comm = ShmComm::find(handle);
  TORCH_CHECK_VALUE(comm != nullptr, "arfuse shm: no live workspace has handle ", handle);
  // checked before any rank meets its peers, so every rank refuses alike and none waits
  TORCH_CHECK_VALUE(!comm->residual_checked(), "arfuse shm: handle ", handle,
                    " belongs to an op made with replicated_residual='check', whose check "
                    "across ranks the torch operator cannot do; call the op (FusedAllReduce) "
                    "instead, or make it with replicated_residual=True");
  const Tensors t = tensors_of(x, residual, weight, out, residual_out);
  const Numbers n = numbers_of(eps, weight_bias, quant, scale, group_size);
  std::array<at::Tensor, 4> r;
  try {
    r = comm->run(t, n, Py_IsInitialized() && PyGILState_Check());
  } catch (const ShmError& e) {
    raise_python(e);
  }
  std::vector<at::Tensor> list{r[0]};
  if (weight) list.push_back(r[1]);
  const QuantOutput& q = *quant_output(n.output);  // the checks refused any other
  if (q.data_type != kQuantTypeNone) list.push_back(r[2]);
  if (q.scale_type != kQuantTypeNone) list.push_back(r[3]);
  return list;
}

std::vector<at::Tensor> op_fused_allreduce_functional(
    int64_t handle, const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, double eps, double weight_bias, int64_t quant,
    double scale, int64_t group_size) {
  return op_fused_allreduce(handle, x, residual, weight, eps, weight_bias, quant, scale,
                            std::nullopt, std::nullopt, group_size);
}

// Registered when the module loads rather than by a static TORCH_LIBRARY block: loading a
// second build of this kernel in the same process (another cache entry) would then abort in
// a static initializer; here the first build keeps the operator and the second skips it.
void register_torch_ops() {
  static bool done = false;
  if (done) return;
  done = true;
  if (c10::Dispatcher::singleton().findSchema({"arfuse::shm_fused_allreduce", ""})) return;
  auto* def = new torch::Library(torch::Library::FRAGMENT, "arfuse", std::nullopt, __FILE__,
                                 __LINE__);  // never freed: the operator lives with the process
  def->def("shm_fused_allreduce(int handle, Tensor x, Tensor? residual, Tensor? weight, "
           "float eps, float weight_bias, int quant, float scale, "
           "Tensor(a!)? out, Tensor(b!)? residual_out, int group_size=0) -> Tensor[]");
  def->def("shm_fused_allreduce_functional(int handle, Tensor x, Tensor? residual, "
           "Tensor? weight, float eps, float weight_bias, int quant, float scale, "
           "int group_size=0) -> Tensor[]");
  auto* impl = new torch::Library(torch::Library::IMPL, "arfuse", c10::DispatchKey::CPU,
                                  __FILE__, __LINE__);
  impl->impl("shm_fused_allreduce", TORCH_FN(op_fused_allreduce));
  impl->impl("shm_fused_allreduce_functional", TORCH_FN(op_fused_allreduce_functional));
}

// ---- torch.ops.arfuse.compiled_fused_allreduce(_fp8) on CPU ----------------------------------
//
// The operators the torch.compile pass puts in a graph (arfuse/compile/runtime.py defines them
// and their Python implementation). A graph calls one per chain every step, right after
// matmuls that have evicted the caches, where a trip through Python's dispatch and arfuse's
// Python code costs more than the kernel's own work. Here a route (the shm op runtime.py
// negotiated for a group, dtype and hidden size, entered once it exists) leads straight to the
// kernel with the fast path's checks; any other call (no route yet, a larger capacity,
// anything the fast path declines) runs the Python implementation, which negotiates, enters
// routes and falls back as the Python operator always did.

struct CompiledRoute {
  std::weak_ptr<ShmComm> comm;
  int64_t handle = 0, op = 0, capacity = 0;
  std::atomic<int64_t> calls{0};  // the calls this route ran (runtime.py counts the others)
};

using RouteKey = std::tuple<std::string, int, int64_t>;  // group name, dtype, hidden
std::mutex g_routes_mutex;
std::map<RouteKey, std::shared_ptr<CompiledRoute>> g_routes;
PyObject* g_compiled_python = nullptr;  // runtime._run; never freed
PyObject* g_compiled_python_fp8 = nullptr;  // runtime._run_fp8; never freed

RouteKey route_key(c10::string_view group, at::ScalarType dtype, int64_t hidden) {
  return {std::string(group.data(), group.size()), int(dtype), hidden};
}

std::shared_ptr<CompiledRoute> find_route(const RouteKey& key) {
  const std::lock_guard<std::mutex> lock(g_routes_mutex);
  auto it = g_routes.find(key);
  return it == g_routes.end() ? nullptr : it->second;
}

void set_compiled_route(const std::string& group, at::ScalarType dtype, int64_t hidden,
                        int64_t handle, int64_t op, int64_t capacity) {
  std::shared_ptr<ShmComm> comm = ShmComm::find(handle);
  TORCH_CHECK_VALUE(comm != nullptr, "arfuse shm: no live workspace has handle ", handle);
  auto route = std::make_shared<CompiledRoute>();
  route->comm = comm;
  route->handle = handle;
  route->op = op;
  route->capacity = capacity;
  const std::lock_guard<std::mutex> lock(g_routes_mutex);
  g_routes[route_key(group, dtype, hidden)] = route;
}

// Removes the route if it still leads to `handle` (a later one of the key stays).
void drop_compiled_route(const std::string& group, at::ScalarType dtype, int64_t hidden,
                         int64_t handle) {
  const std::lock_guard<std::mutex> lock(g_routes_mutex);
  auto it = g_routes.find(route_key(group, dtype, hidden));
  if (it != g_routes.end() && it->second->handle == handle) g_routes.erase(it);
}

int64_t compiled_route_calls(const std::string& group, at::ScalarType dtype, int64_t hidden) {
  std::shared_ptr<CompiledRoute> route = find_route(route_key(group, dtype, hidden));
  return route ? route->calls.load() : 0;
}

py::object optional_object(const std::optional<at::Tensor>& t) {
  return t ? py::cast(*t) : py::none();
}

// A chain's call on its route: true with r's outputs shaped as x, or false (nothing run) when
// the Python implementation must take it. scale: the FP8 operator's (else null).
bool run_routed(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                const at::Tensor& weight, double eps, double weight_bias,
                c10::string_view group_name, int64_t capacity,
                const std::optional<at::Tensor>& eps_input, const at::Tensor* scale,
                std::array<at::Tensor, 4>* r) {
  std::shared_ptr<CompiledRoute> route =
      x.dim() >= 1 ? find_route(route_key(group_name, x.scalar_type(), x.size(-1))) : nullptr;
  std::shared_ptr<ShmComm> comm = route ? route->comm.lock() : nullptr;
  if (!comm || route->capacity < capacity) return false;
  Numbers n;
  if (scale) {  // the pass matches a one-element fp32 scale; anything else: Python's checks
    if (!scale->is_cpu() || scale->numel() != 1 || scale->scalar_type() != at::kFloat) {
      return false;
    }
    n.output = kOutputFp8;
    n.scale = scale->item<double>();
  }
  // as runtime.py's Python path: [tokens, hidden] rows, eps from the graph's fp32 input
  const bool rows = x.dim() == 2;
  const at::Tensor x2 = rows ? x.contiguous() : x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor residual2;
  if (residual) {
    residual2 = rows ? residual->contiguous() : residual->reshape({-1, x.size(-1)}).contiguous();
  }
  n.eps = eps_input ? eps_input->to(at::kFloat).item<double>() : eps;
  n.weight_bias = weight_bias;
  n.op = route->op;
  Tensors t;
  t.x = &x2;
  t.residual = residual ? &residual2 : nullptr;
  t.weight = &weight;
  try {
    if (!comm->try_run(t, n, Py_IsInitialized() && PyGILState_Check(), r)) return false;
  } catch (const ShmError& e) {
    raise_python(e);
  }
  route->calls.fetch_add(1, std::memory_order_relaxed);
  if (!rows) {
    for (int i = 0; i < (scale ? 3 : 2); ++i) (*r)[i] = (*r)[i].view(x.sizes());
  }
  return true;
}

// The Python implementation (runtime._run or _run_fp8) for a call no route took; every Python
// object made here dies before the GIL is let go.
template <typename Result>
Result run_in_python(PyObject* python, const at::Tensor& x,
                     const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                     double eps, double weight_bias, c10::string_view group_name,
                     int64_t capacity, int64_t form, const std::optional<at::Tensor>& eps_input,
                     const at::Tensor* scale) {
  TORCH_CHECK(python != nullptr, "arfuse shm: compiled operator not set up");
  py::gil_scoped_acquire gil;
  py::object group = py::str(std::string(group_name.data(), group_name.size()));
  py::object fn = py::reinterpret_borrow<py::object>(python);
  py::object result =
      scale ? fn(x, optional_object(residual), weight, eps, weight_bias, group, capacity, form,
                 *scale, optional_object(eps_input))
            : fn(x, optional_object(residual), weight, eps, weight_bias, group, capacity, form,
                 optional_object(eps_input));
  return result.cast<Result>();
}

std::tuple<at::Tensor, at::Tensor> compiled_fused_allreduce(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps, double weight_bias, c10::string_view group_name, int64_t capacity,
    int64_t form, const std::optional<at::Tensor>& eps_input) {
  std::array<at::Tensor, 4> r;
  if (run_routed(x, residual, weight, eps, weight_bias, group_name, capacity, eps_input,
                 nullptr, &r)) {
    return {r[0], r[1]};
  }
  return run_in_python<std::tuple<at::Tensor, at::Tensor>>(
      g_compiled_python, x, residual, weight, eps, weight_bias, group_name, capacity, form,
      eps_input, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> compiled_fused_allreduce_fp8(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
    double eps, double weight_bias, c10::string_view group_name, int64_t capacity,
    int64_t form, const at::Tensor& scale, const std::optional<at::Tensor>& eps_input) {
  std::array<at::Tensor, 4> r;
  if (run_routed(x, residual, weight, eps, weight_bias, group_name, capacity, eps_input,
                 &scale, &r)) {
    return {r[0], r[1], r[2]};
  }
  return run_in_python<std::tuple<at::Tensor, at::Tensor, at::Tensor>>(
      g_compiled_python_fp8, x, residual, weight, eps, weight_bias, group_name, capacity, form,
      eps_input, &scale);
}

// Gives the two operators (defined in Python before this is called) these CPU kernels, once
// per process, with their Python implementations for what the routes do not take.
void register_compiled_ops(py::object python, py::object python_fp8) {
  static bool done = false;
  if (done) return;
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto op = dispatcher.findSchema({"arfuse::compiled_fused_allreduce", ""});
  const auto op_fp8 = dispatcher.findSchema({"arfuse::compiled_fused_allreduce_fp8", ""});
  TORCH_CHECK(op.has_value() && op_fp8.has_value(), "arfuse shm: the compiled operators are "
              "not defined (arfuse.compile.runtime.register defines them)");
  done = true;
  if (op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return;  // another build's
  g_compiled_python = python.release().ptr();
  g_compiled_python_fp8 = python_fp8.release().ptr();
  auto* impl = new torch::Library(torch::Library::IMPL, "arfuse", c10::DispatchKey::CPU,
                                  __FILE__, __LINE__);  // never freed, as register_torch_ops
  impl->impl("compiled_fused_allreduce", TORCH_FN(compiled_fused_allreduce));
  impl->impl("compiled_fused_allreduce_fp8", TORCH_FN(compiled_fused_allreduce_fp8));
}

}  // namespace arfuse
