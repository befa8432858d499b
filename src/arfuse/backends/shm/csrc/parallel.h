// The rank's intra-op threads: when a call's rows are worked on by several of them, and how.
//
// The rule (one place): a call goes parallel when the rows it finishes read at least
// kParallelMinBytes from the ranks' inputs and there are at least two rows, and then on
// at::get_num_threads() threads (torch.get_num_threads(), read at call time). One thread, or a
// call below the threshold, runs the serial code exactly as before (no parallel_for at all).
// Each row is finished whole by one thread, with the same operations in the same order as the
// serial path (lanes are per row), so the bytes never depend on the thread count. Waits, flags
// and the two-shot copy of the next step (between()) stay on the calling thread.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace arfuse {

// Below this many input bytes a call stays on the calling thread: waking the pool costs a few
// microseconds, about what one core reduces of 64 KiB; a one-shot block (64 KiB of a rank's rows)
// at 2 ranks or more crosses it. Not measured beyond 2 cores.
constexpr int64_t kParallelMinBytes = int64_t(64) * 1024;

// The threads a call of `rows` rows reading `bytes` of input uses (1: the serial path).
inline int call_threads(int64_t bytes, int64_t rows) {
  if (rows < 2 || bytes < kParallelMinBytes) return 1;
  const int t = at::get_num_threads();
  if (t <= 1 || at::in_parallel_region()) return 1;
  return int(rows < t ? rows : t);
}

// f(begin, end) over [0, n) in `threads` contiguous chunks, on the intra-op pool.
template <class F>
void parallel_chunks(int64_t n, int threads, const F& f) {
  const int64_t grain = (n + threads - 1) / threads;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { f(begin, end); });
}

}  // namespace arfuse
