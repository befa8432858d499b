// The rank's intra-op threads: when a call's work is split among several of them, and how.
//
// The rule (one place, call_plan): a call goes parallel when it reads at least
// kParallelMinBytes from its inputs, and then on at::get_num_threads() threads
// (torch.get_num_threads(), read at call time). A call with at least as many rows as threads
// splits its rows: each row is finished whole by one thread, with the same operations in the
// same order as the serial path. A call with fewer rows (decode: one token) splits the columns
// of its rows into ranges of whole kColumnUnit: every element is computed by the same
// operations as in the serial path, and a sum along a row (RMSNorm's sum of squares, an
// FP8 dynamic amax) is taken on the calling thread in the serial order. Either way the bytes
// never depend on the thread count. One thread, or a call below the threshold, runs the serial
// code alone (no parallel_for at all). Waits, flags and the two-shot copy of the
// next step (between()) stay on the calling thread.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "float_env.h"

namespace arfuse {

// Below this many input bytes a call stays on the calling thread: waking the pool costs a few
// microseconds, about what one core reduces of 64 KiB; a one-shot block (64 KiB of a rank's rows)
// at 2 ranks or more crosses it. Not measured beyond 2 cores.
constexpr int64_t kParallelMinBytes = int64_t(64) * 1024;

// Columns are split in ranges of whole units: a multiple of every vector step, of kSumLanes,
// of an NVFP4 block and of the serial path's segment (epilogue.h), so that each range starts
// where a serial segment does and every element takes the same path (vector or scalar tail).
constexpr int64_t kColumnUnit = 512;

enum class Split { kSerial, kRows, kColumns };

struct Plan {
  Split split = Split::kSerial;
  int threads = 1;
};

// How a call of `rows` rows of `columns` elements, reading `bytes` of input, is split.
inline Plan call_plan(int64_t bytes, int64_t rows, int64_t columns) {
  if (bytes < kParallelMinBytes || rows < 1) return {};
  const int t = at::get_num_threads();
  if (t <= 1 || at::in_parallel_region()) return {};
  if (rows >= t) return {Split::kRows, t};
  const int64_t units = (columns + kColumnUnit - 1) / kColumnUnit;
  if (units >= 2) return {Split::kColumns, int(std::min<int64_t>(t, units))};
  if (rows >= 2) return {Split::kRows, int(rows)};
  return {};
}

// f(begin, end) over [0, n) in `threads` contiguous chunks, on the intra-op pool, each in the
// kernel's floating-point environment (a pool thread keeps the one it was started with).
template <class F>
void parallel_chunks(int64_t n, int threads, const F& f) {
  const int64_t grain = (n + threads - 1) / threads;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    const DefaultFloatEnv env;
    f(begin, end);
  });
}

// f(row_begin, row_end, column_begin, column_end) over the parts of a [rows, columns] call as
// `plan` splits it (serial: the whole call on the calling thread).
template <class F>
void for_each_part(const Plan& plan, int64_t rows, int64_t columns, const F& f) {
  if (plan.split == Split::kRows) {
    parallel_chunks(rows, plan.threads, [&](int64_t b, int64_t e) { f(b, e, 0, columns); });
  } else if (plan.split == Split::kColumns) {
    const int64_t units = (columns + kColumnUnit - 1) / kColumnUnit;
    parallel_chunks(units, plan.threads, [&](int64_t b, int64_t e) {
      f(0, rows, b * kColumnUnit, std::min(columns, e * kColumnUnit));
    });
  } else {
    f(0, rows, 0, columns);
  }
}

}  // namespace arfuse
