// The limits of a call's numbers: what the fp32 kernels can carry. arfuse/arg_checks.py reads
// the constexpr lines of this file too (arfuse/ctables.py), so the Python checks and the fast
// path refuse exactly the same values: eps and an NVFP4 scale >= the smallest positive fp32,
// an FP8 scale >= 1 / FLT_MAX (its reciprocal finite), all <= FLT_MAX; |weight_bias| <= FLT_MAX.
#pragma once

namespace arfuse {

constexpr double kFp32Max = 3.4028234663852886e38;
constexpr double kFp32Tiny = 1.401298464324817e-45;
constexpr double kFp8ScaleMin = 1.0 / kFp32Max;

}  // namespace arfuse
