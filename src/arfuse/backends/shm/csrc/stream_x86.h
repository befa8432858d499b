// x86's streaming (non-temporal) stores, for memory_access.h (stream_store, stream_fence) and
// the x86 vector headers (put_bits), as wide as the build's target has them.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace arfuse {

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
