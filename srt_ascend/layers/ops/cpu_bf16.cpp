// A batch-invariant bf16 / float32 linear for CPU (`cpu_bf16.py`): y = x W^T (+ bias) where each
// output
// element is accumulated in float32 in one fixed order over K that depends on nothing but K, so a
// row's bits never depend on how many other rows share the call (--enable-deterministic-inference:
// a prefill's rows and a decode step's one row give a token the same bits).
//
//   pack(w bf16 [N, K]) -> wp bf16 [ceil(N/16), ceil(K/2), 16, 2]
//     column block b, pair p, lane l holds (w[16b + l, 2p], w[16b + l, 2p + 1]), zero padded
//   linear(x bf16 [M, K], wp, n, bias f32/bf16 [n] or None, path) -> bf16 [M, n]
//     acc = 0.f;  for p in 0 .. ceil(K/2)-1 (in order):
//       acc += float(x[m, 2p+1]) * float(w[n, 2p+1]);  acc += float(x[m, 2p]) * float(w[n, 2p])
//     y[m, n] = bf16_round_nearest_even(acc + float(bias[n]))
//
// The products of two bf16 values are exact in float32, so every step is one float32 rounding:
// AVX-512 BF16's VDPBF16PS does exactly these two steps per lane (odd element first, with
// denormals flushed), and the AVX-512F / AVX2 / scalar paths widen bf16 to float32 and do the
// same two fused multiply-adds, giving the same bits (outside float32's denormal range).
// float32 (x, w float32, y float32): acc = fma(x[m, k], w[n, k], acc) for k in order, the
// weight packed [ceil(N/16), K, 16, 1]; fused multiply-adds round once on every path. The
// vector lanes run over output columns, so there is no horizontal reduction; threads split the
// columns, never K.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 16;  // output columns per block
constexpr int kRows = 4;    // rows per micro-kernel
constexpr int kBlocks = 4;  // column blocks per micro-kernel

