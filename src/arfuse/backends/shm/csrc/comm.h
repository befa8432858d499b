// ShmComm: one rank's handle on the group's segment, with the op's two entries:
//   call  the fast path from Python: checks every argument cheaply (mirroring
//         arfuse.call_checks; it returns None wherever those would raise, or for anything
//         unusual) and runs;
//   run   the checked entry for arguments already checked in Python, and for
//         torch.ops.arfuse.shm_fused_allreduce (operators.cpp): it raises ValueError for what
//         call would decline.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "call_limits.h"
#include "exchange.h"
#include "protocol.h"

namespace arfuse {

// What recovers a broken workspace: the same advice as errors.WorkspaceBroken.ADVICE
// (tests/test_negotiation.py checks it).
inline constexpr char kAdvice[] =
    "close every FusedAllReduce of this group on every rank (arfuse.destroy_all() closes all), "
    "then create new ones";

// Free buffers by size; bounded, thread-safe (tensors may die on any thread). At most kKeep
// buffers and max_free_bytes in all (the oldest freed first): the pool saves page faults for
// the calls of a step, it must not hold many calls' worth of idle memory.
class OutputPool {
 public:
  static constexpr size_t kKeep = 16;
  explicit OutputPool(size_t max_free_bytes) : max_free_bytes_(max_free_bytes) {}
  ~OutputPool();
  void* take(size_t bytes);  // at least `bytes`, 64-byte aligned
  void give(void* p, size_t bytes);  // `bytes`: as asked of take
  size_t free_bytes();
  static size_t size_class(size_t bytes);

 private:
  std::mutex mutex_;
  std::vector<std::pair<size_t, void*>> free_;
  size_t free_bytes_ = 0;
  const size_t max_free_bytes_;
};

struct Tensors {  // the tensors of one call (nullptr: not given)
  const at::Tensor* x = nullptr;
  const at::Tensor* residual = nullptr;
  const at::Tensor* weight = nullptr;
  const at::Tensor* out = nullptr;
  const at::Tensor* residual_out = nullptr;
};

// "32, 64, 128": the group sizes a call may ask for (group_size_of), for messages.
const std::string& group_sizes_text();

struct Numbers {  // the scalars of one call
  double eps = 1e-6, weight_bias = 0.0, scale = 0.0;  // scale: the caller's (kScaleIn*)
  int output = kOutputNone;  // a code of kQuantOutputs (quant_outputs.h)
  int64_t op = 0;  // the op making the call: its signature names it (signature.h)
  int64_t moe = 0;  // a MoE call's word-0 bits: its reduction and fields (signature.h)
  int64_t group_size = 0;  // a per-token-group output's group size (0 for the other outputs)
};

// The rules of one call (arfuse.call_checks.check_call's, rule for rule; comm_checks.cpp) for
// a workspace of `hidden` elements of `dtype` (kBF16, kFP16, kFP32) taking up to `max_tokens`
// rows: each *_problem says why a call breaks a rule (nullptr: it does not). `shared`: the
// memory the peers read during a call, where no argument may lie but x starting exactly at
// `slot` (the next input slot); empty where there is none (the torch backend's calls).
struct CallRules {
  int64_t hidden = 0, max_tokens = 0;
  int dtype = kFP32;
  const char* shared_begin = nullptr;
  const char* shared_end = nullptr;
  const char* slot = nullptr;

