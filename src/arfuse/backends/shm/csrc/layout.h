// Byte layout of the shm segment and the limits of one call. Python reads the constexpr lines
// of this file too (arfuse/ctables.py, for layout.py and the pure-torch path): one copy.
//
// Header page: line 0 the segment's identity (magic, layout version, creator; written by
// Python before the segment has a name, read by the sweep of stale segments), then per rank
// one cache line each of process identity (written by Python), arrival flag and done flag,
// then the copy-mode votes. A rank's arrival line holds its flag (int64 at byte 0) and,
// beside it, the signature of its current call (one per call parity, so a rank that has
// moved on to the next call never overwrites the signature a slower peer is still
// comparing), then the count of ranks asleep on the flag (int32, futex waits; the done line
// has one at the same offset) and the CPU the rank last started a call on (int32). Then, per
// rank and per buffer, an input slot of max_tokens rows and a result slot for the two-shot
// sums of the rows that rank owns.
#pragma once

#include <cstdint>

namespace arfuse {
namespace layout {

constexpr int64_t kCacheLine = 64;
constexpr int64_t kPage = 4096;
constexpr int64_t kHeaderBytes = kPage;
constexpr int64_t kBuffers = 2;
constexpr int kMaxWorld = 16;
// Line 0, int64 fields (these five stay at these offsets in every version).
constexpr int64_t kSegmentMagic = 0x4D53657375667261;  // the bytes "arfuseSM", little-endian
constexpr int64_t kSegmentVersion = 1;
constexpr int64_t kMagicOffset = 0;
constexpr int64_t kVersionOffset = 8;
constexpr int64_t kCreatorPidOffset = 16;
constexpr int64_t kCreatorStartOffset = 24;  // clock ticks after boot (/proc/PID/stat)
constexpr int64_t kCreatorPidnsOffset = 32;  // inode of the creator's /proc/self/ns/pid
constexpr int64_t kSegmentIdBytes = 40;
constexpr int64_t kIdentityOffset = kCacheLine;                         // pid, start time
constexpr int64_t kArriveOffset = kCacheLine * (1 + kMaxWorld);         // arrival flags
constexpr int64_t kDoneOffset = kCacheLine * (1 + 2 * kMaxWorld);       // done flags
constexpr int64_t kVoteOffset = kCacheLine * (1 + 3 * kMaxWorld);       // copy-mode votes
constexpr int kVoteBuckets = 40;                                        // bytes per rank
// A flag counts progress: call * kProgressUnits + blocks ready. A call has fewer blocks than
// kProgressUnits, hence the token limit.
constexpr int64_t kProgressUnits = int64_t(1) << 20;
constexpr int64_t kMaxTokens = kProgressUnits - kMaxWorld;

// The call signature (R11, signature.h): two int64 words per call parity, after the flag in
// the arrival line.
constexpr int64_t kSignatureOffset = 8;  // bytes into the arrival line
constexpr int64_t kSignatureBytes = 16;  // per parity
constexpr int64_t kWaitersOffset = 40;  // bytes into a flag's line: int32, ranks asleep on it
constexpr int64_t kCpuOffset = 44;      // bytes into an arrival line: int32, the rank's CPU
// bytes into an arrival line: int32 per call parity, the blocks of the ring the rank's one-shot
// input of that call goes round (exchange.h); 0: its rows sit at their own offsets
constexpr int64_t kRingOffset = 48;

static_assert(kCreatorPidnsOffset + 8 == kSegmentIdBytes && kSegmentIdBytes <= kIdentityOffset,
              "the segment's identity must fit in line 0");
static_assert(kVoteOffset + kMaxWorld * kVoteBuckets <= kHeaderBytes,
              "the copy-mode votes must fit in the header page");
static_assert(kSignatureOffset + kBuffers * kSignatureBytes <= kWaitersOffset &&
                  kWaitersOffset + 4 <= kCpuOffset && kCpuOffset + 4 <= kRingOffset &&
                  kRingOffset + kBuffers * 4 <= kCacheLine,
              "the signatures, waiters, CPU and ring words must share the arrival flag's line");
static_assert(kMaxTokens < (int64_t(1) << 32), "tokens must fit the signature's 32 bits");

inline constexpr int64_t round_up(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

// The slot geometry ShmLayout (layout.py) computes, for the contract test.
struct SlotGeometry {
  int64_t chunk_rows, input_bytes, result_bytes, slot_bytes, total_bytes;
};
inline SlotGeometry slot_geometry(int64_t world, int64_t max_tokens, int64_t hidden,
                                  int64_t elem) {
  SlotGeometry g{};
  g.chunk_rows = (max_tokens + world - 1) / world;
  g.input_bytes = round_up(max_tokens * hidden * elem, kCacheLine);
  g.result_bytes = round_up(g.chunk_rows * hidden * elem, kCacheLine);
  g.slot_bytes = g.input_bytes + g.result_bytes;
  g.total_bytes = round_up(kHeaderBytes + world * kBuffers * g.slot_bytes, kPage);
  return g;
}

}  // namespace layout
}  // namespace arfuse