inline uint16_t bf16_bits(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float even_of(uint32_t pair) {  // element 2p of a packed pair as float32
  uint32_t u = pair << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float odd_of(uint32_t pair) {  // element 2p + 1
  uint32_t u = pair & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Everything a micro-kernel needs. bf16: x's rows as packed pairs, the weight [blocks, pairs, 16]
// pairs; float32: x's rows and the weight [blocks, K, 16] as float bits. `steps`: pairs or K.
struct Args {
  const uint32_t* x;   // [M, steps]
  const uint32_t* w;   // [blocks, steps, 16]
  const float* bias;   // [blocks * 16] (zero padded) or nullptr
  void* y;             // [M, n], bf16 or float32
  int64_t pairs, n;    // pairs: the steps over K
};

inline void store(const Args& a, const float* acc, int64_t row, int64_t block) {
  const int64_t col0 = block * kLanes;
  const int64_t count = a.n - col0 < kLanes ? a.n - col0 : kLanes;
  uint16_t* out = static_cast<uint16_t*>(a.y) + row * a.n + col0;
  for (int64_t l = 0; l < count; ++l)
    out[l] = bf16_bits(a.bias ? acc[l] + a.bias[col0 + l] : acc[l]);
}

inline void store_f32(const Args& a, const float* acc, int64_t row, int64_t block) {
  const int64_t col0 = block * kLanes;
  const int64_t count = a.n - col0 < kLanes ? a.n - col0 : kLanes;
  float* out = static_cast<float*>(a.y) + row * a.n + col0;
  for (int64_t l = 0; l < count; ++l) out[l] = a.bias ? acc[l] + a.bias[col0 + l] : acc[l];
}

inline float f32_at(const uint32_t* p, int64_t i) {
  float f;
  std::memcpy(&f, p + i, sizeof f);
  return f;
}

// float32: acc = fma(x[m, k], w[n, k], acc) for k in order (one rounding a step on every path).
template <int R, int C>
void tile_f32_scalar(const Args& a, int64_t row0, int64_t block0) {
  float acc[R][C][kLanes] = {};
  for (int64_t k = 0; k < a.pairs; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = f32_at(a.x, (row0 + r) * a.pairs + k);
      for (int c = 0; c < C; ++c) {
        const uint32_t* wp = a.w + ((block0 + c) * a.pairs + k) * kLanes;
        for (int l = 0; l < kLanes; ++l) acc[r][c][l] = std::fma(xv, f32_at(wp, l), acc[r][c][l]);
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store_f32(a, acc[r][c], row0 + r, block0 + c);
}

// Scalar path: the reference order, one lane at a time.
template <int R, int C>
void tile_scalar(const Args& a, int64_t row0, int64_t block0) {
  float acc[R][C][kLanes] = {};
  for (int64_t p = 0; p < a.pairs; ++p)
    for (int r = 0; r < R; ++r) {
      const uint32_t xp = a.x[(row0 + r) * a.pairs + p];
      const float xo = odd_of(xp), xe = even_of(xp);
      for (int c = 0; c < C; ++c) {
        const uint32_t* wp = a.w + ((block0 + c) * a.pairs + p) * kLanes;
        for (int l = 0; l < kLanes; ++l) {
          float v = std::fma(xo, odd_of(wp[l]), acc[r][c][l]);
          acc[r][c][l] = std::fma(xe, even_of(wp[l]), v);
        }
      }
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(a, acc[r][c], row0 + r, block0 + c);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define SRT_X86 1

// AVX2 + FMA: a block's 16 lanes as two 8-wide halves, bf16 widened to float32.
template <int R, int C>
__attribute__((target("avx2,fma"))) void tile_avx2(const Args& a, int64_t row0, int64_t block0) {
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < a.pairs; ++p) {
    __m256 xo[R], xe[R];
    for (int r = 0; r < R; ++r) {
      const __m256i xp = _mm256_set1_epi32(static_cast<int>(a.x[(row0 + r) * a.pairs + p]));
      xo[r] = _mm256_castsi256_ps(_mm256_and_si256(xp, hi));
      xe[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xp, 16));
    }
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) {
        const uint32_t* wp = a.w + ((block0 + c) * a.pairs + p) * kLanes + 8 * h;
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
        for (int r = 0; r < R; ++r)
          acc[r][c][h] = _mm256_fmadd_ps(xe[r], we, _mm256_fmadd_ps(xo[r], wo, acc[r][c][h]));
      }
  }
  alignas(64) float buf[kLanes];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(buf, acc[r][c][0]);
      _mm256_store_ps(buf + 8, acc[r][c][1]);
      store(a, buf, row0 + r, block0 + c);
    }
}

// AVX-512F: one 16-lane register per block, bf16 widened to float32.
template <int R, int C>
__attribute__((target("avx512f"))) void tile_avx512(const Args& a, int64_t row0, int64_t block0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < a.pairs; ++p) {
    __m512 xo[R], xe[R];
    for (int r = 0; r < R; ++r) {
      const __m512i xp = _mm512_set1_epi32(static_cast<int>(a.x[(row0 + r) * a.pairs + p]));
      xo[r] = _mm512_castsi512_ps(_mm512_and_si512(xp, hi));
      xe[r] = _mm512_castsi512_ps(_mm512_slli_epi32(xp, 16));
    }
    for (int c = 0; c < C; ++c) {
      const __m512i wv = _mm512_loadu_si512(a.w + ((block0 + c) * a.pairs + p) * kLanes);
      const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wv, hi));
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm512_fmadd_ps(xe[r], we, _mm512_fmadd_ps(xo[r], wo, acc[r][c]));
    }
  }
  alignas(64) float buf[kLanes];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(buf, acc[r][c]);
      store(a, buf, row0 + r, block0 + c);
    }
}

// AVX-512 BF16: VDPBF16PS, the two products of a pair in one instruction.
template <int R, int C>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16(const Args& a, int64_t row0,
                                                             int64_t block0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.pairs; ++p) {
    __m512bh xv[R];
    for (int r = 0; r < R; ++r)
      xv[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(a.x[(row0 + r) * a.pairs + p]));
    for (int c = 0; c < C; ++c) {
      const __m512bh wv =
          (__m512bh)_mm512_loadu_si512(a.w + ((block0 + c) * a.pairs + p) * kLanes);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);
    }
  }
  alignas(64) float buf[kLanes];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(buf, acc[r][c]);
      store(a, buf, row0 + r, block0 + c);
    }
}

