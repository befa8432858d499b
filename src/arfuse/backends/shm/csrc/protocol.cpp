// The parts of protocol.h that are not on the per-block path: error messages, peer liveness,
// signature texts and the copy-mode tuner's bookkeeping.
#include "protocol.h"

namespace arfuse {

namespace {

const char* name_of(int64_t value, const char* const* names, int count) {
  return value >= 0 && value < count ? names[value] : "?";
}

struct Fields {  // a signature, decoded; pattern: (reduction, epilogue) as code >>
                 // kEpilogueShift; quant, layout: the first row of kQuantOutputs with the
                 // output's quant, layout name (-1: the code is none); output: its row
  int64_t tokens, pattern, quant, layout, group, dtype, hidden, mode, op, fan_in, shared, digest;
  const QuantOutput* output;
};

// The index of the first row of kQuantOutputs whose `field` equals the one of `o` (-1: none).
int64_t first_row(const QuantOutput* o, const char* QuantOutput::*field) {
  if (o == nullptr) return -1;
  for (int64_t i = 0; i < int64_t(std::size(kQuantOutputs)); ++i) {
    if (std::strcmp(kQuantOutputs[i].*field, o->*field) == 0) return i;
  }
  return -1;
}

Fields decode(int64_t word0, int64_t word1) {
  using namespace signature;
  const int64_t code = (word0 >> kPatternShift) & ((int64_t(1) << kPatternBits) - 1);
  const int64_t output = code & ((int64_t(1) << kEpilogueShift) - 1);
  // a code whose reduction or epilogue is none names no output either (as arfuse.signature)
  const int64_t reduction = code >> kReductionShift, epilogue = (code >> kEpilogueShift) & 3;
  const bool known = reduction <= kReductionMoeFinalize && epilogue <= kEpilogueResidualRmsNorm;
  const QuantOutput* q = known ? quant_output(output) : nullptr;
  return {(word0 >> kTokensShift) & 0xffffffffLL, code >> kEpilogueShift,
          first_row(q, &QuantOutput::quant), first_row(q, &QuantOutput::layout),
          group_size_of(int64_t(uint64_t(word1) >> kGroupShift) & ((1 << kGroupBits) - 1)),
          (word0 >> kDtypeShift) & 3,
          word1 & 0xffffffffLL, (word0 >> kModeShift) & 1,
          int64_t(uint64_t(word1) >> kOpShift) & kMaxOp,
          (word0 >> kMoeFanInShift) & kMaxMoeFanIn, (word0 >> kMoeSharedShift) & 1,
          int64_t(uint64_t(word0) >> kMoeDigestShift) & ((int64_t(1) << kMoeDigestBits) - 1),
          q};
}

constexpr int kEpilogues = 3;  // per reduction in Fields::pattern
bool is_finalize(const Fields& f) {
  return f.pattern / 4 == signature::kReductionMoeFinalize;
}


}  // namespace

std::string describe_signature(int64_t word0, int64_t word1) {
  static const char* const dtypes[] = {"bf16", "fp16", "fp32"};
  // (reduction, epilogue): reduction * 4 + epilogue (arfuse/signature.py names them alike)
  static const char* const patterns[] = {
      "plain", "norm", "norm+residual", "?",
      "moe_reduce+plain", "moe_reduce+norm", "moe_reduce+norm+residual", "?",
      "moe_finalize+plain", "moe_finalize+norm", "moe_finalize+norm+residual"};
  const Fields f = decode(word0, word1);
  std::ostringstream ss;
  ss << "tokens=" << f.tokens << " dtype=" << name_of(f.dtype, dtypes, 3)
     << " hidden=" << f.hidden << " pattern=" << name_of(f.pattern, patterns, 11)
     << " quant=" << (f.output ? f.output->quant : "?");
  if (f.output && f.output->layout[0]) ss << " layout=" << f.output->layout;
  if (f.group) ss << " group_size=" << f.group;
  ss << " mode=" << (f.mode ? "twoshot" : "oneshot") << " op=" << f.op;
  if (f.pattern / 4 != 0 && f.pattern % 4 < kEpilogues) {
    ss << (is_finalize(f) ? " top_k=" : " experts=") << f.fan_in << " shared=" << f.shared
       << " rows_digest=0x" << std::hex << f.digest;
  }
  return ss.str();
}

std::string mismatch_message(int64_t call, const std::vector<std::pair<int64_t, int64_t>>& d) {
  std::vector<Fields> fields;
  for (const auto& words : d) fields.push_back(decode(words.first, words.second));
  bool finalize = false;
  for (const Fields& f : fields) finalize |= is_finalize(f);
  const char* const field_names[] = {"tokens", "dtype", "hidden", "pattern", "quant",
                                     "layout", "group_size", "mode", "op",
                                     finalize ? "top_k" : "experts", "shared_expert_output",
                                     "expanded rows or routed_scaling_factor"};
  constexpr int kFields = 12;
  auto value = [](const Fields& f, int i) {
    const int64_t all[] = {f.tokens, f.dtype, f.hidden, f.pattern, f.quant, f.layout, f.group,
                           f.mode, f.op, f.fan_in, f.shared, f.digest};
    return all[i];
  };
  std::ostringstream ss;
  ss << "arfuse shm: the ranks of the group called with different arguments (call " << call
     << "; every rank raises this before any rank reads a peer's data, so the workspace "
        "stays usable for calls that match): they differ in ";
  bool first = true;
  for (int i = 0; i < kFields; ++i) {
    bool differs = false;
    for (const Fields& f : fields) differs |= value(f, i) != value(fields[0], i);
    if (!differs) continue;
    ss << (first ? "" : ", ") << field_names[i];
    first = false;
  }
  for (size_t r = 0; r < d.size(); ++r) {
    ss << "; rank " << r << ": " << describe_signature(d[r].first, d[r].second);
  }
  return ss.str();
}

long long proc_start_time(long long pid, char* state) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return -1;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  char* p = std::strrchr(buf, ')');
  if (!p) return -1;
  p += 2;  // field 3 (after "pid (comm) ")
  long long value = -1;
  for (int field = 3; field <= liveness::kStatStartField && p; ++field) {
    if (field == liveness::kStatStateField) *state = *p;
    if (field == liveness::kStatStartField) { value = std::atoll(p); break; }
    p = std::strchr(p, ' ');
    if (p) ++p;
  }
  return value;
}