  at::ScalarType scalar_type() const {
    return dtype == kBF16 ? at::kBFloat16 : dtype == kFP16 ? at::kHalf : at::kFloat;
  }
  const char* x_problem(const at::Tensor& x, bool fast) const;
  const char* tensors_problem(const Tensors& t) const;
  const char* numbers_problem(bool norm, const Numbers& n) const;
  const char* memory_problem(const Tensors& t) const;
  const char* destination_problem(const Tensors& t, const at::Tensor& dest, bool is_out) const;
  bool like_x(const at::Tensor& t, const at::Tensor& x) const;
  // A MoE input: a contiguous, plain CPU tensor of `dim` dimensions outside `shared`.
  bool moe_input_ok(const at::Tensor& t, int64_t dim) const;
  // The expert rows, scales and index of a MoE call, checked; the call's tokens (0: declined).
  int64_t moe_tokens(const at::Tensor& rows, const at::Tensor* index, const at::Tensor& scales,
                     const at::Tensor* add) const;
  // The call's Python numbers (eps, weight_bias, quant, scale, layout, group_size) into `n`;
  // false for a value of another kind (declined: the checked Python path names it).
  static bool take_numbers(bool norm, py::handle eps, py::handle weight_bias, py::handle quant,
                           py::handle scale, py::handle layout, py::handle group_size,
                           Numbers* n);
};

// The fast path's checks alone, for a backend that runs its calls elsewhere (the torch
// backend, on a CPU): None where check_call would raise or for anything unusual (that call
// then takes the checked Python path), else (eps, weight_bias, output code, scale,
// group_size) as check_call makes them (a call without weight: eps 1e-6, weight_bias 0).
py::object checked_numbers(int64_t hidden, int64_t dtype, py::handle x, py::handle residual,
                           py::handle weight, py::handle eps, py::handle weight_bias,
                           py::handle quant, py::handle scale, py::handle layout,
                           py::handle out, py::handle residual_out, py::handle group_size);

// Makes one output tensor of a call (the workspace's pool, or plain memory).
using MakeOutput = std::function<at::Tensor(at::IntArrayRef, const at::TensorOptions&)>;
// quant_out and scale_out of a call of `tokens` rows, as the output's row of kQuantOutputs
// says (signature.h); their addresses go into c.
void make_quant_outputs(const Numbers& n, int64_t tokens, int64_t hidden,
                        const at::TensorOptions& x_options, const MakeOutput& make,
                        at::Tensor* quant_out, at::Tensor* scale_out, Call* c);

class ShmComm {
 public:
  ShmComm(int64_t base, int64_t world, int64_t rank, int64_t max_tokens, int64_t hidden,
          int64_t dtype, int64_t header_bytes, int64_t slot_bytes, int64_t input_bytes,
          double timeout_s, int64_t oneshot_max_bytes);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  // A new ShmComm, entered in the handle table (what Python's ShmComm(...) calls).
  static std::shared_ptr<ShmComm> create(int64_t base, int64_t world, int64_t rank,
                                         int64_t max_tokens, int64_t hidden, int64_t dtype,
                                         int64_t header_bytes, int64_t slot_bytes,
                                         int64_t input_bytes, double timeout_s,
                                         int64_t oneshot_max_bytes);
  // The live ShmComm with this handle (null when none): torch.ops entries name it so. The
  // pointer keeps it alive while a call uses it.
  static std::shared_ptr<ShmComm> find(int64_t handle);
  int64_t handle() const { return handle_; }

  void set_peers(std::vector<int64_t> pids, std::vector<int64_t> starts, bool check);
  void set_base(int64_t base);
  // One-shot up to max_bytes per rank and again above above_bytes (its ring), two-shot
  // between (workspace.py says why).
  void set_oneshot_bytes(int64_t max_bytes, int64_t above_bytes) {
    const std::lock_guard<std::mutex> one_call(call_mutex_);
    oneshot_max_bytes_ = max_bytes;
    oneshot_above_bytes_ = above_bytes;
  }
  // One-shot's ring of blocks (kRingBlocks; 0: a copied input at its rows' offsets, as an
  // input_buffer one). Any value on any rank gives the same results (each rank says where
  // its blocks are); tests and benchmarks set it.
  void set_ring_blocks(int64_t blocks) {
    if (blocks != 0 && blocks <= kLeadBlocks) {
      throw std::invalid_argument("ring_blocks=" + std::to_string(blocks) +
                                  " is not valid; use 0 or more than " +
                                  std::to_string(kLeadBlocks));
    }
    const std::lock_guard<std::mutex> one_call(call_mutex_);
    ring_blocks_ = blocks;
  }
  int64_t ring_blocks() const { return ring_blocks_; }
  // Byte offset (from the segment base) of this rank's input slot for the next call.
  int64_t next_input_offset() const { return int64_t(next_slot() - seg_.base); }
  bool oneshot(int64_t tokens) const {
    const int64_t bytes = tokens * hidden_ * elem_;
    return tokens < seg_.world || bytes <= oneshot_max_bytes_ || bytes > oneshot_above_bytes_;
  }

