// The torch operators' C++ side (operators.cpp): torch.ops.arfuse.shm_fused_allreduce(_functional),
// the compiled graph's CPU route, the conversion of operator arguments, and the Python error
// bridge that both the operators and the module (bindings.cpp) raise through.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

#include "comm.h"

namespace arfuse {

// The classes build.py hands over once (arfuse.errors); the Python error of a ShmError.
void set_error_types(py::object timeout, py::object mismatch, py::object broken);
void set_python_error(const ShmError& e);

// One call's tensors and scalars, as the operator and ShmComm.run take them.
Tensors tensors_of(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& out,
                   const std::optional<at::Tensor>& residual_out);
Numbers numbers_of(double eps, double weight_bias, int64_t quant, double scale,
                   int64_t group_size = 0);

// finish.cpp: the rank-order sum of `parts` and the epilogue, in this process's memory alone
// (out, residual_out, quant_out, scale_out; the absent ones undefined).
std::vector<at::Tensor> finish_parts(const std::vector<at::Tensor>& parts,
                                     const std::optional<at::Tensor>& residual,
                                     const std::optional<at::Tensor>& weight, double eps,
                                     double weight_bias, int64_t quant, double scale,
                                     const std::optional<at::Tensor>& out,
                                     const std::optional<at::Tensor>& residual_out,
                                     int64_t group_size);

void register_torch_ops();
void register_compiled_ops(py::object python, py::object python_fp8);
void set_compiled_route(const std::string& group, at::ScalarType dtype, int64_t hidden,
                        int64_t handle, int64_t op, int64_t capacity);
void drop_compiled_route(const std::string& group, at::ScalarType dtype, int64_t hidden,
                         int64_t handle);
int64_t compiled_route_calls(const std::string& group, at::ScalarType dtype, int64_t hidden);

}  // namespace arfuse
