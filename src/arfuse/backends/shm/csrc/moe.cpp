// The MoE expert step's entries (moe.h does the arithmetic): finalize (the permuted expert
// outputs gathered by index) and reduce (expert-major rows), each into a [tokens, hidden]
// destination, in practice this rank's input slot of the call that follows. They check what
// they read (shapes, dtypes, contiguity: ValueError naming the argument; every index in
// [-1, rows): finalize returns the first that is not, in arfuse.moe.index_problem's words, and
// writes nothing), so no input is read out of bounds.
#include "moe.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

#include "float_env.h"
#include "parallel.h"

namespace arfuse {
namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kFP16;
    case at::kFloat: return kFP32;
    default: return -1;
  }
}

void check_dense(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.layout() == at::kStrided && t.dim() == dim &&
                        t.is_contiguous(),
                    "arfuse shm: ", name, " must be a contiguous ", dim, "-D CPU tensor");
}

// The scales as fp32, [tokens * fan_in] in the order the rows take them: their own memory
// when they are fp32 already (no copy on the hot path), else an exact conversion kept in `keep`.
const float* scales_f32(const at::Tensor& scales, at::Tensor* keep) {
  if (scales.scalar_type() == at::kFloat) return scales.data_ptr<float>();  // contiguous
  *keep = scales.to(at::kFloat).contiguous();
  return keep->data_ptr<float>();
}

// Every element of dst depends on its own column only, so the rows (or, with fewer rows than
// threads, column ranges of whole vector steps: parallel.h) go to the rank's threads by the
// same rule as the epilogue's, with the same bytes; `bytes` is what the call reads.
template <int D>
void finalize_rows(char* dst, const char* expanded, const int32_t* index, const float* scales,
                   const char* shared, float routed, int64_t tokens, int fan_in,
                   int64_t hidden) {
  using T = typename Elem<D>::T;
  const int64_t row_bytes = hidden * int64_t(sizeof(T));
  const Plan plan = call_plan(tokens * row_bytes * fan_in, tokens, hidden);
  for_each_part(plan, tokens, hidden, [&](int64_t t0, int64_t t1, int64_t h0, int64_t h1) {
    const int64_t at = h0 * int64_t(sizeof(T));
    const void* rows[signature::kMaxMoeFanIn];
    for (int64_t t = t0; t < t1; ++t) {
      for (int k = 0; k < fan_in; ++k) {
        const int32_t i = index[t * fan_in + k];
        rows[k] = i < 0 ? nullptr : expanded + i * row_bytes + at;
      }
      const ExpertRows e{rows, scales + t * fan_in, fan_in};
      combine_row<D>(e, routed,
                     shared ? reinterpret_cast<const T*>(shared + t * row_bytes + at) : nullptr,
                     reinterpret_cast<T*>(dst + t * row_bytes + at), h1 - h0);
    }
  });
}

template <int D>
void reduce_rows(char* dst, const char* active, const float* scales_et, const char* token_input,
                 int64_t tokens, int experts, int64_t hidden) {
  using T = typename Elem<D>::T;
  const int64_t row_bytes = hidden * int64_t(sizeof(T));
  const Plan plan = call_plan(tokens * row_bytes * experts, tokens, hidden);
  for_each_part(plan, tokens, hidden, [&](int64_t t0, int64_t t1, int64_t h0, int64_t h1) {
    const int64_t at = h0 * int64_t(sizeof(T));
    const void* rows[signature::kMaxMoeFanIn];
    float scales[signature::kMaxMoeFanIn];
    for (int64_t t = t0; t < t1; ++t) {
      for (int e = 0; e < experts; ++e) {  // expert-major: [E, T, H] and [E, T]
        rows[e] = active + (e * tokens + t) * row_bytes + at;
        scales[e] = scales_et[e * tokens + t];
      }
      const ExpertRows rows_of_t{rows, scales, experts};
      combine_row<D>(rows_of_t, 1.0f, reinterpret_cast<const T*>(token_input + t * row_bytes + at),
                     reinterpret_cast<T*>(dst + t * row_bytes + at), h1 - h0);
    }
  });
}

template <typename F>
void by_dtype(int d, F&& f) {
  if (d == kBF16) f(std::integral_constant<int, kBF16>{});
  else if (d == kFP16) f(std::integral_constant<int, kFP16>{});
  else f(std::integral_constant<int, kFP32>{});
}

}  // namespace

