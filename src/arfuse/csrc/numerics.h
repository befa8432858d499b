// The epilogue's fixed order of operations that both languages follow (the shm kernel's
// epilogue.h, the torch epilogue arfuse/epilogue.py, which reads this file: arfuse/ctables.py).
#pragma once

namespace arfuse {

// The sum of squares is added up in 32 lanes, lane = h % 32, each in order of h, then the lanes
// combined by halving; so many that the vector forms keep independent accumulators (no chain
// of dependent adds).
constexpr int kSumLanes = 32;

}  // namespace arfuse
