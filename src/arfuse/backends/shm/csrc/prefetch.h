// Software prefetch in the exchange's loops. The lines a rank reads from a peer's slot, and the
// lines of its own slots that it overwrites, were last in the other core's cache: each access
// waits on that core, and the hardware keeps too few such requests in flight for one core to
// stream them. Asking for them kPrefetchBytes ahead keeps more in flight; PREFETCHW (built
// with -mprfchw where the CPU has it, an ordinary prefetch otherwise) also takes the line for
// writing, so the store does not wait for the peer's copy to be invalidated. A prefetch never
// faults, so it may reach past the end of a buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace arfuse {

constexpr std::uintptr_t kPrefetchBytes = 1024;  // 512-4096 measured alike; none: slower

inline const char* ahead(const void* p) {
  return reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) + kPrefetchBytes);
}
inline void prefetch_read(const void* p) { __builtin_prefetch(ahead(p), 0, 3); }
inline void prefetch_write(const void* p) { __builtin_prefetch(ahead(p), 1, 3); }

// The lines that step h of a row pass reaches a little later: every input row's, and the
// result slot's for writing (sum_dst; null when the pass stores no sums).
template <class T>
inline void prefetch_step(const T* const* rows, int ranks, std::int64_t h, T* sum_dst) {
  for (int j = 0; j < ranks; ++j) prefetch_read(rows[j] + h);
  if (sum_dst != nullptr) prefetch_write(sum_dst + h);
}

// dst = src, n bytes, each destination line taken for writing ahead of its store.
inline void copy_prefetching(char* dst, const char* src, std::size_t n) {
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    prefetch_write(dst + i);
    std::memcpy(dst + i, src + i, 64);
  }
  std::memcpy(dst + i, src + i, n - i);
}

}  // namespace arfuse