  py::object call(py::handle x, py::handle residual, py::handle weight, py::handle eps,
                  py::handle weight_bias, py::handle quant, py::handle scale,
                  py::handle layout, py::handle out, py::handle residual_out, int64_t op,
                  py::handle group_size);
  // The fast path of a MoE call (moe_finalize with an index, moe_reduce without): the rules
  // of arfuse.moe and of call, the expert step straight into this rank's input slot, then
  // the call. None wherever the Python path would raise or for anything unusual, an index
  // outside the rows included (the Python path then meets the peers and raises).
  py::object call_moe(py::handle rows, py::handle index, py::handle scales, py::handle add,
                      py::handle routed, py::handle residual, py::handle weight,
                      py::handle eps, py::handle weight_bias, py::handle quant,
                      py::handle scale, py::handle layout, py::handle out,
                      py::handle residual_out, int64_t op, py::handle group_size);
  // call's checks and run, for arguments already unpacked (the compiled graphs' operator,
  // operators.cpp): false, with nothing run, wherever call returns None.
  bool try_run(const Tensors& t, const Numbers& n, bool release_gil,
               std::array<at::Tensor, 4>* r);
  // (out, residual_out, quant_out, scale_out), the absent ones undefined (None in Python).
  std::array<at::Tensor, 4> run(const Tensors& t, const Numbers& n, bool release_gil);
  // Meet the group with the signature of a call this rank runs elsewhere (over capacity, on
  // the unfused backend): a group whose calls differ raises MismatchedCall here, on every
  // rank, instead of waiting in two backends. pattern: its code (signature.h); group_size: a
  // per-token-group output's (0: none).
  void announce(int64_t tokens, int64_t pattern, int64_t op, int64_t moe = 0,
                int64_t group_size = 0);
  // The group this workspace belongs to (a number the Python side gives each group of the
  // process): a rank waiting in a call looks at the other workspaces of its group for peers
  // that are in a call there instead (ops called in another order), see look_elsewhere.
  void set_group(int64_t group);

  // Seconds the last call spent in the kernel proper (outputs, exchange, epilogue), once
  // timing is on: what the op costs on top of it is its interface overhead (arfuse bench
  // measures it). Off by default: two clock reads per call are not free.
  void set_timing(bool on) { timing_ = on; }
  double last_call_seconds() const { return last_call_s_; }
  // Bytes of free output buffers the pool holds (bounded: see OutputPool).
  int64_t pooled_bytes() const { return int64_t(pool_->free_bytes()); }
  void set_result_type(py::object cls);
  // After destroy: the mapping is gone; every later call must refuse, not touch it.
  void invalidate(const std::string& why);
  // 0 auto (measured per size, see CopyTuner), 1 cached, 2 streaming.
  void set_copy_mode(int64_t mode);
  // How outputs of their own (not x or residual) are stored: 0 auto, 1 cached, 2 streaming.
  // The same values in every mode.
  void set_output_stores(int64_t mode);
  // The caller's promise that every rank passes the same residual (tensor parallelism), set
  // once when the workspace is made: two-shot calls then finish other owners' rows from their
  // residual_out without reading this rank's residual (Call::slot_holds_residual_out).
  void set_replicated_residual(bool replicated) {
    const std::lock_guard<std::mutex> one_call(call_mutex_);
    replicated_residual_ = replicated;
  }
  bool replicated_residual() const { return replicated_residual_; }
  // Whether the op checks that promise across ranks before every call
  // (replicated_residual="check"). The check is the op's (arfuse.ops, collective), which the
  // torch operator skips: it refuses this workspace's handle (operators.cpp).
  void set_residual_checked(bool checked) {
    const std::lock_guard<std::mutex> one_call(call_mutex_);
    residual_checked_ = checked;
  }
  bool residual_checked() const { return residual_checked_; }
  // Whether a call whose own outputs (out not x, residual_out not the residual) come to
  // `bytes` in all stores them with streaming stores (out only when it is not quantised, and
  // with RMSNorm where its rows are whole lines; see make_call). Auto: from the build's
  // isa::stream_output_min_bytes. Streaming stores send the lines to memory without first
  // reading them into this core's cache (a read for ownership of lines the op only
  // overwrites); a call that writes that many fresh lines could not keep them in cache until
  // the next op reads them anyway. Smaller outputs stay cached for that reader.
  bool streams_outputs(int64_t bytes) const {
    return bytes > 0 && (output_stores_ == kStoresStreaming ||
                         (output_stores_ == kStoresAuto &&
                          bytes >= isa::stream_output_min_bytes(dtype_)));
  }
  std::vector<std::tuple<int64_t, bool, bool, int64_t, int64_t>> copy_modes() const {
    return tuner_.modes();
  }

