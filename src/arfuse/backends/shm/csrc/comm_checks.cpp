// CallRules (comm.h): the fast paths' argument checks, rule for rule those of
// arfuse.call_checks and arfuse.moe: a call they would refuse is declined (the caller then
// runs the checked Python path, which raises), never run. ShmComm's calls check against its
// segment; checked_numbers, the torch backend's, against no shared memory.
#include "arguments.h"
#include "comm.h"

#include <cmath>
#include <string>

namespace arfuse {

namespace {

struct Span {
  const char* begin;
  const char* end;
  bool operator==(const Span& o) const { return begin == o.begin && end == o.end; }
};
Span span(const at::Tensor& t) {
  const char* p = static_cast<const char*>(t.data_ptr());
  return {p, p + t.numel() * int64_t(t.element_size())};
}
bool overlap(Span a, Span b) { return a.begin < b.end && b.begin < a.end; }

// What the torch operator's `quant` may be: the codes of kQuantOutputs (quant_outputs.h).
const char* quant_codes_text() {
  static const std::string text = [] {
    std::string t = "quant must be the code of a quantised output:";
    for (const QuantOutput& o : kQuantOutputs) {
      t += std::string(o.code == kOutputNone ? " " : ", ") + std::to_string(o.code) + " (" +
           o.quant + (o.layout[0] ? std::string(" ") + o.layout : std::string()) + ")";
    }
    return t;
  }();
  return text.c_str();
}

}  // namespace

const std::string& group_sizes_text() {
  static const std::string text = [] {
    std::string t;
    for (int64_t code = 1; code <= kGroupCodes; ++code) {
      t += (code > 1 ? ", " : "") + std::to_string(group_size_of(code));
    }
    return t;
  }();
  return text;
}

// ---- checks (call_checks.check_call, rule for rule) --------------------------------------------

// arg_checks.check_plain: memory that holds the values as they read (dense, not nested, not
// quantized, no lazy conjugate or negative view). First: sizes and strides of the others throw.
static bool plain_tensor(const at::Tensor& t) {
  return t.layout() == c10::kStrided && !t.is_nested() && !t.is_quantized() && !t.is_conj() &&
         !t.is_neg();
}

const char* CallRules::x_problem(const at::Tensor& x, bool fast) const {
  if (!plain_tensor(x)) return "x must be a dense tensor (not sparse, nested, quantized, a view)";
  if (x.dim() != 2) return "x must be 2-D [tokens, hidden]";
  if (x.scalar_type() != scalar_type()) return "x has another dtype than this workspace";
  if (x.size(1) != hidden) return "x has another hidden size than this workspace";
  if (!x.is_cpu()) return "x must be a CPU tensor";
  if (!x.is_contiguous()) return "x must be contiguous";
  if (x.size(0) > max_tokens) return "x has more tokens than the workspace holds";
  if (fast && x.size(0) < 1) return "no tokens";  // the Python path handles those
  return nullptr;
}

bool CallRules::like_x(const at::Tensor& t, const at::Tensor& x) const {
  return plain_tensor(t) && t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() &&
         t.is_cpu() && t.is_contiguous();
}

const char* CallRules::tensors_problem(const Tensors& t) const {
  if (t.residual) {
    if (!t.weight) return "residual needs weight (the residual pattern includes RMSNorm)";
    if (!like_x(*t.residual, *t.x)) return "residual must be shaped, typed and laid out as x";
  }
  if (t.weight) {
    const at::Tensor& w = *t.weight;
    if (!plain_tensor(w) || w.dim() != 1 || w.size(0) != hidden ||
        w.scalar_type() != t.x->scalar_type() || !w.is_cpu() || !w.is_contiguous()) {
      return "weight must be a contiguous CPU tensor of shape (hidden,) typed as x";
    }
  }
  return nullptr;
}

const char* CallRules::numbers_problem(bool norm, const Numbers& n) const {
  if (norm && !(n.eps >= kFp32Tiny && n.eps <= kFp32Max)) {
    return "eps must be in [1.4e-45, 3.4e38] (> 0 and finite in float32)";
  }
  if (norm && !(std::fabs(n.weight_bias) <= kFp32Max)) {
    return "weight_bias must be finite in float32 (|weight_bias| <= 3.4e38)";
  }
  const QuantOutput* q = quant_output(n.output);
  if (q == nullptr) return quant_codes_text();
  if (q->scale_in == kScaleInDequant && !(n.scale >= kFp8ScaleMin && n.scale <= kFp32Max)) {
    return "a dequantisation scale (fp8) must be in [2.9e-39, 3.4e38] (its float32 reciprocal "
           "finite)";
  }
  if (q->scale_in == kScaleInEncode && !(n.scale >= kFp32Tiny && n.scale <= kFp32Max)) {
    return "an encode scale (nvfp4) must be in [1.4e-45, 3.4e38] (> 0 and finite in float32)";
  }
  if (q->block == kGroupOfCall) {
    if (group_code_of(n.group_size) == 0 || hidden % n.group_size != 0) {
      thread_local std::string why;
      why = "group_size must be one of " + group_sizes_text() + " dividing hiddendim";
      return why.c_str();
    }
  } else if (n.group_size != 0) {
    return "group_size must be 0 for an output without groups";
  }
  if ((dtype == kFP32 && !q->fp32) || (q->block > 0 && hidden % q->block != 0)) {
    thread_local std::string why;
    why = std::string(q->quant) + " needs " + (q->fp32 ? "" : "dtype bf16 or fp16 and ") +
          "hidden a multiple of " + std::to_string(q->block);
    return why.c_str();
  }
  return nullptr;
}

// Inputs may not lie in the shared segment (a peer's copy or ours would overwrite them),
// except x written exactly at input_buffer(); outputs as destination_problem says.
const char* CallRules::memory_problem(const Tensors& t) const {
  const Span segment{shared_begin, shared_end};
  const Span x = span(*t.x);
  if (overlap(x, segment) && x.begin != slot) {
    return "x lies in the shared segment but does not start where input_buffer() does";
  }
  if (t.residual && overlap(span(*t.residual), segment)) {
    return "residual lies in the shared segment (input_buffer())";
  }
  if (t.weight && overlap(span(*t.weight), segment)) {
    return "weight lies in the shared segment (input_buffer())";
  }
  if (!t.out && !t.residual_out) return nullptr;
  if (t.residual_out && !t.weight) return "residual_out needs weight";
  if (t.out) {
    if (const char* why = destination_problem(t, *t.out, true)) return why;
  }
  if (t.residual_out) {
    if (const char* why = destination_problem(t, *t.residual_out, false)) return why;
  }
  if (t.out && t.residual_out && overlap(span(*t.out), span(*t.residual_out))) {
    return "out and residual_out overlap; they must be different memory";
  }
  return nullptr;
}

// out is x or memory of its own; residual_out is residual (x without one) or memory of its
// own; neither lies in the shared segment nor requires grad.
const char* CallRules::destination_problem(const Tensors& t, const at::Tensor& dest,
                                         bool is_out) const {
  if (!like_x(dest, *t.x)) {
    return is_out ? "out must be a contiguous CPU tensor shaped and typed like x"
                  : "residual_out must be a contiguous CPU tensor shaped and typed like x";
  }
  if (dest.requires_grad()) {
    return is_out ? "out requires grad" : "residual_out requires grad";
  }
  const Span d = span(dest);
  if (overlap(d, Span{shared_begin, shared_end})) {
    return is_out ? "out is in the shared segment (input_buffer())"
                  : "residual_out is in the shared segment (input_buffer())";
  }
  const int own_index = is_out || !t.residual ? 0 : 1;
  const at::Tensor* args[3] = {t.x, t.residual, t.weight};
  const Span own = span(*args[own_index]);
  if (overlap(d, own) && !(d == own)) {
    return is_out ? "out overlaps x only partly" : "residual_out overlaps its input only partly";
  }
  for (int i = 0; i < 3; ++i) {
    if (args[i] == nullptr || i == own_index || span(*args[i]) == own) continue;
    if (overlap(d, span(*args[i]))) {
      return is_out ? "out overlaps another argument"
                    : "residual_out overlaps another argument";
    }
  }
  return nullptr;
}

bool CallRules::take_numbers(bool norm, py::handle eps, py::handle weight_bias, py::handle quant,
                           py::handle scale, py::handle layout, py::handle group_size,
                           Numbers* n) {
  if (norm && (!plain_number(eps, &n->eps) || !plain_number(weight_bias, &n->weight_bias))) {
    return false;
  }
  // the row of kQuantOutputs that quant (and, where its rows differ in it, layout; None: the
  // quant's first row) names
  const QuantOutput* q = nullptr;
  if (quant.is_none()) {
    q = quant_output(kOutputNone);
  } else {
    if (!PyUnicode_Check(quant.ptr())) return false;
    for (const QuantOutput& o : kQuantOutputs) {
      if (!is_ascii(quant, o.quant)) continue;
      const bool any_layout = o.layout[0] == '\0' || layout.is_none();
      if (!any_layout && (!PyUnicode_Check(layout.ptr()) || !is_ascii(layout, o.layout))) continue;
      q = &o;
      break;
    }
  }
  if (q == nullptr) return false;
  n->output = q->code;
  // group_size: None (the default of an output with groups), or an int of those it allows
  if (group_size.is_none()) {
    n->group_size = q->block == kGroupOfCall ? kDefaultGroupSize : 0;
  } else {
    if (q->block != kGroupOfCall || !PyLong_Check(group_size.ptr()) ||
        PyBool_Check(group_size.ptr())) {
      return false;
    }
    n->group_size = PyLong_AsLongLong(group_size.ptr());
    if (n->group_size == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  if (q->scale_in == kScaleInNone) return q->code == kOutputNone || scale.is_none();
  return plain_number(scale, &n->scale);
}

// ---- the MoE fast path's checks (arfuse.moe's, rule for rule) ---------------------------

// A MoE input: a contiguous, plain CPU tensor of `dim` dimensions outside the shared segment.
bool CallRules::moe_input_ok(const at::Tensor& t, int64_t dim) const {
  return plain_tensor(t) && t.dim() == dim && t.is_cpu() && t.is_contiguous() &&
         !overlap(span(t), Span{shared_begin, shared_end});
}

// The expert rows, scales and index of a MoE call, checked; the call's tokens (0: declined).
int64_t CallRules::moe_tokens(const at::Tensor& rows, const at::Tensor* index,
                            const at::Tensor& scales, const at::Tensor* add) const {
  const bool finalize = index != nullptr;
  if (!moe_input_ok(rows, finalize ? 2 : 3) || rows.scalar_type() != scalar_type() ||
      rows.size(rows.dim() - 1) != hidden || !moe_input_ok(scales, 2)) {
    return 0;
  }
  if (scales.scalar_type() != at::kFloat && scales.scalar_type() != scalar_type()) return 0;
  int64_t tokens = 0, fan_in = 0;
  if (finalize) {
    if (!moe_input_ok(*index, 2) || index->scalar_type() != at::kInt) return 0;
    tokens = index->size(0);
    fan_in = index->size(1);
    if (scales.sizes() != index->sizes()) return 0;
  } else {
    fan_in = rows.size(0);
    tokens = rows.size(1);
    if (scales.size(0) != fan_in || scales.size(1) != tokens) return 0;
  }
  if (fan_in < 1 || fan_in > signature::kMaxMoeFanIn || tokens < 1) return 0;
  if (add != nullptr && (!moe_input_ok(*add, 2) || add->scalar_type() != scalar_type() ||
                         add->size(0) != tokens || add->size(1) != hidden)) {
    return 0;
  }
  return tokens;
}

// ---- the torch backend's fast path: the checks alone ------------------------------------------

py::object checked_numbers(int64_t hidden, int64_t dtype, py::handle x, py::handle residual,
                           py::handle weight, py::handle eps, py::handle weight_bias,
                           py::handle quant, py::handle scale, py::handle layout,
                           py::handle out, py::handle residual_out, py::handle group_size) {
  if (dtype != kBF16 && dtype != kFP16 && dtype != kFP32) return py::none();
  const CallRules rules{hidden, INT64_MAX, int(dtype)};  // no shared memory, no token bound
  Tensors t;
  Numbers n;
  if (!THPVariable_Check(x.ptr())) return py::none();
  t.x = &THPVariable_Unpack(x.ptr());
  if (!take_tensor(weight, &t.weight) || !take_tensor(residual, &t.residual) ||
      !CallRules::take_numbers(t.weight != nullptr, eps, weight_bias, quant, scale, layout,
                               group_size, &n) ||
      !take_tensor(out, &t.out) || !take_tensor(residual_out, &t.residual_out) ||
      rules.x_problem(*t.x, true) || rules.tensors_problem(t) ||
      rules.numbers_problem(t.weight != nullptr, n) || rules.memory_problem(t)) {
    return py::none();
  }
  return py::make_tuple(n.eps, n.weight_bias, n.output, n.scale, n.group_size);
}

}  // namespace arfuse
