// How the exchange touches memory: software prefetch, the two copies into a slot (prefetching,
// streaming) and streaming stores (the slot copy's, and a call's large outputs of its own;
// x86's in stream_x86.h).
//
// Software prefetch in the exchange's loops. The lines a rank reads from a peer's slot, and the
// lines of its own slots that it overwrites, were last in the other core's cache: each access
// waits on that core, and the hardware keeps too few such requests in flight for one core to
// stream them. Asking for them kPrefetchBytes ahead keeps more in flight; PREFETCHW (built
// with -mprfchw where the CPU has it, an ordinary prefetch otherwise) also takes the line for
// writing, so the store does not wait for the peer's copy to be invalidated. The outputs' lines
// are taken for writing ahead too: a new output tensor's lines come from beyond this core's
// caches, and a store to such a line waits for it to be read first (in place they are in cache
// already and the prefetch finds them there). A prefetch never faults, so it may reach past
// the end of a buffer.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include "stream_x86.h"
#endif

namespace arfuse {

constexpr std::uintptr_t kPrefetchBytes = 1024;  // 512-4096 measured alike; none: slower

inline const char* ahead(const void* p) {
  return reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) + kPrefetchBytes);
}
inline void prefetch_read(const void* p) { __builtin_prefetch(ahead(p), 0, 3); }
inline void prefetch_write(const void* p) { __builtin_prefetch(ahead(p), 1, 3); }

// The lines that step h of a row pass reaches a little later: every input row's, and for
// writing the destination row's (dst) and the result slot's (sum_dst; null when the pass
// stores no sums).
template <class T>
inline void prefetch_step(const T* const* rows, int ranks, std::int64_t h, T* dst, T* sum_dst) {
  for (int j = 0; j < ranks; ++j) prefetch_read(rows[j] + h);
  prefetch_write(dst + h);
  if (sum_dst != nullptr) prefetch_write(sum_dst + h);
}

// dst = src, n bytes, each destination line taken for writing ahead of its store (the slot
// copy); with kReadAhead, each source line asked for ahead of its load instead (as the row
// passes read a peer's lines: arfuse bench's peer-read rate, through exchange_copy).
template <bool kReadAhead = false>
inline void copy_prefetching(char* dst, const char* src, std::size_t n) {
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    if constexpr (kReadAhead) prefetch_read(src + i);
    else prefetch_write(dst + i);
    std::memcpy(dst + i, src + i, 64);
  }
  std::memcpy(dst + i, src + i, n - i);
}

// stream_store(dst, src, n): dst = src with streaming (non-temporal) stores where the machine
// has them (x86: stream_x86.h); stream_fence(): orders them before every later store. On other
// machines a plain copy and no fence: no streaming store has been measured there, and a
// plain store is published by the flag's release store like any other.
#if !(defined(__x86_64__) || defined(__i386__))
inline void stream_store(char* dst, const char* src, std::size_t n) { std::memcpy(dst, src, n); }
inline void stream_fence() {}
#endif

// stream_store, then the fence: a later release store of the arrival flag orders after the
// data.
inline void stream_copy(char* dst, const char* src, std::size_t n) {
  stream_store(dst, src, n);
  stream_fence();
}

}  // namespace arfuse
