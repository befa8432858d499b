// finish_parts: the sum and epilogue of a call whose rows were exchanged by other means than
// the segment (the torch backend's collectives, hier's link step): every rank's rows added in
// rank order in fp32 and finished as a shm call finishes its rows (rows.h), in this process's
// memory alone. The bytes are the shm call's, so a row's result does not depend on the path.
#include "comm.h"
#include "float_env.h"
#include "operators.h"
#include "rows.h"

#include <optional>
#include <vector>

namespace arfuse {
namespace {

int kernel_dtype(at::ScalarType type) {
  return type == at::kBFloat16 ? kBF16 : type == at::kHalf ? kFP16 : kFP32;
}

}  // namespace

std::vector<at::Tensor> finish_parts(const std::vector<at::Tensor>& parts,
                                     const std::optional<at::Tensor>& residual,
                                     const std::optional<at::Tensor>& weight, double eps,
                                     double weight_bias, int64_t quant, double scale,
                                     const std::optional<at::Tensor>& out,
                                     const std::optional<at::Tensor>& residual_out,
                                     int64_t group_size) {
  TORCH_CHECK_VALUE(!parts.empty() && int64_t(parts.size()) <= layout::kMaxWorld,
                    "arfuse finish_parts: parts must hold 1..", layout::kMaxWorld, " tensors");
  const at::Tensor& first = parts[0];
  const at::ScalarType type = first.scalar_type();
  TORCH_CHECK_VALUE(first.dim() == 2 && first.device().is_cpu() &&
                        (type == at::kBFloat16 || type == at::kHalf || type == at::kFloat),
                    "arfuse finish_parts: parts must be 2-D CPU tensors of bf16, fp16 or fp32");
  const int64_t tokens = first.size(0), hidden = first.size(1);
  auto like = [&](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous() &&
           t.dim() == 2 && t.size(0) == tokens && t.size(1) == hidden;
  };
  std::vector<const void*> inputs;
  for (const at::Tensor& p : parts) {
    TORCH_CHECK_VALUE(like(p), "arfuse finish_parts: every part must be contiguous and shaped, "
                      "typed and placed like the first");
    inputs.push_back(p.data_ptr());
  }
  for (const auto* t : {&residual, &out, &residual_out}) {
    TORCH_CHECK_VALUE(!*t || like(**t), "arfuse finish_parts: residual, out and residual_out "
                      "must be contiguous and shaped, typed and placed like the parts");
  }
  TORCH_CHECK_VALUE(!weight || (weight->dim() == 1 && weight->size(0) == hidden &&
                                weight->scalar_type() == type && weight->is_contiguous() &&
                                weight->device().is_cpu()),
                    "arfuse finish_parts: weight must be contiguous [hidden] of the parts' dtype");
  const Numbers n = numbers_of(eps, weight_bias, quant, scale, group_size);
  TORCH_CHECK_VALUE(n.output >= 0, "arfuse finish_parts: quant ", quant,
                    " is not the code of an output");
  std::array<at::Tensor, 4> r;
  auto& [result, result_residual, quant_out, scale_out] = r;
  Call c;
  c.tokens = tokens;
  c.hidden = hidden;
  c.residual = residual ? residual->data_ptr() : nullptr;
  c.weight = weight ? weight->data_ptr() : nullptr;
  c.eps = float(n.eps);
  c.weight_bias = float(n.weight_bias);
  c.output = n.output;
  c.scale = float(n.scale);
  c.group_size = n.group_size;
  result = out ? *out : at::empty({tokens, hidden}, first.options());
  c.out = result.data_ptr();
  if (weight) {
    result_residual = residual_out ? *residual_out : at::empty({tokens, hidden}, first.options());
    c.residual_out = result_residual.data_ptr();
  }
  make_quant_outputs(n, tokens, hidden, first.options(),
                     [](at::IntArrayRef shape, const at::TensorOptions& options) {
                       return at::empty(shape, options);
                     }, &quant_out, &scale_out, &c);
  std::vector<float> gain(weight ? size_t(hidden) : 0);
  c.gain = gain.data();
  {
    const DefaultFloatEnv float_env;  // the documented formula, whatever the caller's
    py::gil_scoped_release no_gil;
    const int dtype = kernel_dtype(type);
    auto run = [&](auto tag) {
      constexpr int D = decltype(tag)::value;
      using T = typename Elem<D>::T;
      if (weight) compute_gain<D>(static_cast<const T*>(c.weight), c.weight_bias, hidden,
                                  gain.data());
      finish_rows<D>(reinterpret_cast<const T* const*>(inputs.data()), int(inputs.size()), 0,
                     0, tokens, c, static_cast<T*>(c.out), static_cast<T*>(c.residual_out));
    };
    switch (dtype) {
      case kBF16: run(std::integral_constant<int, kBF16>{}); break;
      case kFP16: run(std::integral_constant<int, kFP16>{}); break;
      default: run(std::integral_constant<int, kFP32>{}); break;
    }
  }
  return std::vector<at::Tensor>(r.begin(), r.end());
}

}  // namespace arfuse
