// How the exchange touches memory: software prefetch, the two copies into a slot (prefetching,
// streaming) and streaming stores (the slot copy's, and a call's large outputs of its own).
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

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <algorithm>
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

// dst = src, n bytes, with streaming (non-temporal) stores for the aligned body where the CPU
// has them, as wide as it has them (the write-combining buffers fill whole lines from narrower
// stores too, with more instructions); the lines go to memory without being read first and
// leave no copy in any cache. Unordered with later stores until a stream_fence(). Without SSE2:
// a plain copy.
inline void stream_store(char* dst, const char* src, std::size_t n) {
#if defined(__SSE2__)
  std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(dst) & 63)) & 63;
  head = std::min(head, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n & ~std::size_t(63);
  for (std::size_t i = 0; i < body; i += 64) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#elif defined(__AVX__)
    for (std::size_t k = 0; k < 64; k += 32) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + k));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + k), v);
    }
#else
    for (std::size_t k = 0; k < 64; k += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + k));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + k), v);
    }
#endif
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

// Orders the streaming stores before every later store (a flag that publishes them).
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// stream_store, then the fence: a later release store of the arrival flag orders after the
// data.
inline void stream_copy(char* dst, const char* src, std::size_t n) {
  stream_store(dst, src, n);
  stream_fence();
}

// One vector of bits to p: an ordinary store, or (kStream) a streaming one, for which p must be
// aligned to the vector's width.
#if defined(__SSE2__)
template <bool kStream>
inline void put_bits(void* p, __m128i v) {
  if constexpr (kStream) _mm_stream_si128(static_cast<__m128i*>(p), v);
  else _mm_storeu_si128(static_cast<__m128i*>(p), v);
}
#endif
#if defined(__AVX__)
template <bool kStream>
inline void put_bits(void* p, __m256i v) {
  if constexpr (kStream) _mm256_stream_si256(static_cast<__m256i*>(p), v);
  else _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}
template <bool kStream>
inline void put_bits(void* p, __m256 v) {
  if constexpr (kStream) _mm256_stream_ps(static_cast<float*>(p), v);
  else _mm256_storeu_ps(static_cast<float*>(p), v);
}
#endif
#if defined(__AVX512F__)
template <bool kStream>
inline void put_bits(void* p, __m512i v) {
  if constexpr (kStream) _mm512_stream_si512(static_cast<__m512i*>(p), v);
  else _mm512_storeu_si512(p, v);
}
template <bool kStream>
inline void put_bits(void* p, __m512 v) {
  if constexpr (kStream) _mm512_stream_ps(static_cast<float*>(p), v);
  else _mm512_storeu_ps(static_cast<float*>(p), v);
}
#endif

}  // namespace arfuse
