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
#include "epilogue.h"
#include "layout.h"
#include "memory_access.h"
#include "vec.h"

namespace arfuse {

constexpr int64_t kBlockBytes = 64 * 1024;  // rows per step, in bytes
// One-shot copies this many blocks ahead of the block it finishes, so that a peer a little
// behind does not stall this rank at every block (measured: at 64 tokens of 4096 fp32 on 2
// ranks, ~10% faster than copying and finishing in lockstep; 1, 2 and 4 did about the same).
constexpr int64_t kLeadBlocks = 2;
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

// A failure of the group during a call; bindings.cpp raises it as arfuse.errors.CallTimeout,
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

class Waiter {
 public:
  // Spin this long for a peer on another CPU before sleeping: first with pause only, then
  // yielding the CPU between looks (another task on this CPU may need it). Ranks on their own
  // cores meet within microseconds in a loop of calls; a peer further behind is slept on.
  static constexpr double kSpinPauseS = 50e-6;
  static constexpr double kSpinS = 1e-3;
  // Sleeps: after spinning for a peer on another CPU each is this long, so a missed wake-up
  // (see post_flag; it can happen at any sleep) costs at most that; kSliceS is the longest
  // between deadline and liveness looks. For a peer on this CPU (which cannot miss a wake-up)
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

// ---- one call ----------------------------------------------------------------------------------

struct Exchange {  // what one call's exchange needs
  const Segment& seg;
  const Waiter& waiter;
  CopyTuner& tuner;
  const Call& c;
  const void* x;
  int64_t seq;
  int64_t row_bytes;
  bool copy;       // x is not in my slot yet
  bool streaming;  // copy with streaming stores
  int decide;      // CopyTuner::Plan::decide
  int64_t word0, word1;  // this rank's signature
  int64_t call_base() const { return seq * layout::kProgressUnits; }
};

inline void copy_in(char* dst, const char* src, size_t n, bool streaming) {
  if (streaming) stream_copy(dst, src, n);
  else copy_prefetching(dst, src, n);
}

// Call seq without data: announce it whole, wait until every rank has entered it, compare the
// signatures. For a call of zero tokens, and for a call this rank runs elsewhere (over
// capacity): a rank whose call differs from the others' must not leave them waiting.
inline void meet_without_data(const Segment& s, const Waiter& waiter, int64_t seq,
                              int64_t word0, int64_t word1) {
  const int64_t call_base = seq * layout::kProgressUnits;
  s.post(0, call_base + layout::kProgressUnits - 1);
  waiter.wait_all(0, call_base + 1);
  check_signatures(s, seq, word0, word1);
}

inline void run_empty(const Exchange& e) {
  meet_without_data(e.seg, e.waiter, e.seq, e.word0, e.word1);
}

// One-shot, block by block: copy a block in, say so, finish it as soon as every rank has, while
// it is still in cache (the whole call would not fit in cache at once). Copying runs
// kLeadBlocks ahead; an input already in the slot (input_buffer) is announced whole at once,
// so ranks do not meet at every block.
template <int D>
void run_oneshot(const Exchange& e) {
  using T = typename Elem<D>::T;
  const Segment& s = e.seg;
  const Call& c = e.c;
  const int64_t buf = e.seq & 1, H = c.hidden;
  const int64_t block_rows = std::max<int64_t>(1, kBlockBytes / e.row_bytes);
  const int64_t blocks = (c.tokens + block_rows - 1) / block_rows;
  char* slot = s.input_slot(s.rank, buf);
  const T* inputs[layout::kMaxWorld];
  for (int j = 0; j < s.world; ++j) inputs[j] = reinterpret_cast<const T*>(s.input_slot(j, buf));
  int64_t published = 0;  // blocks of my input in my slot, announced
  auto publish_until = [&](int64_t n) {
    n = std::min(n, blocks);
    if (n <= published) return;
    if (e.copy) {
      const int64_t begin = published * block_rows;
      const int64_t end = std::min<int64_t>(c.tokens, n * block_rows);
      copy_in(slot + begin * e.row_bytes, static_cast<const char*>(e.x) + begin * e.row_bytes,
              size_t((end - begin) * e.row_bytes), e.streaming);
    }
    published = n;
    s.post(0, e.call_base() + n);
  };
  const int64_t lead = e.copy ? kLeadBlocks : blocks;
  T* out = static_cast<T*>(c.out);
  T* residual_out = static_cast<T*>(c.residual_out);
  for (int64_t b = 0; b < blocks; ++b) {
    publish_until(b + 1 + lead);
    e.waiter.wait_all(0, e.call_base() + b + 1);
    if (b == 0) {
      check_signatures(s, e.seq, e.word0, e.word1);
      if (e.decide >= 0) e.tuner.decide(e.decide, s);
    }
    const int64_t first = b * block_rows;
    const int64_t end = std::min<int64_t>(c.tokens, first + block_rows);
    finish_rows<D>(inputs, s.world, first, first, end - first, c, out + first * H,
                   residual_out ? residual_out + first * H : nullptr);
  }
}

// Two-shot: each rank sums its block of rows (rank order, rounded to T: exactly the one-shot
// sum) into its result slot and finishes those rows at once; each then finishes the other
// blocks from their owners' sums. Only inputs and sums cross between ranks, and every rank
// runs the same epilogue on the same sums (bit-identical ranks). Pipelined in steps of rows:
// at step k a rank sums and finishes step k of its own rows while it copies step k + 1 of
// every other owner's rows (rank + 1 first; StepCopy), and then finishes step k - 1 of the
// others' rows from their sums; so the rows of x it copied are still in cache when it
// overwrites them (out = x), and every wait is for a peer at most one step behind (step 0 is
// copied on entry). Progress is counted in the flags (arrive: steps copied; done: steps
// summed).
struct TwoShotGeometry {
  int64_t tokens, chunk, block_rows, steps;
  int world;
  int64_t begin(int j) const { return std::min<int64_t>(tokens, chunk * j); }
  int64_t end(int j) const { return std::min<int64_t>(tokens, chunk * (j + 1)); }
  // Rows [first, last) of step k of owner j's chunk (empty past its end).
  std::pair<int64_t, int64_t> rows(int j, int64_t k) const {
    const int64_t first = std::min(end(j), begin(j) + k * block_rows);
    return {first, std::min(end(j), first + block_rows)};
  }
  // The copier's arrival progress once it has copied step k of the chunk at position p of
  // its order (owner copier + 1 + p).
  int64_t copied(int64_t k, int p) const { return k * (world - 1) + p + 1; }
  int position(int owner, int copier) const { return (owner - copier - 1 + world) % world; }
};

// The copy of step k of every other owner's rows of x into my slot (rank + 1's first), each
// owner's rows announced in the arrival flag as soon as they are in. Taken whole (finish), or
// a slice at a time between the segments of the rows this rank finishes meanwhile (step, after
// spread_over): those rows wait on loads from other cores, the copy on stores to lines other
// cores read, and each goes on while the other waits.
class StepCopy {
 public:
  StepCopy(const Exchange& e, const TwoShotGeometry& g, int64_t k) : e_(e) {
    const Segment& s = e.seg;
    char* slot = s.input_slot(s.rank, e.seq & 1);
    const char* x = static_cast<const char*>(e.x);
    for (int p = 0; p + 1 < s.world; ++p) {
      const auto [r0, r1] = g.rows((s.rank + 1 + p) % s.world, k);
      pieces_[p] = Piece{slot + r0 * e.row_bytes, x + r0 * e.row_bytes,
                         size_t(std::max<int64_t>(0, r1 - r0) * e.row_bytes),
                         e.call_base() + g.copied(k, p)};
      left_ += pieces_[p].bytes;
    }
    count_ = s.world - 1;
  }
  // Slices for `calls` calls of step(), whole cache lines each.
  void spread_over(int64_t calls) {
    const size_t per = left_ / size_t(std::max<int64_t>(calls, 1)) + 1;
    slice_ = (per + layout::kCacheLine - 1) / size_t(layout::kCacheLine) * layout::kCacheLine;
  }
  void step() { advance(slice_); }
  void finish() { advance(SIZE_MAX); }

