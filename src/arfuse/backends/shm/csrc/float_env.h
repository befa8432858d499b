// The floating-point environment the kernel computes in, whatever the caller's thread set.
//
// The kernel's fp32 arithmetic follows the thread's control register: the rounding mode
// (fesetround), on x86 flush-to-zero and denormals-are-zero (torch.set_flush_denormal(True)
// sets both) and the exception masks (feenableexcept would make a NaN trap), on aarch64
// FPCR's flush-to-zero (FZ, FZ16: fesetenv sets them), default-NaN mode (DN: every NaN
// result would be the default NaN, against conversions.h's NaN rule), the alternative
// half-precision format (AHP), FEAT_AFP's AH, FIZ and NEP, and the trap enables. Under any of
// them the results would leave the documented formula, and two ranks whose threads differ
// would write different bytes for the same sums. So a call runs in the default environment
// (round to nearest even, denormals kept, exceptions masked) and gives the caller's back when
// it ends. Reading the register costs about a cycle; it is written only when it differs.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif !defined(__aarch64__)
#include <cfenv>
#endif

#include <cstdint>

namespace arfuse {

class DefaultFloatEnv {
 public:
#if defined(__x86_64__) || defined(__i386__)
  // MXCSR: exceptions masked (bits 7-12), round to nearest (bits 13-14 zero), no FTZ (bit 15)
  // and no DAZ (bit 6); the status flags (bits 0-5) are the caller's and stay as they are.
  static constexpr unsigned kControlMask = 0xffc0u;
  static constexpr unsigned kDefaultControl = 0x1f80u;
  DefaultFloatEnv() : saved_(_mm_getcsr()) {
    if ((saved_ & kControlMask) != kDefaultControl) {
      _mm_setcsr((saved_ & ~kControlMask) | kDefaultControl);
      changed_ = true;
    }
  }
  ~DefaultFloatEnv() {
    if (changed_) _mm_setcsr((_mm_getcsr() & ~kControlMask) | (saved_ & kControlMask));
  }

 private:
  unsigned saved_;
  bool changed_ = false;
#elif defined(__aarch64__)
  // FPCR: FIZ, AH, NEP (bits 0-2), the trap enables IOE..IXE, IDE (8-12, 15), FZ16 (19), RMode
  // (22-23: zero is round to nearest), FZ (24), DN (25), AHP (26) all zero; the rest (the
  // length and stride fields of AArch32, reserved bits) stays the caller's.
  static constexpr uint64_t kControlMask = 0x7c89f07u;
  static constexpr uint64_t kDefaultControl = 0;
  DefaultFloatEnv() : saved_(fpcr()) {
    if ((saved_ & kControlMask) != kDefaultControl) {
      set_fpcr((saved_ & ~kControlMask) | kDefaultControl);
      changed_ = true;
    }
  }
  ~DefaultFloatEnv() {
    if (changed_) set_fpcr((fpcr() & ~kControlMask) | (saved_ & kControlMask));
  }

 private:
  static uint64_t fpcr() {
    uint64_t v;
    asm volatile("mrs %0, fpcr" : "=r"(v));
    return v;
  }
  static void set_fpcr(uint64_t v) { asm volatile("msr fpcr, %0" : : "r"(v)); }
  uint64_t saved_;
  bool changed_ = false;
#else
  // Elsewhere the rounding mode, through standard C++ (a flush-to-zero bit is not reachable
  // there and stays the caller's).
  DefaultFloatEnv() : saved_(std::fegetround()) {
    if (saved_ != FE_TONEAREST) std::fesetround(FE_TONEAREST);
  }
  ~DefaultFloatEnv() {
    if (saved_ != FE_TONEAREST) std::fesetround(saved_);
  }

 private:
  int saved_;
#endif
  DefaultFloatEnv(const DefaultFloatEnv&) = delete;
  DefaultFloatEnv& operator=(const DefaultFloatEnv&) = delete;
};

}  // namespace arfuse
