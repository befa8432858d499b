// The Python module (pybind11): ShmComm, the constants and tables as compiled, and the test and
// measurement hooks (the torch operators and the error bridge: operators.cpp).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "comm.h"
#include "moe.h"
#include "operators.h"

namespace arfuse {
namespace {

py::dict slot_geometry(int64_t world, int64_t max_tokens, int64_t hidden, int64_t elem) {
  const layout::SlotGeometry g = layout::slot_geometry(world, max_tokens, hidden, elem);
  py::dict d;
  d["chunk_rows"] = g.chunk_rows;
  d["input_bytes"] = g.input_bytes;
  d["result_bytes"] = g.result_bytes;
  d["slot_bytes"] = g.slot_bytes;
  d["total_bytes"] = g.total_bytes;
  return d;
}

// Test hook: NVFP4 of a [T, H] bf16/fp16 tensor by the vector or the scalar block code, linear
// scales. Returns (codes [T, H/2], scales [T, H/16]).
template <int D>
void nvfp4_rows(const at::Tensor& x, double gs, bool vector, at::Tensor& q, at::Tensor& s) {
  using T = typename Elem<D>::T;
  const int64_t rows = x.size(0), cols = x.size(1) / 16;
  const T* v = static_cast<const T*>(x.data_ptr());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < cols; ++k) {
      const T* block = v + (r * cols + k) * 16;
      uint8_t* codes = q.data_ptr<uint8_t>() + (r * cols + k) * 8;
      uint8_t* sf = s.data_ptr<uint8_t>() + r * cols + k;
      if (vector) {
        TORCH_CHECK(isa::nvfp4_block<D>(block, float(gs), codes, sf),
                    "arfuse shm: no vector form of NVFP4 for this dtype in this build");
      } else {
        nvfp4_block_scalar<D>(block, float(gs), codes, sf);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> nvfp4_quantize(const at::Tensor& x, double gs, bool vector) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % 16 == 0 && x.is_cpu() && x.is_contiguous() &&
                        (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
                    "nvfp4_quantize: x must be a contiguous CPU [T, 16k] bf16/fp16 tensor");
  at::Tensor q = at::empty({x.size(0), x.size(1) / 2}, x.options().dtype(at::kByte));
  at::Tensor s = at::empty({x.size(0), x.size(1) / 16}, x.options().dtype(at::kByte));
  if (x.scalar_type() == at::kBFloat16) nvfp4_rows<kBF16>(x, gs, vector, q, s);
  else nvfp4_rows<kFP16>(x, gs, vector, q, s);
  return {q, s};
}

// Test hook: a float32 tensor rounded to dtype (0 bf16, 1 fp16) by the vector code of this
// build (vector=True; ValueError where it has none) or by the scalar code of conversions.h.
template <int D>
void convert_rows(const float* src, int64_t n, bool vector, typename Elem<D>::T* dst) {
  int64_t h = 0;
  if (vector) {
    TORCH_CHECK_VALUE(isa::Has<D>::value, "round_to: no vector form for this dtype here");
    h = isa::convert_row<D>(src, n, dst);
  }
  for (; h < n; ++h) dst[h] = Elem<D>::store(src[h]);
}

at::Tensor round_to(const at::Tensor& x, int64_t dtype, bool vector) {
  TORCH_CHECK_VALUE(x.dim() == 1 && x.is_cpu() && x.is_contiguous() &&
                        x.scalar_type() == at::kFloat && (dtype == kBF16 || dtype == kFP16),
                    "round_to: x must be a contiguous 1-D CPU float32 tensor, dtype 0 or 1");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(dtype == kBF16 ? at::kBFloat16
                                                                            : at::kHalf));
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (dtype == kBF16) convert_rows<kBF16>(x.data_ptr<float>(), x.size(0), vector, dst);
  else convert_rows<kFP16>(x.data_ptr<float>(), x.size(0), vector, dst);
  return out;
}

// dst = src by the exchange's own memory access: the slot copy (each destination line taken
// for writing ahead) or, with read_ahead, the row passes' way of reading a peer's lines. Lets
// arfuse bench measure the rates of lines shared between cores as the kernel moves them.
void exchange_copy(at::Tensor& dst, const at::Tensor& src, bool read_ahead) {
  TORCH_CHECK_VALUE(dst.is_cpu() && src.is_cpu() && dst.is_contiguous() &&
                        src.is_contiguous() && dst.scalar_type() == at::kByte &&
                        src.scalar_type() == at::kByte && dst.numel() == src.numel(),
                    "exchange_copy: dst and src must be contiguous CPU uint8 tensors of one size");
  char* to = reinterpret_cast<char*>(dst.data_ptr());
  const char* from = reinterpret_cast<const char*>(src.data_ptr());
  if (read_ahead) copy_prefetching<true>(to, from, size_t(src.numel()));
  else copy_prefetching(to, from, size_t(src.numel()));
}

// Module-local: two builds of the kernel (two source trees, see benchmarks/ab_kernels.py) can
// be loaded into one process; the type is only ever used through the module that made it.
void bind_comm(py::module_& m) {
  py::class_<ShmComm, std::shared_ptr<ShmComm>>(m, "ShmComm", py::module_local())
      .def(py::init(&ShmComm::create))
      .def_property_readonly("handle", &ShmComm::handle)
      .def("set_peers", &ShmComm::set_peers)
      .def("set_base", &ShmComm::set_base)
      .def("set_oneshot_bytes", &ShmComm::set_oneshot_bytes)
      .def_property("ring_blocks", &ShmComm::ring_blocks, &ShmComm::set_ring_blocks)
      .def("oneshot", &ShmComm::oneshot)
      .def("next_input_offset", &ShmComm::next_input_offset)
      .def("call", &ShmComm::call, py::arg("x"), py::arg("residual"), py::arg("weight"),
           py::arg("eps"), py::arg("weight_bias"), py::arg("quant"), py::arg("scale"),
           py::arg("layout"), py::arg("out"), py::arg("residual_out"), py::arg("op") = 0,
           py::arg("group_size") = py::none())
      .def("call_moe", &ShmComm::call_moe, py::arg("rows"), py::arg("index"),
           py::arg("scales"), py::arg("add"), py::arg("routed"), py::arg("residual"),
           py::arg("weight"), py::arg("eps"), py::arg("weight_bias"), py::arg("quant"),
           py::arg("scale"), py::arg("layout"), py::arg("out"), py::arg("residual_out"),
           py::arg("op") = 0, py::arg("group_size") = py::none())
      .def("run", [](ShmComm& comm, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                     const std::optional<at::Tensor>& weight, double eps, double weight_bias,
                     int64_t quant, double scale, const std::optional<at::Tensor>& out,
                     const std::optional<at::Tensor>& residual_out, int64_t op, int64_t moe,
                     int64_t group_size) {
        Numbers n = numbers_of(eps, weight_bias, quant, scale, group_size);
        n.op = op;
        n.moe = moe;
        std::array<at::Tensor, 4> r =
            comm.run(tensors_of(x, residual, weight, out, residual_out), n, true);
        return std::vector<at::Tensor>(r.begin(), r.end());
      }, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
           py::arg("weight_bias"), py::arg("quant"), py::arg("scale"), py::arg("out"),
           py::arg("residual_out"), py::arg("op") = 0, py::arg("moe") = 0,
           py::arg("group_size") = 0)
      .def("announce", &ShmComm::announce, py::arg("tokens"), py::arg("pattern"),
           py::arg("op") = 0, py::arg("moe") = 0, py::arg("group_size") = 0)
      .def("set_group", &ShmComm::set_group)
      .def("set_result_type", &ShmComm::set_result_type)
      .def("invalidate", &ShmComm::invalidate)
      .def("set_timing", &ShmComm::set_timing)
      .def("last_call_seconds", &ShmComm::last_call_seconds)
      .def("set_copy_mode", &ShmComm::set_copy_mode)
      .def("set_output_stores", &ShmComm::set_output_stores)
      .def("set_replicated_residual", &ShmComm::set_replicated_residual)
      .def("set_residual_checked", &ShmComm::set_residual_checked)
      .def("replicated_residual", &ShmComm::replicated_residual)
      .def("streams_outputs", &ShmComm::streams_outputs)
      .def("pooled_bytes", &ShmComm::pooled_bytes)
      .def("copy_modes", &ShmComm::copy_modes);
}

}  // namespace
}  // namespace arfuse

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace arfuse;
  init_tables();
  register_torch_ops();
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ShmError& e) {
      set_python_error(e);
    } catch (const c10::ValueError& e) {  // run()'s refusals, as call_checks raises them
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    }
  });
  m.doc() = "arfuse shared-memory fused all-reduce kernel";
  // calls of one size until auto mode has decided its copy mode (warm-up, trial, deciding call)
  m.attr("copy_trial_calls") = py::int_(kTuneWarm + 2 * kTunePairs + 1);
  m.attr("isa") = py::str(isa::kIsa);
  m.def("stream_output_min_bytes", [](int64_t dtype) {
    return isa::stream_output_min_bytes(int(dtype));
  });
  m.def("set_error_types", &set_error_types);
  m.def("slot_geometry", &slot_geometry);
  m.def("describe_signature", &describe_signature);
  m.def("mismatch_message", &mismatch_message);
  m.def("register_compiled_ops", &register_compiled_ops);
  m.def("set_compiled_route", &set_compiled_route, py::arg("group"), py::arg("dtype"),
        py::arg("hidden"), py::arg("handle"), py::arg("op"), py::arg("capacity"));
  m.def("drop_compiled_route", &drop_compiled_route, py::arg("group"), py::arg("dtype"),
        py::arg("hidden"), py::arg("handle"));
  m.def("compiled_route_calls", &compiled_route_calls, py::arg("group"), py::arg("dtype"),
        py::arg("hidden"));
  m.def("checked_numbers", &checked_numbers, py::arg("hidden"), py::arg("dtype"), py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("weight_bias"),
        py::arg("quant"), py::arg("scale"), py::arg("layout"), py::arg("out"),
        py::arg("residual_out"), py::arg("group_size"));
  m.def("finish_parts", &finish_parts, py::arg("parts"), py::arg("residual"), py::arg("weight"),
        py::arg("eps"), py::arg("weight_bias"), py::arg("quant"), py::arg("scale"),
        py::arg("out"), py::arg("residual_out"), py::arg("group_size") = 0);
  m.def("moe_finalize", &moe_finalize, py::arg("dst"), py::arg("expanded"), py::arg("index"),
        py::arg("scales"), py::arg("shared"), py::arg("routed"));
  m.def("moe_reduce", &moe_reduce, py::arg("dst"), py::arg("active"), py::arg("scales"),
        py::arg("token_input"));
  // Not the op: hooks for tests (the vector and scalar conversions side by side) and for arfuse
  // bench's line rates (the exchange's own memory access), kept apart by name.
  py::module_ diagnostics = m.def_submodule("diagnostics", "test and measurement hooks");
  diagnostics.def("nvfp4_quantize", &nvfp4_quantize);
  diagnostics.def("round_to", &round_to);
  diagnostics.def("process_alive", &process_alive, py::arg("pid"), py::arg("start"));
  diagnostics.def("exchange_copy", &exchange_copy);
  diagnostics.def("moe_bits", [](int64_t fan_in, bool shared, int64_t rows, int64_t routed_bits) {
    return signature::moe_bits(fan_in, shared, rows, uint32_t(routed_bits));
  });
  bind_comm(m);
}
