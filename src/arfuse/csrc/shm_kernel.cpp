// arfuse shm backend: fused all-reduce + residual + RMSNorm (+ FP8 / NVFP4) over one shared
// memory segment per group. Built at first use by torch.utils.cpp_extension (see shm_build.py).
//
// Protocol (per call, sequence number s, buffer b = s & 1):
//   one-shot: copy x into my input slot[b]; arrive[me] = s; wait arrive[*] >= s; every rank
//             reduces every row (fp32, rank order) and runs the epilogue locally.
//   two-shot: as above, but each rank reduces and finishes only its own block of rows, writes
//             the results into its result slot[b]; done[me] = s; wait done[*] >= s; every rank
//             copies the other blocks.
// Double-buffered slots make a trailing barrier unnecessary: a rank can only reuse buffer b at
// call s + 2 after every rank arrived at s + 1, i.e. after every rank finished call s.
//
// Numerics (identical on every rank, and between one-shot and two-shot):
//   acc = sum_r f32(x_r) in rank order; sum = T(acc); residual_out = T(f32(sum) + f32(res));
//   r = f32(residual_out); ss = sum of r*r in 8 interleaved lanes combined in a fixed order;
//   inv = 1 / sqrt(ss / H + eps); out = T((r * inv) * (weight_bias + f32(w)));
//   fp8:   q = e4m3_satfinite_rne(f32(out) * (1 / scale))
//   nvfp4: per 16: sf = e4m3(gs * (amax * f32(1/6))); q = e2m1_rne_sat(f32(out) * gs / sf)

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sched.h>
#include <signal.h>
#include <sstream>
#include <string>
#include <time.h>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ARFUSE_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define ARFUSE_PAUSE() asm volatile("yield")
#else
#define ARFUSE_PAUSE() do {} while (0)
#endif

