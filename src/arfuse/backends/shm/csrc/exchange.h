// One call's exchange on the segment (protocol.h has how the ranks meet): the copy into the
// slot, then one-shot (every rank reduces every row) or two-shot (a pipeline of steps: each
// rank reduces its own block of rows, and every rank finishes every row from the sums).
#pragma once

#include "protocol.h"

namespace arfuse {

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
  int64_t ring_blocks;  // one-shot's ring (kRingBlocks; 0: none)
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
// so ranks do not meet at every block. A copied input with more blocks than the ring goes
// round the slot's first ring blocks (block b at b % ring): what a rank copies and what its
// peers read of it stay in cache instead of passing through memory. Block b's place is taken
// by block b + ring only once every peer has finished block b (its done flag, posted after
// every block). Each rank says in its arrival line where its blocks are (its ring, or 0).
template <int D>
void run_oneshot(const Exchange& e) {
  using T = typename Elem<D>::T;
  const Segment& s = e.seg;
  const Call& c = e.c;
  const int64_t buf = e.seq & 1, H = c.hidden;
  const int64_t block_rows = std::max<int64_t>(1, kBlockBytes / e.row_bytes);
  const int64_t blocks = (c.tokens + block_rows - 1) / block_rows;
  const int64_t my_ring = e.copy && blocks > e.ring_blocks ? e.ring_blocks : 0;
  s.ring(s.rank, e.seq)->store(int32_t(my_ring), std::memory_order_relaxed);  // posted below
  auto place = [block_rows](int64_t b, int64_t ring) {  // b's first row in its slot
    return (ring > 0 ? b % ring : b) * block_rows;
  };
  char* slot = s.input_slot(s.rank, buf);
  const T* inputs[layout::kMaxWorld];
  int64_t ring[layout::kMaxWorld] = {};
  for (int j = 0; j < s.world; ++j) inputs[j] = reinterpret_cast<const T*>(s.input_slot(j, buf));
  int64_t published = 0;  // blocks of my input in my slot, announced
  auto publish_until = [&](int64_t n) {
    n = std::min(n, blocks);
    if (n <= published) return;
    if (!e.copy) {
      published = n;
      s.post(0, e.call_base() + n);
      return;
    }
    for (; published < n; ++published) {
      const int64_t b = published;
      if (my_ring > 0 && b >= my_ring) {  // its place still holds block b - my_ring
        for (int j = 0; j < s.world; ++j) {
          if (j != s.rank) e.waiter.wait_rank(1, j, e.call_base() + b - my_ring + 1, j);
        }
      }
      const int64_t begin = b * block_rows;
      const int64_t end = std::min<int64_t>(c.tokens, begin + block_rows);
      copy_in(slot + place(b, my_ring) * e.row_bytes,
              static_cast<const char*>(e.x) + begin * e.row_bytes,
              size_t((end - begin) * e.row_bytes), e.streaming);
      s.post(0, e.call_base() + b + 1);
    }
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
      for (int j = 0; j < s.world; ++j) ring[j] = s.ring(j, e.seq)->load(std::memory_order_relaxed);
    }
    const int64_t first = b * block_rows;
    const int64_t end = std::min<int64_t>(c.tokens, first + block_rows);
    const T* rows[layout::kMaxWorld];
    for (int j = 0; j < s.world; ++j) rows[j] = inputs[j] + place(b, ring[j]) * H;
    finish_rows<D>(rows, s.world, 0, first, end - first, c, out + first * H,
                   residual_out ? residual_out + first * H : nullptr);
    if (blocks > kLeadBlocks + 1) s.post(1, e.call_base() + b + 1);  // a peer's ring may wrap
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