// The first index outside [-1, rows), as the error text names it ("" when all are inside).
std::string index_problem(const int32_t* index, int64_t count, int64_t fan_in, int64_t rows) {
  for (int64_t j = 0; j < count; ++j) {
    if (index[j] < -1 || index[j] >= rows) {
      return "expanded_idx_to_permuted_idx[" + std::to_string(j / fan_in) + ", " +
             std::to_string(j % fan_in) + "] = " + std::to_string(index[j]) +
             " is not a row of expanded (it must be -1, for none, or 0.." +
             std::to_string(rows - 1) + ")";
    }
  }
  return "";
}

std::string moe_finalize(const at::Tensor& dst, const at::Tensor& expanded, const at::Tensor& index,
                  const at::Tensor& scales, const std::optional<at::Tensor>& shared,
                  double routed) {
  check_dense(dst, "the destination", 2);
  check_dense(expanded, "expanded", 2);
  check_dense(index, "expanded_idx_to_permuted_idx", 2);
  check_dense(scales, "expert_scales", 2);
  const int d = dtype_code(dst);
  const int64_t tokens = dst.size(0), hidden = dst.size(1), fan_in = index.size(1);
  TORCH_CHECK_VALUE(d >= 0 && expanded.scalar_type() == dst.scalar_type() &&
                        expanded.size(1) == hidden,
                    "arfuse shm: expanded must be [rows, hidden] in the destination's dtype");
  TORCH_CHECK_VALUE(index.scalar_type() == at::kInt && index.size(0) == tokens &&
                        fan_in >= 1 && fan_in <= signature::kMaxMoeFanIn,
                    "arfuse shm: expanded_idx_to_permuted_idx must be int32 [tokens, top_k] "
                    "with 1 <= top_k <= ", signature::kMaxMoeFanIn);
  TORCH_CHECK_VALUE(scales.sizes() == index.sizes(),
                    "arfuse shm: expert_scales must have the shape of the index");
  if (shared) {
    check_dense(*shared, "shared_expert_output", 2);
    TORCH_CHECK_VALUE(shared->sizes() == dst.sizes() &&
                          shared->scalar_type() == dst.scalar_type(),
                      "arfuse shm: shared_expert_output must be [tokens, hidden] in the dtype");
  }
  const int32_t* idx = index.data_ptr<int32_t>();
  std::string problem = index_problem(idx, index.numel(), fan_in, expanded.size(0));
  if (!problem.empty()) return problem;
  at::Tensor converted;
  const float* s = scales_f32(scales, &converted);
  char* out = static_cast<char*>(dst.data_ptr());
  const char* rows = static_cast<const char*>(expanded.data_ptr());
  const char* shared_rows = shared ? static_cast<const char*>(shared->data_ptr()) : nullptr;
  py::gil_scoped_release no_gil;
  const DefaultFloatEnv env;
  by_dtype(d, [&](auto dc) {
    finalize_rows<decltype(dc)::value>(out, rows, idx, s, shared_rows, float(routed),
                                       tokens, int(fan_in), hidden);
  });
  return problem;
}

void moe_reduce(const at::Tensor& dst, const at::Tensor& active, const at::Tensor& scales,
                const at::Tensor& token_input) {
  check_dense(dst, "the destination", 2);
  check_dense(active, "active_experts_token_input", 3);
  check_dense(scales, "scale_input", 2);
  check_dense(token_input, "token_input", 2);
  const int d = dtype_code(dst);
  const int64_t tokens = dst.size(0), hidden = dst.size(1), experts = active.size(0);
  TORCH_CHECK_VALUE(d >= 0 && active.scalar_type() == dst.scalar_type() &&
                        active.size(1) == tokens && active.size(2) == hidden &&
                        experts >= 1 && experts <= signature::kMaxMoeFanIn,
                    "arfuse shm: active_experts_token_input must be [experts, tokens, hidden] "
                    "in the destination's dtype, 1 <= experts <= ", signature::kMaxMoeFanIn);
  TORCH_CHECK_VALUE(scales.size(0) == experts && scales.size(1) == tokens,
                    "arfuse shm: scale_input must be [experts, tokens]");
  TORCH_CHECK_VALUE(token_input.sizes() == dst.sizes() &&
                        token_input.scalar_type() == dst.scalar_type(),
                    "arfuse shm: token_input must be [tokens, hidden] in the dtype");
  at::Tensor converted;
  const float* s = scales_f32(scales, &converted);
  char* out = static_cast<char*>(dst.data_ptr());
  const char* rows = static_cast<const char*>(active.data_ptr());
  const char* add = static_cast<const char*>(token_input.data_ptr());
  py::gil_scoped_release no_gil;
  const DefaultFloatEnv env;
  by_dtype(d, [&](auto dc) {
    reduce_rows<decltype(dc)::value>(out, rows, s, add, tokens, int(experts), hidden);
  });
}

}  // namespace arfuse