 private:
  struct Piece {
    char* dst;
    const char* src;
    size_t bytes;
    int64_t progress;  // the arrival flag once this piece is in
  };
  void advance(size_t budget) {
    while (next_ < count_) {
      Piece& piece = pieces_[next_];
      const size_t n = std::min(budget, piece.bytes - done_);
      if (n > 0) {
        copy_in(piece.dst + done_, piece.src + done_, n, e_.streaming);
        done_ += n;
        budget -= n;
        left_ -= n;
      }
      if (done_ < piece.bytes) return;  // the budget is spent
      e_.seg.post(0, piece.progress);
      ++next_;
      done_ = 0;
    }
  }
  const Exchange& e_;
  Piece pieces_[layout::kMaxWorld - 1] = {};
  int count_ = 0, next_ = 0;
  size_t done_ = 0, left_ = 0, slice_ = SIZE_MAX;
};

// Sum step k of my rows into my result slot once every copier has them, and finish those
// rows in the same pass (finish_rows' sum_out: the sum goes to the slot and on into the
// epilogue while it is in registers).
template <int D>
void twoshot_own_step(const Exchange& e, const TwoShotGeometry& g,
                      const typename Elem<D>::T* const* inputs, int64_t k, StepCopy* next) {
  using T = typename Elem<D>::T;
  const Segment& s = e.seg;
  const Call& c = e.c;
  const auto [r0, r1] = g.rows(s.rank, k);
  if (r1 <= r0) {
    if (next) next->finish();
    return;
  }
  for (int j = 0; j < s.world; ++j) {
    if (j != s.rank) {
      e.waiter.wait_rank(0, j, e.call_base() + g.copied(k, g.position(s.rank, j)), j);
    }
  }
  const int64_t H = c.hidden, begin = g.begin(s.rank);
  T* mine = reinterpret_cast<T*>(s.result_slot(s.rank, e.seq & 1));
  T* out = static_cast<T*>(c.out);
  T* residual_out = static_cast<T*>(c.residual_out);
  if (next) next->spread_over(between_calls(c, r1 - r0));
  finish_rows<D>(inputs, s.world, r0, r0, r1 - r0, c, out + r0 * H,
                 residual_out ? residual_out + r0 * H : nullptr, mine + (r0 - begin) * H,
                 [next] {
                   if (next) next->step();
                 });
  if (next) next->finish();
  s.post(1, e.call_base() + k + 1);
}

// Finish step k of every other owner's rows from its sums, once it has announced them (from
// its residual_out, without reading this rank's residual, when the slot holds that).
template <int D>
void twoshot_others_step(const Exchange& e, const TwoShotGeometry& g, int64_t k) {
  using T = typename Elem<D>::T;
  const Segment& s = e.seg;
  Call c = e.c;
  if (c.slot_holds_residual_out) c.residual = nullptr;  // residual_out = T(its value): exact
  const int64_t H = c.hidden;
  T* out = static_cast<T*>(c.out);
  T* residual_out = static_cast<T*>(c.residual_out);
  for (int p = 0; p + 1 < s.world; ++p) {
    const int j = (s.rank + 1 + p) % s.world;
    const auto [r0, r1] = g.rows(j, k);
    if (r1 <= r0) continue;
    e.waiter.wait_rank(1, j, e.call_base() + k + 1, j);
    const T* theirs[1] = {reinterpret_cast<const T*>(s.result_slot(j, e.seq & 1))};
    finish_rows<D>(theirs, 1, r0 - g.begin(j), r0, r1 - r0, c, out + r0 * H,
                   residual_out ? residual_out + r0 * H : nullptr);
  }
}

template <int D>
void run_twoshot(const Exchange& e) {
  using T = typename Elem<D>::T;
  const Segment& s = e.seg;
  TwoShotGeometry g{};
  g.tokens = e.c.tokens;
  g.world = s.world;
  g.chunk = (g.tokens + s.world - 1) / s.world;
  g.block_rows = std::max<int64_t>(1, kBlockBytes / e.row_bytes);
  g.steps = (g.chunk + g.block_rows - 1) / g.block_rows;  // steps per chunk, at most
  const T* inputs[layout::kMaxWorld];
  for (int j = 0; j < s.world; ++j) {
    inputs[j] = reinterpret_cast<const T*>(s.input_slot(j, e.seq & 1));
  }
  if (e.copy) {
    inputs[s.rank] = static_cast<const T*>(e.x);  // my own rows: read from x
    StepCopy(e, g, 0).finish();
  } else {
    s.post(0, e.call_base() + layout::kProgressUnits - 1);  // all in the slot already
  }
  // Every rank has announced progress of this call by now or soon: its signature is visible.
  // Compare before waiting for any block (a rank with other tokens counts other steps).
  e.waiter.wait_all(0, e.call_base() + 1);
  check_signatures(s, e.seq, e.word0, e.word1);
  for (int64_t k = 0; k < g.steps; ++k) {
    std::optional<StepCopy> next;  // step k + 1's copy, done during my rows of step k
    if (e.copy && k + 1 < g.steps) next.emplace(e, g, k + 1);
    twoshot_own_step<D>(e, g, inputs, k, next ? &*next : nullptr);
    if (k > 0) twoshot_others_step<D>(e, g, k - 1);
  }
  twoshot_others_step<D>(e, g, g.steps - 1);
  // Every other rank's flags of this call have been seen by now (a rank with an empty
  // block waits on every owner; the others wait on every copier), so every vote is final.
  if (e.decide >= 0) e.tuner.decide(e.decide, s);
}

}  // namespace arfuse
