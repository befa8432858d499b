// How the ranks of a group meet in the segment during one call (sequence number s, buffer
// b = s & 1):
//
//   every call: a rank writes its call signature beside its arrival flag, then announces
//             progress; after the first arrival wait every rank compares every signature
//             and, if any differs, every rank raises (R11) before it waits for any block.
//   one-shot: copy x into my input slot[b]; arrive[me] = s; wait arrive[*] >= s; every rank
//             reduces every row (fp32, rank order) and runs the epilogue locally.
//   two-shot: as above (a rank copies all rows but its own block), but each rank reduces only
//             its own block of rows and writes those sums into its result slot[b]; every rank
//             runs the epilogue on every row from the sums. One pipeline of steps of rows
//             (copy, sum, finish; see run_twoshot), progress counted in the flags (arrive:
//             steps copied; done: steps summed).
// Waiting for a peer's flag: spin while the peer runs on another CPU (it may be about to
// post), then sleep on the flag with a futex (the flag's low 32 bits, which change with
// every post); a rank sleeping on a flag counts itself in that flag's waiters word, and
// the flag's owner makes the wake-up call only when that count is not zero, so an
// uncontended call makes no system call. A peer that last ran on this rank's CPU (ranks that
// share a core) cannot progress while this rank spins: sleep at once. See Waiter, post_flag.
// Double-buffered slots (and signatures) make a trailing barrier unnecessary: a rank can only
// reuse buffer b at call s + 2 after every rank arrived at s + 1, i.e. after every rank
// finished call s. The copy into the slot uses cached or streaming stores, chosen per size by
// a trial that every rank runs at the same calls and decides from the same votes (CopyTuner).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <sched.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "conversions.h"
#include "signature.h"
#include "rows.h"
#include "layout.h"
#include "liveness.h"
#include "memory_access.h"
#include "vec.h"

namespace arfuse {

constexpr int64_t kBlockBytes = 64 * 1024;  // rows per step, in bytes
// One-shot copies this many blocks ahead of the block it finishes, so that a peer a little
// behind does not stall this rank at every block (measured: at 64 tokens of 4096 fp32 on 2
// ranks, ~10% faster than copying and finishing in lockstep; 1, 2 and 4 did about the same).
constexpr int64_t kLeadBlocks = 2;
// One-shot's ring: a copied input goes round this many blocks of the slot (exchange.h).
// More than kLeadBlocks, or a copy would wait for a block its peers wait for it to finish.
constexpr int64_t kRingBlocks = 8;
static_assert(kRingBlocks > kLeadBlocks, "the ring must hold the blocks copied ahead");
// The copy into the shared slot uses ordinary (cached) or streaming stores, whichever the group
// measured faster for that size (see CopyTuner): a peer reads the copy either from this core's
// cache or from memory, and which is faster depends on where the cores sit (measured on a 2-core
// VM, 1-64 tokens of 4096 fp32: streaming 0.73-0.79x the time of cached stores when the vCPUs
// were far apart, up to 1.44x when they shared a cache).
constexpr int64_t kTuneWarm = 8;       // calls of a size before its first trial
constexpr int64_t kTunePairs = 16;     // trial: this many (cached, streaming) call pairs
constexpr int64_t kTuneEpoch = 2048;   // calls of a size between trials (the machine drifts)
// How the copy into the slot (copy mode) or a call's own outputs (output stores) are stored.
enum StoreMode { kStoresAuto = 0, kStoresCached = 1, kStoresStreaming = 2 };

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline double mono_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// A failure of the group during a call; operators.cpp raises it as arfuse.errors.CallTimeout,
// MismatchedCall or WorkspaceBroken.
class ShmError : public std::runtime_error {
 public:
  enum Kind { kTimeout, kMismatch, kBroken };
  ShmError(Kind what_kind, const std::string& what, std::vector<int> silent_ranks = {},
           double timeout = 0.0)
      : std::runtime_error(what), kind(what_kind), silent(std::move(silent_ranks)),
        timeout_s(timeout) {}
  Kind kind;
  std::vector<int> silent;  // the ranks that did not answer (kTimeout)
  double timeout_s;
  // A mismatch found while the ranks were in different workspaces (ops called in another
  // order): the workspaces are out of step, unlike a mismatch of one call's signatures.
  bool breaks = false;
};

// Addresses in the segment (see layout.h).
struct Segment {
  char* base = nullptr;
  int world = 1, rank = 0;
  int64_t header_bytes = 0, slot_bytes = 0, input_bytes = 0;
  int64_t total_bytes = 0;  // the mapping, padding included (ShmLayout.total_bytes)

