// finish_rows: a call's rows finished by the epilogue (epilogue.h), on the calling thread or,
// when the rule (parallel.h) says so, on the rank's threads: contiguous chunks of whole rows,
// or with fewer rows than threads their columns, with the same bytes as the serial path.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "epilogue.h"
#include "parallel.h"

namespace arfuse {

// The lane sums of a row's squares from its residual_out (r in T, as pass 1 squares it:
// r * r, added in 32 lanes, lane = h % 32, each in order of h): what pass 1 leaves in its lanes.
// Plain adds (which the compiler can run several lanes at a time) give add_o's value whenever
// no sum is NaN; a NaN lane (rare) takes the row again with add_o, for its NaN rule.
template <int D>
void square_lanes(const typename Elem<D>::T* r, int64_t H, float* lanes) {
  using E = Elem<D>;
  const int64_t whole = H / kSumLanes * kSumLanes;
  for (int l = 0; l < kSumLanes; ++l) lanes[l] = 0.0f;
  for (int64_t h = 0; h < whole; h += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
      const float v = E::load(r[h + l]);
      lanes[l] = lanes[l] + v * v;
    }
  }
  for (int64_t h = whole; h < H; ++h) {
    const float v = E::load(r[h]);
    lanes[h % kSumLanes] = lanes[h % kSumLanes] + v * v;
  }
  bool nan = false;
  for (int l = 0; l < kSumLanes; ++l) nan = nan || lanes[l] != lanes[l];
  if (!nan) return;
  for (int l = 0; l < kSumLanes; ++l) lanes[l] = 0.0f;
  for (int64_t h = 0; h < H; ++h) {
    const float v = E::load(r[h]);
    lanes[h % kSumLanes] = add_o(lanes[h % kSumLanes], v * v);
  }
}

static_assert(kColumnUnit % kSegment == 0, "a column range is whole segments of the serial path");
static_assert(kColumnUnit % (kGroupUnit << kGroupCodes) == 0,
              "a column range is whole groups of fp8_group");

// The rows of a call with fewer rows than threads, their columns split (plan.split is
// Split::kColumns; c stores plainly). Plain: pass 1 and the quantisation by column ranges.
// RMSNorm: pass 1 by column ranges (residual_out and sum_out, exactly what the serial pass
// stores), then on the calling thread each row's sum of squares from its residual_out in the
// serial lanes and order (square_lanes) and its factor, then pass 2 and the quantisation by
// column ranges. FP8 dynamic quantises whole rows on the calling thread at the end.
template <int D>
void finish_columns(const Plan& plan, const typename Elem<D>::T* const* inputs, int ranks,
                    int64_t in_row, int64_t row, int64_t n, const Call& c,
                    typename Elem<D>::T* out, typename Elem<D>::T* residual_out,
                    typename Elem<D>::T* sum_out) {
  using T = typename Elem<D>::T;
  const int64_t H = c.hidden;
  const bool norm = c.weight != nullptr;
  const bool by_columns = quantizes_by_columns(c);
  const T* residual = c.residual ? static_cast<const T*>(c.residual) + row * H : nullptr;
  for_each_part(plan, n, H, [&](int64_t, int64_t, int64_t s, int64_t e) {
    const T* rows[layout::kMaxWorld];
    for (int64_t i = 0; i < n; ++i) {
      float lanes[kSumLanes] = {};  // not used: the calling thread sums the row in order
      for (int j = 0; j < ranks; ++j) rows[j] = inputs[j] + (in_row + i) * H;
      first_pass<D>(rows, ranks, norm && residual ? residual + i * H : nullptr, norm,
                    out + i * H, norm ? residual_out + i * H : nullptr,
                    sum_out ? sum_out + i * H : nullptr, lanes, s, e,
                    c.slot_holds_residual_out);
      if (!norm && by_columns) quantize_columns<D>(out + i * H, c, row + i, s, e);
    }
  });
  if (norm) {
    float inv_few[16];
    std::vector<float> inv_many(n > 16 ? size_t(n) : 0);
    float* inv = n > 16 ? inv_many.data() : inv_few;
    for (int64_t i = 0; i < n; ++i) {
      float lanes[kSumLanes];
      square_lanes<D>(residual_out + i * H, H, lanes);
      inv[i] = row_inv(c, lanes);
    }
    for_each_part(plan, n, H, [&](int64_t, int64_t, int64_t s, int64_t e) {
      for (int64_t i = 0; i < n; ++i) {
        second_pass<D>(c, inv[i], residual_out + i * H, out + i * H, s, e);
        if (by_columns) quantize_columns<D>(out + i * H, c, row + i, s, e);
      }
    });
  }
  if (!by_columns) {
    for (int64_t i = 0; i < n; ++i) quantize_row<D>(out + i * H, c, row + i);
  }
}

// finish_rows_serial on the rank's threads as `plan` says: contiguous chunks of whole rows, one
// per thread, or with fewer rows than threads their columns (finish_columns). Streaming stores
// go through the one staging buffer, so the parallel path stores plainly (the same bytes). Kept
// out of line: inlined beside the serial path, it changes how the compiler builds that path,
// which then runs slower on one thread (benchmarks/ab_compare.py against a build without it).
template <int D>
__attribute__((noinline)) void finish_rows_parallel(
    const Plan& plan, const typename Elem<D>::T* const* inputs, int ranks, int64_t in_row,
    int64_t row, int64_t n, const Call& c, typename Elem<D>::T* out,
    typename Elem<D>::T* residual_out, typename Elem<D>::T* sum_out) {
  const int64_t H = c.hidden;
  Call plain = c;
  plain.stream_out = plain.stream_residual_out = false;
  plain.staging = nullptr;
  if (plan.split == Split::kColumns) {
    finish_columns<D>(plan, inputs, ranks, in_row, row, n, plain, out, residual_out, sum_out);
    return;
  }
  for_each_part(plan, n, H, [&](int64_t b, int64_t e, int64_t, int64_t) {
    finish_rows_serial<D>(inputs, ranks, in_row + b, row + b, e - b, plain, out + b * H,
                          residual_out ? residual_out + b * H : nullptr,
                          sum_out ? sum_out + b * H : nullptr);
  });
}

// finish_rows_serial, or on the rank's threads when the rule (parallel.h) says so. between()
// then runs its calls on the calling thread first (two-shot: the whole copy of the next step,
// which reads rows this step does not touch), and the rows go parallel with nothing between.
template <int D, class Between = NothingBetween>
void finish_rows(const typename Elem<D>::T* const* inputs, int ranks, int64_t in_row,
                 int64_t row, int64_t n, const Call& c, typename Elem<D>::T* out,
                 typename Elem<D>::T* residual_out, typename Elem<D>::T* sum_out = nullptr,
                 Between&& between = Between{}) {
  using T = typename Elem<D>::T;
  const int64_t H = c.hidden;
  const Plan plan = call_plan(n * H * int64_t(sizeof(T)) * ranks, n, H);
  if (plan.split == Split::kSerial) {
    finish_rows_serial<D>(inputs, ranks, in_row, row, n, c, out, residual_out, sum_out,
                          std::forward<Between>(between));
    return;
  }
  for (int64_t k = between_calls(c, n); k > 0; --k) between();
  finish_rows_parallel<D>(plan, inputs, ranks, in_row, row, n, c, out, residual_out, sum_out);
}

}  // namespace arfuse