bool process_alive(long long pid, long long start) {
  char state = '?';
  const long long found = proc_start_time(pid, &state);
  return found >= 0 && found == start && state != 'Z' && state != 'X';
}

// ---- Waiter ----------------------------------------------------------------------------------

// Whether rank j last started a call on the CPU this rank runs on now: then it cannot make
// progress while this rank spins (ranks that share a core), and sleeping at once hands it the
// CPU.
bool Waiter::shares_cpu(int j) const {
#if defined(__linux__)
  return seg->cpu(j)->load(std::memory_order_relaxed) == sched_getcpu();
#else
  (void)j;
  return false;
#endif
}

// Spin (a peer on another CPU), then sleep on the flag; the group's timeout counts from the
// start of the wait.
void Waiter::wait_slow(int which, int j, int64_t target, int only) const {
  std::atomic<int64_t>* f = seg->flag(which, j);
  const double start = mono_now();
  const double deadline = start + timeout_s;
  if (shares_cpu(j)) {
    sleep_on(which, j, target, only, deadline, kSliceS);
    return;
  }
  for (double now = start; now - start < kSpinS && now <= deadline; now = mono_now()) {
    for (int i = 0; i < 64; ++i) {
      if (f->load(std::memory_order_acquire) >= target) return;
      cpu_relax();
    }
    if (now - start >= kSpinPauseS) sched_yield();
  }
  sleep_on(which, j, target, only, deadline, kFirstSliceS);
}

// Sleep on rank j's flag until it reaches target, in slices of `slice`, between which the
// deadline and (at most every liveness::kLookS, when the ranks are visible) the peers' lives
// are checked.
void Waiter::sleep_on(int which, int j, int64_t target, int only, double deadline,
                      double slice) const {
  std::atomic<int64_t>* f = seg->flag(which, j);
  std::atomic<int32_t>* waiters = seg->waiters(which, j);
  double next_look = mono_now() + liveness::kLookS;
  while (true) {
    waiters->fetch_add(1, std::memory_order_seq_cst);  // a full barrier: counted, then look
    const int64_t seen = f->load(std::memory_order_seq_cst);
    double now = mono_now();
    if (seen < target && now <= deadline) {
      futex_wait_for(f, seen, std::min(slice, deadline - now));
    }
    waiters->fetch_sub(1, std::memory_order_relaxed);
    if (f->load(std::memory_order_acquire) >= target) return;
    now = mono_now();
    if (now > deadline) timed_out(which, target, only);
    if (now >= next_look) {  // a /proc read per slice, not per wake-up
      if (check_pids) check_alive(which, target, only);
      if (look_elsewhere) look_elsewhere(silent_ranks(which, target, only));
      next_look = now + liveness::kLookS;
    }
  }
}