  std::atomic<int64_t>* flag(int which, int r) const {  // which: 0 arrive, 1 done
    const int64_t at = (which == 0 ? layout::kArriveOffset : layout::kDoneOffset) +
                       layout::kCacheLine * r;
    return reinterpret_cast<std::atomic<int64_t>*>(base + at);
  }
  std::atomic<int32_t>* waiters(int which, int r) const {  // ranks asleep on flag(which, r)
    return reinterpret_cast<std::atomic<int32_t>*>(reinterpret_cast<char*>(flag(which, r)) +
                                                   layout::kWaitersOffset);
  }
  std::atomic<int32_t>* cpu(int r) const {  // the CPU rank r last started a call on
    return reinterpret_cast<std::atomic<int32_t>*>(reinterpret_cast<char*>(flag(0, r)) +
                                                   layout::kCpuOffset);
  }
  // Set this rank's flag and wake the ranks asleep on it, if any (see post_flag).
  void post(int which, int64_t value) const;
  std::atomic<int32_t>* ring(int r, int64_t seq) const {  // layout::kRingOffset
    return reinterpret_cast<std::atomic<int32_t>*>(reinterpret_cast<char*>(flag(0, r)) +
                                                   layout::kRingOffset) + (seq & 1);
  }
  std::atomic<int64_t>* signature(int r, int64_t seq) const {  // two words
    const int64_t at = layout::kArriveOffset + layout::kCacheLine * r +
                       layout::kSignatureOffset + (seq & 1) * layout::kSignatureBytes;
    return reinterpret_cast<std::atomic<int64_t>*>(base + at);
  }
  char* input_slot(int r, int64_t buf) const {
    return base + header_bytes + (int64_t(r) * layout::kBuffers + buf) * slot_bytes;
  }
  char* result_slot(int r, int64_t buf) const { return input_slot(r, buf) + input_bytes; }
  std::atomic<int8_t>* vote(int r, int bucket) const {
    return reinterpret_cast<std::atomic<int8_t>*>(base + layout::kVoteOffset +
                                                  r * layout::kVoteBuckets + bucket);
  }
  const char* end() const { return base + total_bytes; }
};

// ---- call signatures (R11, signature.h) -----------------------------------------------------

// The code of the pattern a call computes.
inline int64_t pattern_code(const Call& c) {
  const int epilogue = c.weight == nullptr     ? signature::kEpilogueNone
                       : c.residual != nullptr ? signature::kEpilogueResidualRmsNorm
                                               : signature::kEpilogueRmsNorm;
  return signature::pattern_code(signature::kReductionAllReduce, epilogue,
                                 c.output);
}

// "tokens=1 dtype=fp32 hidden=64 pattern=plain quant=none mode=oneshot op=3"
// (arfuse/signature.py: describe).
std::string describe_signature(int64_t word0, int64_t word1);
// The MismatchedCall text for these signatures, one per rank (arfuse/signature.py:
// mismatch_message).
std::string mismatch_message(int64_t call, const std::vector<std::pair<int64_t, int64_t>>& d);

inline void publish_signature(const Segment& s, int64_t seq, int64_t word0, int64_t word1) {
  std::atomic<int64_t>* d = s.signature(s.rank, seq);
  d[0].store(word0, std::memory_order_relaxed);  // published by the flag's post
  d[1].store(word1, std::memory_order_relaxed);
#if defined(__linux__)
  s.cpu(s.rank)->store(sched_getcpu(), std::memory_order_relaxed);  // same cache line
#endif
}

// After the first arrival wait of call seq: every signature of this call is visible. Throws
// ShmError(kMismatch) on every rank alike when any differs.
inline void check_signatures(const Segment& s, int64_t seq, int64_t word0, int64_t word1) {
  bool same = true;
  for (int j = 0; j < s.world; ++j) {
    const std::atomic<int64_t>* d = s.signature(j, seq);
    same &= d[0].load(std::memory_order_relaxed) == word0;
    same &= d[1].load(std::memory_order_relaxed) == word1;
  }
  if (same) return;
  std::vector<std::pair<int64_t, int64_t>> all;
  for (int j = 0; j < s.world; ++j) {
    const std::atomic<int64_t>* d = s.signature(j, seq);
    all.emplace_back(d[0].load(std::memory_order_relaxed), d[1].load(std::memory_order_relaxed));
  }
  throw ShmError(ShmError::kMismatch, mismatch_message(seq, all));
}

// ---- waiting for peers -------------------------------------------------------------------------

// The futex word of a flag: its low 32 bits, which differ between any two values a flag
// takes while a peer could be waiting on it (a flag moves by less than 2^32 per post).
inline int32_t* futex_word(std::atomic<int64_t>* f) {
  static_assert(sizeof(std::atomic<int64_t>) == 8, "flags are plain int64 words");
  return reinterpret_cast<int32_t*>(f) + (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__ ? 1 : 0);
}

inline void futex_wake_all(std::atomic<int64_t>* f) {
#if defined(__linux__)
  syscall(SYS_futex, futex_word(f), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)f;
#endif
}

// Sleep while the flag still reads `seen`, at most `seconds` (a wake-up, a signal or a change
// of the word ends it early; the caller looks again either way).
inline void futex_wait_for(std::atomic<int64_t>* f, int64_t seen, double seconds) {
#if defined(__linux__)
  timespec ts;
  ts.tv_sec = time_t(seconds);
  ts.tv_nsec = long((seconds - double(ts.tv_sec)) * 1e9);
  syscall(SYS_futex, futex_word(f), FUTEX_WAIT, int32_t(uint32_t(uint64_t(seen))), &ts, nullptr,
          0);
#else
  (void)f, (void)seen, (void)seconds;
  sched_yield();
#endif
}

// Post a flag: a release store (the data before it lands first), then the wake-up call if a
// rank counts itself asleep on the flag. No full barrier between the two: it would hold the
// core until every store before it has drained (the copy into the slot: ~1-2 us a call,
// measured). Without it the count may be read before the new value is visible to a rank
// going to sleep right then, which so misses this wake-up; a waiter's sleeps are short for
// that reason (Waiter::kFirstSliceS), and it looks at the flag again when one ends. Ranks
// on one CPU never miss one: a context switch drains the store buffer.
inline void post_flag(std::atomic<int64_t>* f, std::atomic<int32_t>* waiters, int64_t value) {
  f->store(value, std::memory_order_release);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the compiler keeps the order
  if (waiters->load(std::memory_order_relaxed) != 0) futex_wake_all(f);
}

inline void Segment::post(int which, int64_t value) const {
  post_flag(flag(which, rank), waiters(which, rank), value);
}

// /proc/<pid>/stat: state (field 3) and start time (field 22). -1 when the process is gone.
long long proc_start_time(long long pid, char* state);
// Whether the process that published (pid, start) is alive, by the rule of liveness.h.
bool process_alive(long long pid, long long start);

class Waiter {
 public:
  // Spin this long for a peer on another CPU before sleeping: first with pause only, then
  // yielding the CPU between looks (another task on this CPU may need it). Ranks on their own
  // cores meet within microseconds in a loop of calls; a peer further behind is slept on.
  static constexpr double kSpinPauseS = 50e-6;
  static constexpr double kSpinS = 1e-3;
  // Sleeps: after spinning for a peer on another CPU each is this long, so a missed wake-up
  // (see post_flag; it can happen at any sleep) costs at most that; kSliceS is the longest
  // between deadline looks (liveness looks: liveness::kLookS). For a peer on this CPU (which cannot miss a wake-up)
  // every sleep is kSliceS: a sleep that ends before the peer posts would take the CPU from it
  // (measured: two ranks on one core, 1-token calls 14 us instead of 10 with 0.5 ms sleeps).
  static constexpr double kFirstSliceS = 0.5e-3;
  static constexpr double kSliceS = 10e-3;

