// ShmComm (comm.h): the fast paths, outputs and one call's exchange (the handle table and
// life: comm_life.cpp; the argument checks: comm_checks.cpp).
#include "arguments.h"
#include "comm.h"

#include "float_env.h"
#include "moe.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <unordered_map>

namespace arfuse {

namespace {

// The torch dtype of a kQuantType* (quant_outputs.h).
at::ScalarType quant_type(int type) {
  switch (type) {
    case kQuantTypeE4m3: return at::kFloat8_e4m3fn;
    case kQuantTypeFloat32: return at::kFloat;
    case kQuantTypeInt32: return at::kInt;
    default: return at::kByte;
  }
}

}  // namespace

// quant_out and scale_out of a call as the output's row of kQuantOutputs says (quant_outputs.h),
// made by `make`, their addresses in c.
void make_quant_outputs(const Numbers& n, int64_t tokens, int64_t hidden,
                        const at::TensorOptions& x_options, const MakeOutput& make,
                        at::Tensor* quant_out, at::Tensor* scale_out, Call* c) {
  const QuantOutput& q = *quant_output(n.output);
  if (q.data_type != kQuantTypeNone) {
    *quant_out = make({tokens, hidden / q.data_pack}, x_options.dtype(quant_type(q.data_type)));
    c->quant_out = reinterpret_cast<uint8_t*>(quant_out->data_ptr());
  }
  if (q.scale_type != kQuantTypeNone) {
    const ScaleGeometry g = scale_geometry(q, tokens, hidden, n.group_size);
    const int64_t used = q.scale_group == 0 ? 1 : hidden / scale_span(q, hidden, n.group_size);
    const auto options = x_options.dtype(quant_type(q.scale_type));
    if (q.scale_order == kOrderColumnMajor) {
      *scale_out = make({g.storage}, options).as_strided({g.rows, g.cols},
                                                        {g.row_stride, g.col_stride});
    } else {
      *scale_out = make({g.rows, g.cols}, options);
    }
    // padding must read as zero
    if (g.rows != tokens || g.cols * q.scale_pack != used || g.storage != g.rows * g.cols) {
      at::Tensor(*scale_out).as_strided({g.storage}, {1}).zero_();
    }
    c->scale_out = reinterpret_cast<uint8_t*>(scale_out->data_ptr());
  }
}

// ---- the fast path -------------------------------------------------------------------------

py::object ShmComm::call(py::handle x_obj, py::handle residual_obj, py::handle weight_obj,
                         py::handle eps_obj, py::handle bias_obj, py::handle quant_obj,
                         py::handle scale_obj, py::handle layout_obj, py::handle out_obj,
                         py::handle residual_out_obj, int64_t op, py::handle group_obj) {
  Tensors t;
  Numbers n;
  if (!THPVariable_Check(x_obj.ptr())) return py::none();
  n.op = op;
  t.x = &THPVariable_Unpack(x_obj.ptr());
  if (!take_tensor(weight_obj, &t.weight) || !take_tensor(residual_obj, &t.residual) ||
      !CallRules::take_numbers(t.weight != nullptr, eps_obj, bias_obj, quant_obj, scale_obj,
                               layout_obj, group_obj, &n) ||
      !take_tensor(out_obj, &t.out) || !take_tensor(residual_out_obj, &t.residual_out)) {
    return py::none();
  }
  std::array<at::Tensor, 4> r;
  if (!try_run(t, n, true, &r)) return py::none();
  return make_result(r);
}

bool ShmComm::try_run(const Tensors& t, const Numbers& n, bool release_gil,
                      std::array<at::Tensor, 4>* r) {
  const CallRules rules_now = rules();
  if (failed() || n.op < 0 || n.op > signature::kMaxOp || rules_now.x_problem(*t.x, true) ||
      rules_now.tensors_problem(t) || rules_now.numbers_problem(t.weight != nullptr, n) ||
      rules_now.memory_problem(t)) {
    return false;
  }
  *r = execute(t, n, release_gil);
  return true;
}

// ---- the MoE fast path (None where arfuse.moe's checks would raise: comm_checks.cpp) --------

py::object ShmComm::call_moe(py::handle rows_obj, py::handle index_obj, py::handle scales_obj,
                             py::handle add_obj, py::handle routed_obj, py::handle residual_obj,
                             py::handle weight_obj, py::handle eps_obj, py::handle bias_obj,
                             py::handle quant_obj, py::handle scale_obj, py::handle layout_obj,
                             py::handle out_obj, py::handle residual_out_obj, int64_t op,
                             py::handle group_obj) {
  const at::Tensor *rows = nullptr, *index = nullptr, *scales = nullptr, *add = nullptr;
  double routed = 1.0;
  if (failed() || op < 0 || op > signature::kMaxOp || !take_tensor(rows_obj, &rows) ||
      !rows || !take_tensor(index_obj, &index) || !take_tensor(scales_obj, &scales) ||
      !scales || !take_tensor(add_obj, &add) || (!index && !add) ||
      !plain_number(routed_obj, &routed) || !(std::fabs(routed) <= kFp32Max)) {
    return py::none();
  }
  const CallRules rules_now = rules();
  const int64_t tokens = rules_now.moe_tokens(*rows, index, *scales, add);
  if (tokens < 1 || tokens > max_tokens_) return py::none();
  const at::Tensor x = at::from_blob(next_slot(), {tokens, hidden_},
                                     at::TensorOptions().dtype(scalar_type()));
  Tensors t;
  Numbers n;
  n.op = op;
  t.x = &x;
  if (!take_tensor(weight_obj, &t.weight) || !take_tensor(residual_obj, &t.residual) ||
      rules_now.tensors_problem(t) ||
      !CallRules::take_numbers(t.weight != nullptr, eps_obj, bias_obj, quant_obj, scale_obj,
                               layout_obj, group_obj, &n) ||
      rules_now.numbers_problem(t.weight != nullptr, n) || !take_tensor(out_obj, &t.out) ||
      !take_tensor(residual_out_obj, &t.residual_out) || rules_now.memory_problem(t)) {
    return py::none();
  }
  const float routed_f32 = float(routed);
  uint32_t routed_bits = 0;
  std::memcpy(&routed_bits, &routed_f32, sizeof routed_bits);
  const int reduction = index ? signature::kReductionMoeFinalize : signature::kReductionMoeReduce;
  n.moe = (int64_t(reduction) << (signature::kReductionShift + signature::kPatternShift)) |
          signature::moe_bits(index ? index->size(1) : rows->size(0), index && add,
                              rows->size(0), routed_bits);
  if (index) {
    // an index outside the rows: nothing written; the Python path meets the peers and raises
    if (!moe_finalize(x, *rows, *index, *scales, add ? std::optional<at::Tensor>(*add)
                                                     : std::nullopt, routed_f32).empty()) {
      return py::none();
    }
  } else {
    moe_reduce(x, *rows, *scales, *add);
  }
  std::array<at::Tensor, 4> r = execute(t, n, true);
  return make_result(r);
}

// The FusedOutput named tuple, made the way tuple.__new__ makes a subclass instance (tp_alloc,
// then the items), which skips the named tuple's Python-level __new__ (about 0.6 us per call).
py::object ShmComm::make_result(std::array<at::Tensor, 4>& r) const {
  PyTypeObject* type = result_type_ ? reinterpret_cast<PyTypeObject*>(result_type_.ptr())
                                    : &PyTuple_Type;
  PyObject* result = type->tp_alloc(type, 4);
  if (result == nullptr) throw py::error_already_set();
  for (int i = 0; i < 4; ++i) {
    py::object item = r[size_t(i)].defined() ? py::cast(std::move(r[size_t(i)])) : py::none();
    PyTuple_SET_ITEM(result, i, item.release().ptr());
  }
  return py::reinterpret_steal<py::object>(result);
}

// ---- the checked entry -----------------------------------------------------------------------

std::array<at::Tensor, 4> ShmComm::run(const Tensors& t, const Numbers& n, bool release_gil) {
  const CallRules rules_now = rules();
  const char* why = rules_now.x_problem(*t.x, false);
  if (!why) why = rules_now.tensors_problem(t);
  if (!why) why = rules_now.numbers_problem(t.weight != nullptr, n);
  if (!why && (n.op < 0 || n.op > signature::kMaxOp)) why = "op must be 0..536870911";
  if (!why && !signature::moe_bits_only(n.moe)) why = "moe must hold MoE bits of word 0 only";
  if (!why && !failed()) why = rules_now.memory_problem(t);
  TORCH_CHECK_VALUE(why == nullptr, "arfuse shm: ", why);
  return execute(t, n, release_gil);
}

// ---- one call --------------------------------------------------------------------------------

void ShmComm::throw_broken() const {
  std::string why;
  {
    const std::lock_guard<std::mutex> lock(broken_mutex_);
    why = broken_;
  }
  throw ShmError(ShmError::kBroken, "arfuse shm: this workspace is unusable after an earlier "
                 "failure (" + why + "); " + kAdvice);
}

// A timeout or a dead peer leaves the group out of step: no later call may touch it. A mismatch
// is found by every rank at the same point of the same call, before any rank reads a peer's
// data, so the group stays in step and the next call may go ahead.
void ShmComm::remember_failure(const ShmError& e) {
  if (e.kind != ShmError::kMismatch || e.breaks) fail(e.what());
}

void ShmComm::announce(int64_t tokens, int64_t pattern, int64_t op, int64_t moe,
                       int64_t group_size) {
  using namespace signature;
  const int64_t output = pattern & ((int64_t(1) << kEpilogueShift) - 1);
  TORCH_CHECK_VALUE(tokens >= 0 && pattern >= 0 && (pattern >> kReductionShift) == 0 &&
                        (pattern >> kEpilogueShift) <= kEpilogueResidualRmsNorm &&
                        quant_output(output) != nullptr && op >= 0 && op <= kMaxOp &&
                        moe_bits_only(moe) && (group_size == 0 || group_code_of(group_size) != 0),
                    "arfuse shm: announce needs tokens >= 0, the code of an all-reduce pattern, "
                    "op 0..", kMaxOp, ", MoE bits of word 0 only and a group size of 0 or ",
                    group_sizes_text());
  const int64_t word0 = signature::word0(tokens, pattern, !oneshot(tokens), dtype_) | moe;
  const int64_t word1 = signature::word1(hidden_, op, group_code_of(group_size));
  py::gil_scoped_release no_gil;
  const std::lock_guard<std::mutex> one_call(call_mutex_);
  if (failed()) throw_broken();
  try {
    const int64_t seq = ++seq_;
    publish_signature(seg_, seq, word0, word1);
    meet_without_data(seg_, waiter_, seq, word0, word1);
  } catch (const ShmError& e) {
    remember_failure(e);
    throw;
  }
}

std::array<at::Tensor, 4> ShmComm::execute(const Tensors& t, const Numbers& n,
                                           bool release_gil) {
  const double started = timing_ ? mono_now() : 0.0;
  const DefaultFloatEnv float_env;  // the documented formula, whatever the caller's thread set
  std::array<at::Tensor, 4> r;
  Call c = make_call(t, n, &r);
  {
    std::optional<py::gil_scoped_release> no_gil;  // other Python threads run while we wait
    if (release_gil) no_gil.emplace();
    const std::lock_guard<std::mutex> one_call(call_mutex_);
    if (failed()) throw_broken();
    try {
      switch (dtype_) {
        case kBF16: exchange<kBF16>(t.x->data_ptr(), c); break;
        case kFP16: exchange<kFP16>(t.x->data_ptr(), c); break;
        default: exchange<kFP32>(t.x->data_ptr(), c); break;
      }
    } catch (const ShmError& e) {
      remember_failure(e);
      throw;
    }
  }
  if (timing_) last_call_s_ = mono_now() - started;
  return r;
}

// The call's raw pointers, and its outputs: the caller's, or new ones from the pool.
Call ShmComm::make_call(const Tensors& t, const Numbers& n, std::array<at::Tensor, 4>* r) {
  const at::Tensor& x = *t.x;
  const int64_t tokens = x.size(0);
  Call c;
  c.tokens = tokens;
  c.hidden = hidden_;
  c.op = n.op;
  c.moe = n.moe;
  c.residual = t.residual ? t.residual->data_ptr() : nullptr;
  c.weight = t.weight ? t.weight->data_ptr() : nullptr;
  c.eps = float(n.eps);
  c.weight_bias = float(n.weight_bias);
  c.output = n.output;
  c.scale = float(n.scale);
  c.group_size = n.group_size;
  c.gain = scratch_.data();
  auto& [out, residual_out, quant_out, scale_out] = *r;
  out = t.out ? *t.out : output({tokens, hidden_}, x.options());
  c.out = out.data_ptr();
  if (t.weight) {
    residual_out = t.residual_out ? *t.residual_out : output({tokens, hidden_}, x.options());
    c.residual_out = residual_out.data_ptr();
  }
  const bool own_out = c.out != x.data_ptr();
  const bool own_residual_out =
      t.weight && c.residual_out != c.residual && c.residual_out != x.data_ptr();
  const bool stream =
      streams_outputs(tokens * hidden_ * elem_ * (int64_t(own_out) + int64_t(own_residual_out)));
  c.staging = staging_rows_;
  // Not quantised: quantisation reads out back. With RMSNorm, out streams from the second
  // pass's vector stores, which need rows of whole lines; without, through a staging row.
  const bool whole_lines = reinterpret_cast<uintptr_t>(c.out) % 64 == 0 &&
                           hidden_ * elem_ % 64 == 0;
  c.stream_out = stream && own_out && n.output == kOutputNone && (whole_lines || !t.weight);
  c.stream_residual_out = stream && own_residual_out;
  c.slot_holds_residual_out = replicated_residual_ && t.residual != nullptr;
  make_quant_outputs(n, tokens, hidden_, x.options(),
                     [this](at::IntArrayRef shape, const at::TensorOptions& options) {
                       return output(shape, options);
                     }, &quant_out, &scale_out, &c);
  return c;
}

// Picks the copy mode of this call (CopyTuner) and runs it, timing it during a trial.
template <int D>
void ShmComm::exchange(const void* x, Call& c) {
  const bool copy = x != next_slot();  // the caller may have written its input there already
  CopyTuner::Plan plan;
  if (copy && c.tokens > 0) plan = tuner_.plan(c.tokens * hidden_ * elem_, copy_mode_);
  const double start = plan.bucket >= 0 ? mono_now() : 0.0;
  exchange_once<D>(x, c, copy, plan);
  if (plan.bucket >= 0) tuner_.record(plan, mono_now() - start, seg_);
}

template <int D>
void ShmComm::exchange_once(const void* x, Call& c, bool copy, const CopyTuner::Plan& plan) {
  if (c.weight) {
    compute_gain<D>(static_cast<const typename Elem<D>::T*>(c.weight), c.weight_bias, hidden_,
                    scratch_.data());
  }
  const int64_t seq = ++seq_;
  const bool twoshot = c.tokens > 0 && !oneshot(c.tokens);
  const Exchange e{seg_, waiter_, tuner_, c, x, seq, hidden_ * elem_, copy, plan.streaming,
                   plan.decide, ring_blocks_,
                   signature::word0(c.tokens, pattern_code(c), twoshot, dtype_) | c.moe,
                   signature::word1(hidden_, c.op, group_code_of(c.group_size))};
  publish_signature(seg_, seq, e.word0, e.word1);  // before any progress is announced
  if (c.tokens == 0) run_empty(e);
  else if (!twoshot) run_oneshot<D>(e);
  else run_twoshot<D>(e);
}

// ---- outputs ---------------------------------------------------------------------------------

OutputPool::~OutputPool() {
  for (auto& entry : free_) std::free(entry.second);
}

// Buffers come in size classes: 5, 6, 7 or 8 eighths of a power of two (4 KiB at least), so
// calls whose token counts differ a little (continuous batching) share buffers instead of
// each allocating, and faulting in, memory of its own; a buffer is at most 25% larger than
// asked for.
size_t OutputPool::size_class(size_t bytes) {
  const size_t at_least = std::max<size_t>(bytes, 4096);
  size_t power = 4096;
  while (power < at_least) power *= 2;
  const size_t step = power / 8;  // at_least is in (power / 2, power]
  return (at_least + step - 1) / step * step;
}

void* OutputPool::take(size_t bytes) {
  bytes = size_class(bytes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = free_.size(); i-- > 0;) {  // the most recently freed: still in cache
      if (free_[i].first == bytes) {
        void* p = free_[i].second;
        free_.erase(free_.begin() + long(i));
        free_bytes_ -= bytes;
        return p;
      }
    }
  }
  void* p = nullptr;
  if (posix_memalign(&p, 64, bytes) != 0 || p == nullptr) throw std::bad_alloc();
  return p;
}

void OutputPool::give(void* p, size_t bytes) {
  bytes = size_class(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  free_.emplace_back(bytes, p);
  free_bytes_ += bytes;
  while (free_.size() > kKeep || free_bytes_ > max_free_bytes_) {
    std::free(free_.front().second);
    free_bytes_ -= free_.front().first;
    free_.erase(free_.begin());
  }
}

size_t OutputPool::free_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_bytes_;
}

// Output tensors come from a small pool of buffers that go back to the pool (not to the OS)
// when the last tensor or view using them dies. A fresh multi-MiB buffer per call would cost
// a page fault per 4 KiB on every call; reuse is safe because a buffer only returns to the
// pool once nothing refers to it.
at::Tensor ShmComm::output(at::IntArrayRef shape, const at::TensorOptions& options) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const size_t bytes = size_t(std::max<int64_t>(numel, 1)) * options.dtype().itemsize();
  void* data = pool_->take(bytes);
  std::shared_ptr<OutputPool> pool = pool_;
  return at::from_blob(data, shape, [pool, bytes](void* p) { pool->give(p, bytes); }, options);
}

}  // namespace arfuse
