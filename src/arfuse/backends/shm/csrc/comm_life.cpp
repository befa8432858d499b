// ShmComm (comm.h): the handle table (and what it shows of the group's other workspaces) and
// life (creation, peers, settings, invalidation and failure). The fast paths, outputs and one
// call's exchange: comm.cpp.
#include "comm.h"

#include <unordered_map>

namespace arfuse {

// ---- the handle table ------------------------------------------------------------------------

namespace {

std::mutex g_comms_mutex;
std::unordered_map<int64_t, std::weak_ptr<ShmComm>> g_comms;
int64_t g_next_handle = 1;

}  // namespace

std::shared_ptr<ShmComm> ShmComm::find(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_comms_mutex);
  auto it = g_comms.find(handle);
  return it == g_comms.end() ? nullptr : it->second.lock();
}

std::shared_ptr<ShmComm> ShmComm::create(int64_t base, int64_t world, int64_t rank,
                                         int64_t max_tokens, int64_t hidden, int64_t dtype,
                                         int64_t header_bytes, int64_t slot_bytes,
                                         int64_t input_bytes, double timeout_s,
                                         int64_t oneshot_max_bytes) {
  auto comm = std::make_shared<ShmComm>(base, world, rank, max_tokens, hidden, dtype,
                                        header_bytes, slot_bytes, input_bytes, timeout_s,
                                        oneshot_max_bytes);
  std::lock_guard<std::mutex> lock(g_comms_mutex);
  comm->handle_ = g_next_handle++;
  g_comms[comm->handle_] = comm;
  return comm;
}

// Between sleeps of a wait in call seq_: a silent peer that is in a call of another workspace
// of this group which this rank has not made yet called the ops in another order than this
// rank (in program order it could not be there otherwise). Each rank of the two sees it, so
// every rank raises; both workspaces are out of step (a rank's arrival stands in each) and
// refuse later calls.
void ShmComm::look_elsewhere(const std::vector<int>& silent) const {
  if (silent.empty()) return;
  std::vector<std::shared_ptr<ShmComm>> seen;  // released after the lock: a last owner's
                                               // destructor takes it
  ShmComm* other = nullptr;
  int peer = -1;
  int64_t peer_call = 0, words[2] = {0, 0};
  {
    const std::lock_guard<std::mutex> table(g_comms_mutex);
    if (group_ == 0) return;
    for (const auto& entry : g_comms) {
      std::shared_ptr<ShmComm> sib = entry.second.lock();
      if (!sib) continue;
      seen.push_back(sib);
      if (sib.get() == this || sib->group_ != group_ || !sib->mapped_ || sib->failed() ||
          sib->seg_.world != seg_.world) {
        continue;
      }
      const Segment& s = sib->seg_;
      const int64_t mine = s.flag(0, seg_.rank)->load(std::memory_order_acquire) /
                           layout::kProgressUnits;
      for (int j : silent) {
        const int64_t theirs = s.flag(0, j)->load(std::memory_order_acquire) /
                               layout::kProgressUnits;
        if (theirs > mine) {
          other = sib.get();
          peer = j;
          peer_call = theirs;
          words[0] = s.signature(j, theirs)[0].load(std::memory_order_relaxed);
          words[1] = s.signature(j, theirs)[1].load(std::memory_order_relaxed);
          break;
        }
      }
      if (other != nullptr) break;
    }
  }
  if (other == nullptr) return;
  const std::atomic<int64_t>* own = seg_.signature(seg_.rank, seq_);
  std::ostringstream ss;
  ss << "arfuse shm: the ranks of the group called their ops in different orders: rank "
     << peer << " is in call " << peer_call << " of another workspace of this group ("
     << describe_signature(words[0], words[1]) << ") while this rank waits for it in call "
     << seq_ << " of this one (" << describe_signature(own[0].load(), own[1].load())
     << "); every rank must call the ops of a group in the same order. Both workspaces are "
        "out of step now and refuse later calls: " << kAdvice;
  other->fail(ss.str());
  ShmError error(ShmError::kMismatch, ss.str());
  error.breaks = true;
  throw error;
}

// ---- life ------------------------------------------------------------------------------------