template <int R, int C>
__attribute__((target("avx2,fma"))) void tile_f32_avx2(const Args& a, int64_t row0,
                                                       int64_t block0) {
  __m256 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const float* x = reinterpret_cast<const float*>(a.x);
  const float* w = reinterpret_cast<const float*>(a.w);
  for (int64_t k = 0; k < a.pairs; ++k) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_set1_ps(x[(row0 + r) * a.pairs + k]);
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) {
        const __m256 wv = _mm256_loadu_ps(w + ((block0 + c) * a.pairs + k) * kLanes + 8 * h);
        for (int r = 0; r < R; ++r) acc[r][c][h] = _mm256_fmadd_ps(xv[r], wv, acc[r][c][h]);
      }
  }
  alignas(64) float buf[kLanes];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      _mm256_store_ps(buf, acc[r][c][0]);
      _mm256_store_ps(buf + 8, acc[r][c][1]);
      store_f32(a, buf, row0 + r, block0 + c);
    }
}

template <int R, int C>
__attribute__((target("avx512f"))) void tile_f32_avx512(const Args& a, int64_t row0,
                                                        int64_t block0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* x = reinterpret_cast<const float*>(a.x);
  const float* w = reinterpret_cast<const float*>(a.w);
  for (int64_t k = 0; k < a.pairs; ++k) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_set1_ps(x[(row0 + r) * a.pairs + k]);
    for (int c = 0; c < C; ++c) {
      const __m512 wv = _mm512_loadu_ps(w + ((block0 + c) * a.pairs + k) * kLanes);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  alignas(64) float buf[kLanes];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(buf, acc[r][c]);
      store_f32(a, buf, row0 + r, block0 + c);
    }
}
#endif

enum Path : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3, kAvx512Bf16 = 4 };

int64_t best_path() {
#ifdef SRT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (__builtin_cpu_supports("avx512f")) return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

using Tile = void (*)(const Args&, int64_t, int64_t);

template <int R, int C>
Tile tile_for(int64_t path) {
#ifdef SRT_X86
  if (path == -kAvx512Bf16 || path == -kAvx512) return &tile_f32_avx512<R, C>;
  if (path == -kAvx2) return &tile_f32_avx2<R, C>;
#endif
  if (path < 0) return &tile_f32_scalar<R, C>;
#ifdef SRT_X86
  if (path == kAvx512Bf16) return &tile_bf16<R, C>;
  if (path == kAvx512) return &tile_avx512<R, C>;
  if (path == kAvx2) return &tile_avx2<R, C>;
#endif
  return &tile_scalar<R, C>;
}

template <int R>
Tile tile_rows(int64_t path, int c) {
  if constexpr (R < kRows) {  // few rows: up to 2 * kBlocks column blocks (more chains in flight)
    switch (c) {
      case 5: return tile_for<R, 5>(path);
      case 6: return tile_for<R, 6>(path);
      case 7: return tile_for<R, 7>(path);
      case 8: return tile_for<R, 8>(path);
      default: break;
    }
  }
  switch (c) {
    case 1: return tile_for<R, 1>(path);
    case 2: return tile_for<R, 2>(path);
    case 3: return tile_for<R, 3>(path);
    default: return tile_for<R, 4>(path);
  }
}

Tile pick(int64_t path, int r, int c) {
  switch (r) {
    case 1: return tile_rows<1>(path, c);
    case 2: return tile_rows<2>(path, c);
    case 3: return tile_rows<3>(path, c);
    default: return tile_rows<4>(path, c);
  }
}

// Threads take groups of kGroup column blocks; each runs every row over its group (the group's
// weights stay in cache across the rows): kRows rows kBlocks blocks at a time, the last rows
// (fewer than kRows) over the whole group at once. The tiling changes no output's order.
constexpr int kGroup = 2 * kBlocks;

void run(const Args& a, int64_t m, int64_t blocks, int64_t path) {
  const int64_t groups = (blocks + kGroup - 1) / kGroup;
  const int64_t work = m * a.pairs * kLanes * kGroup;  // multiply-adds per group
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, work));
  at::parallel_for(0, groups, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t b0 = g * kGroup, width = std::min<int64_t>(kGroup, blocks - b0);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int r = static_cast<int>(std::min<int64_t>(kRows, m - r0));
        if (r < kRows) {
          pick(path, r, static_cast<int>(width))(a, r0, b0);
          continue;
        }
        for (int64_t b = b0; b < b0 + width; b += kBlocks)
          pick(path, r, static_cast<int>(std::min<int64_t>(kBlocks, b0 + width - b)))(a, r0, b);
      }
    }
  });
}