namespace {

constexpr int kMaxWorld = 16;
constexpr int kLine = 64;
constexpr int kLanes = 8;
enum DType { kBF16 = 0, kFP16 = 1, kFP32 = 2 };
enum Quant { kNone = 0, kFP8 = 1, kNVFP4 = 2 };

inline uint32_t bits_of(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float float_of(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// ---- element conversions (round to nearest even, as torch does) ----------------------------

inline float bf16_to_f32(uint16_t v) { return float_of(uint32_t(v) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float fp16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return float_of(sign);
    float v = std::ldexp(float(mant), -24);  // subnormal: exact in fp32
    return sign ? -v : v;
  }
  if (exp == 31) return float_of(sign | 0x7f800000u | (mant << 13));
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_fp16(float f) {
  uint32_t u = bits_of(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);           // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);          // rounds to inf
  if (a < 0x38800000u) {                                          // fp16 subnormal or zero
    float v = float_of(a) * 16777216.0f;                          // * 2^24, exact
    return uint16_t(sign | uint16_t(std::nearbyint(v)));          // RNE in default mode
  }
  uint32_t mant_round = a + 0xfffu + ((a >> 13) & 1u);
  return uint16_t(sign | uint16_t((mant_round - 0x38000000u) >> 13));
}

template <int D> struct Elem;
template <> struct Elem<kBF16> {
  using T = uint16_t;
  static float load(T v) { return bf16_to_f32(v); }
  static T store(float f) { return f32_to_bf16(f); }
};
template <> struct Elem<kFP16> {
  using T = uint16_t;
  static float load(T v) { return fp16_to_f32(v); }
  static T store(float f) { return f32_to_fp16(f); }
};
template <> struct Elem<kFP32> {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
};

// ---- quantisation ---------------------------------------------------------------------------

float g_e4m3_decode[256];

void init_tables() {
  for (int c = 0; c < 256; ++c) {
    int sign = c & 0x80, exp = (c >> 3) & 0xf, mant = c & 7;
    float v;
    if (exp == 0xf && mant == 7) v = NAN;
    else if (exp == 0) v = std::ldexp(float(mant), -9);
    else v = std::ldexp(1.0f + float(mant) / 8.0f, exp - 7);
    g_e4m3_decode[c] = sign ? -v : v;
  }
}

inline uint8_t f32_to_e4m3(float f) {  // round to nearest even, saturate to +-448
  uint32_t u = bits_of(f);
  uint8_t sign = uint8_t((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint8_t(sign | 0x7f);
  float af = float_of(a);
  if (af >= 448.0f) return uint8_t(sign | 0x7e);
  if (af < 0.015625f) {  // below the smallest normal 2^-6: steps of 2^-9
    return uint8_t(sign | uint8_t(std::nearbyint(af * 512.0f)));
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
  if (code > 0x7e) code = 0x7e;
  return uint8_t(sign | code);
}

inline uint8_t f32_to_e2m1(float v) {  // nearest even on {0,.5,1,1.5,2,3,4,6}, saturating
  float m = std::fabs(v);
  uint8_t code = uint8_t((m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) +
                         (m >= 3.5f) + (m > 5.0f));
  return uint8_t(code | (std::signbit(v) ? 8 : 0));
}

inline int64_t swizzled_offset(int64_t m, int64_t k, int64_t cols) {
  int64_t k_tiles = (cols + 3) / 4;
  return (m / 128) * k_tiles * 512 + (k / 4) * 512 + (m % 32) * 16 + ((m % 128) / 32) * 4 +
         (k % 4);
}

double mono_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// /proc/<pid>/stat: state (field 3) and start time (field 22). -1 when the process is gone.
long long proc_start_time(long long pid, char* state) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return -1;
  char buf[1024];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  char* p = std::strrchr(buf, ')');
  if (!p) return -1;
  p += 2;
  *state = *p;
  long long value = -1;
  for (int field = 3; field <= 22 && p; ++field) {
    if (field == 22) { value = std::atoll(p); break; }
    p = std::strchr(p, ' ');
    if (p) ++p;
  }
  return value;
}

struct Call {  // one call's arguments, resolved to raw pointers
  int64_t tokens;
  const void* residual;
  const void* weight;
  float eps, weight_bias;
  int quant;
  float scale;
  bool swizzled;
  void* out;
  void* residual_out;
  uint8_t* quant_out;
  uint8_t* scale_out;
};

class ShmComm {
 public:
  ShmComm(int64_t base, int64_t world, int64_t rank, int64_t max_tokens, int64_t hidden,
          int64_t dtype, int64_t header_bytes, int64_t slot_bytes, int64_t input_bytes,
          int64_t chunk_rows, double timeout_s, int64_t oneshot_max_bytes)
      : base_(reinterpret_cast<char*>(base)), world_(int(world)), rank_(int(rank)),
        max_tokens_(max_tokens), hidden_(hidden), dtype_(int(dtype)),
        header_bytes_(header_bytes), slot_bytes_(slot_bytes), input_bytes_(input_bytes),
        chunk_rows_(chunk_rows), timeout_s_(timeout_s), oneshot_max_bytes_(oneshot_max_bytes) {
    TORCH_CHECK(world_ >= 1 && world_ <= kMaxWorld, "arfuse shm: world size must be 1..16");
    TORCH_CHECK(rank_ >= 0 && rank_ < world_, "arfuse shm: bad rank");
    elem_ = dtype_ == kFP32 ? 4 : 2;
    scratch_.resize(size_t(hidden_));
    pids_.assign(size_t(world_), 0);
    starts_.assign(size_t(world_), 0);
  }

  void set_peers(std::vector<int64_t> pids, std::vector<int64_t> starts, bool check) {
    TORCH_CHECK(int(pids.size()) == world_ && int(starts.size()) == world_, "bad peer list");
    pids_ = std::move(pids);
    starts_ = std::move(starts);
    check_pids_ = check;
  }

  void set_base(int64_t base) { base_ = reinterpret_cast<char*>(base); }
  void set_timeout(double timeout_s) { timeout_s_ = timeout_s; }
  void set_oneshot_max_bytes(int64_t value) { oneshot_max_bytes_ = value; }
  int64_t oneshot_max_bytes() const { return oneshot_max_bytes_; }
  int64_t seq() const { return seq_; }
  std::string broken() const { return broken_; }

  bool oneshot(int64_t tokens) const {
    return tokens < world_ || tokens * hidden_ * elem_ <= oneshot_max_bytes_;
  }

  std::vector<at::Tensor> run(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                              const c10::optional<at::Tensor>& weight, double eps,
                              double weight_bias, int64_t quant, double scale,
                              bool swizzled) {
    TORCH_CHECK(broken_.empty(), "arfuse shm: this workspace is unusable after an earlier "
                "failure (", broken_, "); create a new FusedAllReduce");
    const int64_t tokens = x.size(0);
    TORCH_CHECK(tokens <= max_tokens_, "arfuse shm: tokens over capacity");
    const bool norm = weight.has_value();
    Call c{};
    c.tokens = tokens;
    c.residual = residual.has_value() ? residual->data_ptr() : nullptr;
    c.weight = norm ? weight->data_ptr() : nullptr;
    c.eps = float(eps);
    c.weight_bias = float(weight_bias);
    c.quant = int(quant);
    c.scale = float(scale);
    c.swizzled = swizzled;
    at::Tensor out = at::empty_like(x);
    at::Tensor residual_out, quant_out, scale_out;
    c.out = out.data_ptr();
    if (norm) {
      residual_out = at::empty_like(x);
      c.residual_out = residual_out.data_ptr();
    }
    if (quant == kFP8) {
      quant_out = at::empty({tokens, hidden_}, x.options().dtype(at::kFloat8_e4m3fn));
      c.quant_out = reinterpret_cast<uint8_t*>(quant_out.data_ptr());
    } else if (quant == kNVFP4) {
      const int64_t cols = hidden_ / 16;
      quant_out = at::empty({tokens, hidden_ / 2}, x.options().dtype(at::kByte));
      if (swizzled) {
        scale_out = at::zeros({(tokens + 127) / 128 * 128, (cols + 3) / 4 * 4},
                              x.options().dtype(at::kByte));
      } else {
        scale_out = at::empty({tokens, cols}, x.options().dtype(at::kByte));
      }
      c.quant_out = quant_out.data_ptr<uint8_t>();
      c.scale_out = scale_out.data_ptr<uint8_t>();
    }
    if (tokens > 0) {
      switch (dtype_) {
        case kBF16: exchange<kBF16>(x.data_ptr(), c); break;
        case kFP16: exchange<kFP16>(x.data_ptr(), c); break;
        default: exchange<kFP32>(x.data_ptr(), c); break;
      }
    }
    return {out, residual_out, quant_out, scale_out};
  }

 private:
  std::atomic<int64_t>* flag(int which, int r) const {  // which: 0 arrive, 1 done
    int64_t offset = int64_t(kLine) * (1 + kMaxWorld * (1 + which) + r);
    return reinterpret_cast<std::atomic<int64_t>*>(base_ + offset);
  }
  char* input_slot(int r, int64_t buf) const {
    return base_ + header_bytes_ + (int64_t(r) * 2 + buf) * slot_bytes_;
  }
  char* result_slot(int r, int64_t buf) const { return input_slot(r, buf) + input_bytes_; }

  [[noreturn]] void fail(const std::string& why) {
    broken_ = why;
    TORCH_CHECK(false, why);
  }

  void wait_all(int which, int64_t target) {
    uint64_t spins = 0;
    double deadline = 0.0;
    for (int j = 0; j < world_; ++j) {
      if (j == rank_) continue;
      std::atomic<int64_t>* f = flag(which, j);
      while (f->load(std::memory_order_acquire) < target) {
        if (++spins < 2048) { ARFUSE_PAUSE(); continue; }
        sched_yield();
        if ((spins & 31) != 0) continue;
        double now = mono_now();
        if (deadline == 0.0) deadline = now + timeout_s_;
        if (now > deadline) fail(silent_message(which, target, "timed out after " +
                                                std::to_string(timeout_s_) + "s"));
        if (check_pids_ && (spins & 1023) == 0) check_alive(which, target);
      }
    }
  }

  std::string silent_ranks(int which, int64_t target) const {
    std::ostringstream ss;
    bool first = true;
    for (int j = 0; j < world_; ++j) {
      if (j == rank_ || flag(which, j)->load(std::memory_order_acquire) >= target) continue;
      ss << (first ? "" : ", ") << j;
      first = false;
    }
    return ss.str();
  }

  std::string silent_message(int which, int64_t target, const std::string& what) const {
    std::ostringstream ss;
    ss << "arfuse shm: " << what << " in phase 'call' (" << (which == 0 ? "arrive" : "gather")
       << ", backend shm, call " << target << "): rank(s) " << silent_ranks(which, target)
       << " of the group did not answer (dead, hung, or calling with other arguments)";
    return ss.str();
  }

  void check_alive(int which, int64_t target) {
    for (int j = 0; j < world_; ++j) {
      if (j == rank_ || flag(which, j)->load(std::memory_order_acquire) >= target) continue;
      char state = '?';
      long long start = proc_start_time(pids_[size_t(j)], &state);
      if (start < 0 || start != starts_[size_t(j)] || state == 'Z' || state == 'X') {
        std::ostringstream ss;
        ss << "arfuse shm: rank " << j << " (pid " << pids_[size_t(j)]
           << ") died during a call (phase 'call', backend shm, call " << target
           << "); silent rank(s): " << silent_ranks(which, target);
        fail(ss.str());
      }
    }
  }

  template <int D>
  void exchange(const void* x, const Call& c) {
    using E = Elem<D>;
    using T = typename E::T;
    const int64_t seq = ++seq_;
    const int64_t buf = seq & 1;
    const int64_t row_bytes = hidden_ * elem_;
    std::memcpy(input_slot(rank_, buf), x, size_t(c.tokens * row_bytes));
    flag(0, rank_)->store(seq, std::memory_order_release);
    wait_all(0, seq);
    const T* inputs[kMaxWorld];
    for (int j = 0; j < world_; ++j) {
      inputs[j] = reinterpret_cast<const T*>(input_slot(j, buf));
    }
    if (oneshot(c.tokens)) {
      for (int64_t row = 0; row < c.tokens; ++row) {
        finish_row<D>(inputs, row, c, static_cast<T*>(c.out) + row * hidden_,
                      c.residual_out ? static_cast<T*>(c.residual_out) + row * hidden_ : nullptr,
                      row, c.quant_out, c.scale_out, c.swizzled);
      }
      return;
    }
    // two-shot: my block of rows into my result slot, then gather every block
    const int64_t chunk = (c.tokens + world_ - 1) / world_;
    const int64_t begin = std::min<int64_t>(c.tokens, chunk * rank_);
    const int64_t end = std::min<int64_t>(c.tokens, begin + chunk);
    char* mine = result_slot(rank_, buf);
    for (int64_t row = begin; row < end; ++row) {
      int64_t local = row - begin;
      T* out_row = reinterpret_cast<T*>(mine) + local * hidden_;
      T* res_row = c.residual_out ? reinterpret_cast<T*>(mine + chunk_rows_ * row_bytes) +
                                        local * hidden_
                                  : nullptr;
      uint8_t* qbase = reinterpret_cast<uint8_t*>(mine + 2 * chunk_rows_ * row_bytes);
      finish_row<D>(inputs, row, c, out_row, res_row, local, qbase,
                    qbase + chunk_rows_ * (hidden_ / 2), false);
    }
    flag(1, rank_)->store(seq, std::memory_order_release);
    wait_all(1, seq);
    for (int j = 0; j < world_; ++j) {
      const int64_t b = std::min<int64_t>(c.tokens, chunk * j);
      const int64_t e = std::min<int64_t>(c.tokens, b + chunk);
      if (e <= b) continue;
      const char* src = result_slot(j, buf);
      const int64_t rows = e - b;
      std::memcpy(static_cast<char*>(c.out) + b * row_bytes, src, size_t(rows * row_bytes));
      if (c.residual_out) {
        std::memcpy(static_cast<char*>(c.residual_out) + b * row_bytes,
                    src + chunk_rows_ * row_bytes, size_t(rows * row_bytes));
      }
      const uint8_t* qsrc = reinterpret_cast<const uint8_t*>(src + 2 * chunk_rows_ * row_bytes);
      if (c.quant == kFP8) {
        std::memcpy(c.quant_out + b * hidden_, qsrc, size_t(rows * hidden_));
      } else if (c.quant == kNVFP4) {
        std::memcpy(c.quant_out + b * (hidden_ / 2), qsrc, size_t(rows * (hidden_ / 2)));
        const uint8_t* ssrc = qsrc + chunk_rows_ * (hidden_ / 2);
        const int64_t cols = hidden_ / 16;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t k = 0; k < cols; ++k) {
            int64_t m = b + r;
            int64_t at = c.swizzled ? swizzled_offset(m, k, cols) : m * cols + k;
            c.scale_out[at] = ssrc[r * cols + k];
          }
        }
      }
    }
  }

  // Reduce one row over the ranks and run the whole epilogue on it.
  // quant rows are written at row index `qrow` of (q, s); s is linear unless `swizzled`.
  template <int D>
  void finish_row(const typename Elem<D>::T* const* inputs, int64_t row, const Call& c,
                  typename Elem<D>::T* out, typename Elem<D>::T* residual_out, int64_t qrow,
                  uint8_t* q, uint8_t* s, bool swizzled) {
    using E = Elem<D>;
    using T = typename E::T;
    const int64_t H = hidden_;
    float* acc = scratch_.data();
    const T* first = inputs[0] + row * H;
    for (int64_t h = 0; h < H; ++h) acc[h] = E::load(first[h]);
    for (int j = 1; j < world_; ++j) {
      const T* in = inputs[j] + row * H;
      for (int64_t h = 0; h < H; ++h) acc[h] += E::load(in[h]);
    }
    if (!c.weight) {
      for (int64_t h = 0; h < H; ++h) out[h] = E::store(acc[h]);
      quantize_row<D>(out, c, qrow, q, s, swizzled);
      return;
    }
    const T* res = c.residual ? static_cast<const T*>(c.residual) + row * H : nullptr;
    float lanes[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t h = 0;
    for (; h + kLanes <= H; h += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        float pre = E::load(E::store(acc[h + l]));
        if (res) pre += E::load(res[h + l]);
        T rounded = E::store(pre);
        residual_out[h + l] = rounded;
        float r = E::load(rounded);
        acc[h + l] = r;
        float sq = r * r;
        lanes[l] += sq;
      }
    }
    for (int l = 0; h < H; ++h, ++l) {
      float pre = E::load(E::store(acc[h]));
      if (res) pre += E::load(res[h]);
      T rounded = E::store(pre);
      residual_out[h] = rounded;
      float r = E::load(rounded);
      acc[h] = r;
      float sq = r * r;
      lanes[l] += sq;
    }
    float ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
               ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    const float inv = 1.0f / std::sqrt(ss / float(H) + c.eps);
    const T* w = static_cast<const T*>(c.weight);
    for (int64_t k = 0; k < H; ++k) {
      float scaled = acc[k] * inv;
      out[k] = E::store(scaled * (c.weight_bias + E::load(w[k])));
    }
    quantize_row<D>(out, c, qrow, q, s, swizzled);
  }

  template <int D>
  void quantize_row(const typename Elem<D>::T* out, const Call& c, int64_t qrow, uint8_t* q,
                    uint8_t* s, bool swizzled) {
    using E = Elem<D>;
    const int64_t H = hidden_;
    if (c.quant == kFP8) {
      const float inv_scale = 1.0f / c.scale;
      uint8_t* dst = q + qrow * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = f32_to_e4m3(E::load(out[h]) * inv_scale);
    } else if (c.quant == kNVFP4) {
      const float gs = c.scale;
      const float sixth = 1.0f / 6.0f;
      const int64_t cols = H / 16;
      uint8_t* dst = q + qrow * (H / 2);
      for (int64_t k = 0; k < cols; ++k) {
        float vals[16];
        float amax = 0.0f;
        for (int i = 0; i < 16; ++i) {
          vals[i] = E::load(out[k * 16 + i]);
          amax = std::fmax(amax, std::fabs(vals[i]));
        }
        uint8_t sf = f32_to_e4m3(gs * (amax * sixth));
        float sfq = g_e4m3_decode[sf];
        float es = sfq != 0.0f ? gs / sfq : 0.0f;
        for (int i = 0; i < 16; i += 2) {
          uint8_t lo = f32_to_e2m1(vals[i] * es);
          uint8_t hi = f32_to_e2m1(vals[i + 1] * es);
          dst[k * 8 + i / 2] = uint8_t(lo | (hi << 4));
        }
        int64_t at = swizzled ? swizzled_offset(qrow, k, cols) : qrow * cols + k;
        s[at] = sf;
      }
    }
  }

  char* base_;
  int world_, rank_;
  int64_t max_tokens_, hidden_;
  int dtype_, elem_ = 2;
  int64_t header_bytes_, slot_bytes_, input_bytes_, chunk_rows_;
  double timeout_s_;
  int64_t oneshot_max_bytes_;
  int64_t seq_ = 0;
  bool check_pids_ = false;
  std::vector<int64_t> pids_, starts_;
  std::vector<float> scratch_;
  std::string broken_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  init_tables();
  m.doc() = "arfuse shared-memory fused all-reduce kernel";
  py::class_<ShmComm>(m, "ShmComm")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, double, int64_t>())
      .def("set_peers", &ShmComm::set_peers)
      .def("set_base", &ShmComm::set_base)
      .def("set_timeout", &ShmComm::set_timeout)
      .def("set_oneshot_max_bytes", &ShmComm::set_oneshot_max_bytes)
      .def("oneshot_max_bytes", &ShmComm::oneshot_max_bytes)
      .def("oneshot", &ShmComm::oneshot)
      .def("seq", &ShmComm::seq)
      .def("broken", &ShmComm::broken)
      .def("run", &ShmComm::run);
}