ShmComm::ShmComm(int64_t base, int64_t world, int64_t rank, int64_t max_tokens, int64_t hidden,
                 int64_t dtype, int64_t header_bytes, int64_t slot_bytes, int64_t input_bytes,
                 double timeout_s, int64_t oneshot_max_bytes)
    : max_tokens_(max_tokens), hidden_(hidden), dtype_(int(dtype)),
      oneshot_max_bytes_(oneshot_max_bytes) {
  TORCH_CHECK(world >= 1 && world <= layout::kMaxWorld, "arfuse shm: world size must be 1..",
              layout::kMaxWorld);
  TORCH_CHECK(rank >= 0 && rank < world, "arfuse shm: bad rank");
  TORCH_CHECK(max_tokens_ >= 1 && max_tokens_ <= layout::kMaxTokens,
              "arfuse shm: max_tokens must be 1..", layout::kMaxTokens);
  TORCH_CHECK(dtype_ >= kBF16 && dtype_ <= kFP32, "arfuse shm: bad dtype code");
  TORCH_CHECK(hidden_ >= 1 && hidden_ <= signature::kMaxHidden,
              "arfuse shm: hidden must be 1..", signature::kMaxHidden);
  TORCH_CHECK(header_bytes >= layout::kVoteOffset + layout::kMaxWorld * layout::kVoteBuckets,
              "arfuse shm: the header is too small for the copy-mode votes");
  elem_ = dtype_ == kFP32 ? 4 : 2;
  const layout::SlotGeometry g = layout::slot_geometry(world, max_tokens, hidden, elem_);
  TORCH_CHECK(input_bytes >= g.input_bytes && slot_bytes >= input_bytes + g.result_bytes,
              "arfuse shm: the slots are too small for max_tokens rows");
  seg_.base = reinterpret_cast<char*>(base);
  seg_.world = int(world);
  seg_.rank = int(rank);
  seg_.header_bytes = header_bytes;
  seg_.slot_bytes = slot_bytes;
  seg_.input_bytes = input_bytes;
  seg_.total_bytes =
      layout::round_up(header_bytes + world * layout::kBuffers * slot_bytes, layout::kPage);
  waiter_.seg = &seg_;
  waiter_.timeout_s = timeout_s;
  waiter_.look_elsewhere = [this](const std::vector<int>& silent) { look_elsewhere(silent); };
#if defined(__linux__)
  seg_.cpu(seg_.rank)->store(sched_getcpu(), std::memory_order_relaxed);  // before any call
#endif
  waiter_.pids.assign(size_t(world), 0);
  waiter_.starts.assign(size_t(world), 0);
  scratch_.resize(size_t(hidden_));
  staging_.resize(size_t(2 * hidden_ * elem_ / 4 + 16));
  staging_rows_ = reinterpret_cast<void*>(
      (reinterpret_cast<uintptr_t>(staging_.data()) + 63) / 64 * 64);
  // Free output buffers kept: two calls at capacity with out and residual_out each (the calls
  // of a step reuse them; quantised outputs are smaller), 1 MiB at least.
  pool_ = std::make_shared<OutputPool>(
      std::max<size_t>(size_t(4 * max_tokens * hidden_ * elem_), size_t(1) << 20));
}

ShmComm::~ShmComm() {
  {
    std::lock_guard<std::mutex> lock(g_comms_mutex);
    g_comms.erase(handle_);
  }
  // The last owner can be a torch operator call on a thread without the GIL (the Python side
  // let go of the workspace during that call): a Python reference is only released under the
  // GIL, and left to the process once the interpreter is gone.
  if (result_type_) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      result_type_ = py::object();
    } else {
      result_type_.release();
    }
  }
}

void ShmComm::set_peers(std::vector<int64_t> pids, std::vector<int64_t> starts, bool check) {
  TORCH_CHECK(int(pids.size()) == seg_.world && int(starts.size()) == seg_.world,
              "bad peer list");
  const std::lock_guard<std::mutex> one_call(call_mutex_);  // a call reads them
  waiter_.pids = std::move(pids);
  waiter_.starts = std::move(starts);
  waiter_.check_pids = check;
}

void ShmComm::set_result_type(py::object cls) {
  TORCH_CHECK(PyType_Check(cls.ptr()) &&
                  PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls.ptr()), &PyTuple_Type),
              "arfuse shm: the result type must be a tuple subclass");
  result_type_ = std::move(cls);
}

// Both wait for a call in another thread to end (with the GIL released: that call may be
// waiting for its peers), so no call runs on memory that is about to go.
void ShmComm::invalidate(const std::string& why) {
  py::gil_scoped_release no_gil;
  const std::lock_guard<std::mutex> one_call(call_mutex_);
  fail(why);
  const std::lock_guard<std::mutex> table(g_comms_mutex);  // no one reads the segment after
  mapped_ = false;
}

void ShmComm::set_base(int64_t base) {
  py::gil_scoped_release no_gil;
  const std::lock_guard<std::mutex> one_call(call_mutex_);
  const std::lock_guard<std::mutex> table(g_comms_mutex);
  seg_.base = reinterpret_cast<char*>(base);
}

void ShmComm::set_group(int64_t group) {
  const std::lock_guard<std::mutex> table(g_comms_mutex);
  group_ = group;
}

void ShmComm::fail(const std::string& why) {
  const std::lock_guard<std::mutex> lock(broken_mutex_);
  if (!failed()) broken_ = why;  // the first failure is the one to report
  failed_.store(true, std::memory_order_release);
}

void ShmComm::set_copy_mode(int64_t mode) {
  TORCH_CHECK(mode >= kStoresAuto && mode <= kStoresStreaming,
              "arfuse shm: copy mode must be 0 (auto), 1 (cached) or 2 (streaming)");
  const std::lock_guard<std::mutex> one_call(call_mutex_);
  copy_mode_ = int(mode);
}

void ShmComm::set_output_stores(int64_t mode) {
  TORCH_CHECK(mode >= kStoresAuto && mode <= kStoresStreaming,
              "arfuse shm: output stores must be 0 (auto), 1 (cached) or 2 (streaming)");
  const std::lock_guard<std::mutex> one_call(call_mutex_);
  output_stores_ = int(mode);
}

}  // namespace arfuse