// bf16: [blocks, ceil(K/2), 16, 2]; float32: [blocks, K, 16, 1] (zero padded)
at::Tensor pack(const at::Tensor& w) {
  const bool f32 = w.scalar_type() == at::kFloat;
  TORCH_CHECK(w.dim() == 2 && (f32 || w.scalar_type() == at::kBFloat16),
              "pack: w must be bf16 or float32 [N, K]");
  const int64_t n = w.size(0), k = w.size(1), e = f32 ? 1 : 2;
  const int64_t blocks = (n + kLanes - 1) / kLanes, steps = (k + e - 1) / e;
  at::Tensor padded = at::zeros({blocks * kLanes, steps * e}, w.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  return padded.view({blocks, kLanes, steps, e}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t n,
                  const c10::optional<at::Tensor>& bias, int64_t path) {
  const bool f32 = x.scalar_type() == at::kFloat;
  const int64_t e = f32 ? 1 : 2;
  TORCH_CHECK(x.dim() == 2 && (f32 || x.scalar_type() == at::kBFloat16),
              "linear: x must be bf16 or float32 [M, K]");
  TORCH_CHECK(wp.dim() == 4 && wp.scalar_type() == x.scalar_type() && wp.size(2) == kLanes &&
                  wp.size(3) == e && wp.is_contiguous(),
              "linear: wp must come from pack() of x's dtype");
  const int64_t m = x.size(0), k = x.size(1), blocks = wp.size(0), steps = wp.size(1);
  TORCH_CHECK(steps == (k + e - 1) / e && n > 0 && n <= blocks * kLanes &&
                  n > (blocks - 1) * kLanes,
              "linear: x's K or n does not match the packed weight");
  at::Tensor xs = x.contiguous();
  if (k % e) xs = at::constant_pad_nd(xs, {0, 1});  // the last pair's odd element is zero
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear: bias must be [n]");
    bf = at::zeros({blocks * kLanes}, x.options().dtype(at::kFloat));
    bf.narrow(0, 0, n).copy_(*bias);
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  Args a{static_cast<const uint32_t*>(xs.const_data_ptr()),
         static_cast<const uint32_t*>(wp.const_data_ptr()),
         bf.defined() ? bf.const_data_ptr<float>() : nullptr, y.data_ptr(), steps, n};
  static const int64_t best = best_path();
  TORCH_CHECK(path >= kAuto && path <= kAvx512Bf16, "linear: unknown path ", path);
  TORCH_CHECK(path <= best || path == kAuto, "linear: path ", path, " needs CPU flags not here");
  const int64_t chosen = path == kAuto ? best : path;
  run(a, m, blocks, f32 ? -chosen : chosen);
  return y;
}

int64_t path_in_use() { return best_path(); }

}  // namespace

TORCH_LIBRARY(srt_cpu_bf16, lib) {
  lib.def("pack(Tensor w) -> Tensor");
  lib.def("linear(Tensor x, Tensor wp, int n, Tensor? bias, int path=0) -> Tensor");
  lib.def("best_path() -> int", &path_in_use);
}

TORCH_LIBRARY_IMPL(srt_cpu_bf16, CPU, lib) {
  lib.impl("pack", &pack);
  lib.impl("linear", &linear);
}