std::vector<int> Waiter::silent_ranks(int which, int64_t target, int only) const {
  std::vector<int> silent;
  for (int j = 0; j < seg->world; ++j) {
    if (j == seg->rank || (only >= 0 && j != only) ||
        seg->flag(which, j)->load(std::memory_order_acquire) >= target) {
      continue;
    }
    silent.push_back(j);
  }
  return silent;
}

std::string Waiter::silent_list(const std::vector<int>& silent) const {
  std::ostringstream ss;
  for (size_t i = 0; i < silent.size(); ++i) ss << (i ? ", " : "") << silent[i];
  return ss.str();
}

void Waiter::timed_out(int which, int64_t target, int only) const {
  const std::vector<int> silent = silent_ranks(which, target, only);
  std::ostringstream ss;
  ss << "arfuse shm: timed out after " << std::to_string(timeout_s) << "s in phase 'call' ("
     << (which == 0 ? "arrive" : "gather") << ", backend shm, call "
     << target / layout::kProgressUnits << "): rank(s) " << silent_list(silent)
     << " of the group did not answer (dead, hung, or calling with other arguments)";
  throw ShmError(ShmError::kTimeout, ss.str(), silent, timeout_s);
}

void Waiter::check_alive(int which, int64_t target, int only) const {
  for (int j : silent_ranks(which, target, only)) {
    if (process_alive(pids[size_t(j)], starts[size_t(j)])) continue;
    const std::vector<int> silent = silent_ranks(which, target, only);
    std::ostringstream ss;
    ss << "arfuse shm: rank " << j << " (pid " << pids[size_t(j)]
       << ") died during a call (phase 'call', backend shm, call "
       << target / layout::kProgressUnits << "); silent rank(s): " << silent_list(silent);
    throw ShmError(ShmError::kTimeout, ss.str(), silent, timeout_s);
  }
}

// ---- CopyTuner -------------------------------------------------------------------------------

CopyTuner::Plan CopyTuner::plan(int64_t bytes, int mode) {
  Plan p;
  if (mode != kStoresAuto) {
    p.streaming = mode == kStoresStreaming;
    return p;
  }
  const int bucket = bucket_of(bytes);
  Tuning& t = tuning_[bucket];
  const int64_t trial = t.calls++ % kTuneEpoch - kTuneWarm;
  const bool in_trial = trial >= 0 && trial < 2 * kTunePairs;
  p.streaming = in_trial ? (trial & 1) == 1 : t.streaming;
  p.decide = trial == 2 * kTunePairs ? bucket : -1;
  if (in_trial) {
    p.bucket = bucket;
    p.trial = trial;
  }
  return p;
}

void CopyTuner::record(const Plan& p, double took, const Segment& s) {
  Tuning& t = tuning_[p.bucket];
  if ((p.trial & 1) == 0) {
    if (p.trial == 0) t.wins = 0;
    t.cached_s = took;
  } else {
    t.wins += took < t.cached_s ? 1 : -1;
  }
  if (p.trial == 2 * kTunePairs - 1) {
    s.vote(s.rank, p.bucket)->store(int8_t(t.wins), std::memory_order_relaxed);
  }
}

// After the arrival wait of the call that follows a trial: every rank's vote is posted.
void CopyTuner::decide(int bucket, const Segment& s) {
  int sum = 0;
  for (int j = 0; j < s.world; ++j) sum += s.vote(j, bucket)->load(std::memory_order_relaxed);
  Tuning& t = tuning_[bucket];
  t.streaming = sum > 0;
  t.decided = true;
  t.vote_sum = sum;
}

// Per size class seen in auto mode: (smallest size in bytes, streaming?, decided?, summed vote
// of the last trial, calls).
std::vector<std::tuple<int64_t, bool, bool, int64_t, int64_t>> CopyTuner::modes() const {
  std::vector<std::tuple<int64_t, bool, bool, int64_t, int64_t>> seen;
  for (int b = 0; b < layout::kVoteBuckets; ++b) {
    const Tuning& t = tuning_[b];
    if (t.calls > 0) {
      seen.emplace_back(int64_t(1) << b, t.streaming, t.decided, t.vote_sum, t.calls);
    }
  }
  return seen;
}

}  // namespace arfuse