  Segment* seg = nullptr;
  double timeout_s = 0.0;
  bool check_pids = false;
  std::vector<int64_t> pids, starts;
  // Looks, between sleeps, whether the silent ranks are in a call of another workspace of
  // this group (ops called in another order on some rank); throws ShmError then.
  std::function<void(const std::vector<int>& silent)> look_elsewhere;

  void wait_all(int which, int64_t target) const {
    for (int j = 0; j < seg->world; ++j) {
      if (j != seg->rank) wait_rank(which, j, target, -1);
    }
  }

  // Wait until rank j's flag reaches target. only: -1 when every other rank waits for the same
  // target (an error names all that have not reached it), else j (it names j alone).
  void wait_rank(int which, int j, int64_t target, int only) const {
    if (seg->flag(which, j)->load(std::memory_order_acquire) >= target) return;
    wait_slow(which, j, target, only);
  }

 private:
  void wait_slow(int which, int j, int64_t target, int only) const;
  void sleep_on(int which, int j, int64_t target, int only, double deadline,
                double slice) const;
  bool shares_cpu(int j) const;
  std::vector<int> silent_ranks(int which, int64_t target, int only) const;
  std::string silent_list(const std::vector<int>& silent) const;
  [[noreturn]] void timed_out(int which, int64_t target, int only) const;
  void check_alive(int which, int64_t target, int only) const;
};

// ---- the copy-mode tuner ---------------------------------------------------------------------

// Picks the copy mode of each call. In auto mode each size class runs a trial every
// kTuneEpoch calls: kTunePairs pairs of calls, cached then streaming, each rank counting which
// of the pair was faster; each rank posts its count as a vote in the header, and at the next
// call of that size (after the arrival wait, when every vote is final) every rank adds the same
// votes and makes the same choice. Results do not depend on the mode.
class CopyTuner {
 public:
  struct Plan {
    bool streaming = false;
    int decide = -1;       // the size class whose votes to count after the arrival wait
    int bucket = -1;       // the size class on trial (-1: none)
    int64_t trial = -1;
  };
  Plan plan(int64_t bytes, int mode);
  void record(const Plan& plan, double took, const Segment& s);
  void decide(int bucket, const Segment& s);
  std::vector<std::tuple<int64_t, bool, bool, int64_t, int64_t>> modes() const;

 private:
  struct Tuning {  // one size class
    int64_t calls = 0;
    bool streaming = false;
    bool decided = false;
    int vote_sum = 0;
    int wins = 0;         // this trial: pairs streaming won minus pairs cached won
    double cached_s = 0;  // the current pair's cached call
  };
  static int bucket_of(int64_t bytes) {  // floor(log2(bytes)), bytes >= 1
    return std::min(layout::kVoteBuckets - 1, 63 - __builtin_clzll(uint64_t(bytes)));
  }
  Tuning tuning_[layout::kVoteBuckets];
};

}  // namespace arfuse