 private:
  // This call's rules: the workspace's sizes, its segment, the next input slot.
  CallRules rules() const {
    return CallRules{hidden_, max_tokens_, dtype_, seg_.base, seg_.end(), next_slot()};
  }
  py::object make_result(std::array<at::Tensor, 4>& r) const;
  std::array<at::Tensor, 4> execute(const Tensors& t, const Numbers& n, bool release_gil);
  [[noreturn]] void throw_broken() const;
  void look_elsewhere(const std::vector<int>& silent) const;
  void remember_failure(const ShmError& e);
  Call make_call(const Tensors& t, const Numbers& n, std::array<at::Tensor, 4>* r);
  template <int D> void exchange(const void* x, Call& c);
  template <int D> void exchange_once(const void* x, Call& c, bool copy,
                                      const CopyTuner::Plan& plan);
  at::Tensor output(at::IntArrayRef shape, const at::TensorOptions& options);
  char* next_slot() const { return seg_.input_slot(seg_.rank, (seq_ + 1) & 1); }
  at::ScalarType scalar_type() const {
    return dtype_ == kBF16 ? at::kBFloat16 : dtype_ == kFP16 ? at::kHalf : at::kFloat;
  }

  // One call at a time per workspace: a call's protocol state (sequence number, slots, flags,
  // scratch rows) belongs to it until it ends. Taken with the GIL released, so a thread that
  // waits here holds nothing another thread needs; calls from several threads run one after
  // the other and pair up across ranks in the order each rank makes them.
  std::mutex call_mutex_;
  Segment seg_;
  Waiter waiter_;
  CopyTuner tuner_;
  int64_t max_tokens_, hidden_;
  int dtype_, elem_ = 2;
  int64_t oneshot_max_bytes_;
  int64_t oneshot_above_bytes_ = INT64_MAX;
  int64_t ring_blocks_ = kRingBlocks;
  int64_t seq_ = 0;
  int copy_mode_ = kStoresAuto;
  int output_stores_ = kStoresAuto;
  bool replicated_residual_ = false;
  bool residual_checked_ = false;
  double last_call_s_ = 0.0;
  bool timing_ = false;
  std::vector<float> scratch_;  // the gain of the current call
  std::vector<float> staging_;  // two rows of T and room to align them to 64 bytes
  void* staging_rows_ = nullptr;  // Call::staging: the rows in staging_, 64-byte aligned
  std::shared_ptr<OutputPool> pool_;  // see the constructor for its bound
  py::object result_type_;
  // Why this workspace refuses every call once it does (a timeout, a dead peer, destroyed):
  // written and read under call_mutex_ only; failed_ says whether, without the lock.
  // Written under broken_mutex_ (a peer's look_elsewhere may break this workspace while
  // another thread runs a call here); failed_ says whether, without the lock.
  mutable std::mutex broken_mutex_;
  std::string broken_;
  std::atomic<bool> failed_{false};
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  void fail(const std::string& why);
  int64_t handle_ = 0;
  // Under the handle table's mutex: the group, and whether the segment is still mapped (the
  // other workspaces of the group read it while they wait).
  int64_t group_ = 0;
  bool mapped_ = true;
};

}  // namespace arfuse
