// ModelSlim's int8 linears on CPU as one op each: quantise the activations, the int8 GEMM
// (at::_int_mm: oneDNN's s8s8 -> s32 kernels, VNNI / AMX where the CPU has them), the float
// epilogue, with no Python between them. Each computes exactly the arithmetic of
// `quant_matmul.py`'s references (the same float32 operations in the same order, the same
// round-half-to-even, the same float32 -> bf16 / fp16 rounding), so its outputs are the
// references' bits; only the loops are fused.
//
//   w8a8_dynamic(x [M, K], wq int8 [N, K], weight_scale f32 [N], tiny) -> [M, N] in x's dtype
//     s[m] = max(max_k |x[m, k]|, tiny) / 127;  xq = round(x / s[m])
//     y[m, n] = float(xq[m] . wq[n]) * (s[m] * weight_scale[n])
//   w8a8_static(x, wq, input_scale, input_offset, quant_bias i32 [N], deq_scale f32 [N])
//     xq = clamp(round(x / input_scale + input_offset), -128, 127)
//     y[m, n] = float(xq[m] . wq[n] + quant_bias[n]) * deq_scale[n]
//   quantize_per_token(x) -> (xq int8 [M, K], s f32 [M, 1]): the dynamic scheme's first half
//
// Built on first use by `cpu_int8.py` (torch.utils.cpp_extension); the hot loops are cloned
// for AVX-512 / AVX2 / baseline x86-64 and picked at load by the CPU's flags.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <tuple>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__)  // ifunc dispatch
#define SRT_CLONES \
  __attribute__((target_clones("arch=sapphirerapids", "arch=skylake-avx512", "avx2", "default")))
#else
#define SRT_CLONES
#endif

namespace {

constexpr int64_t kGrain = 16384;  // elements per thread below which a loop stays serial

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// float32 -> the output type, rounding to nearest even (c10's conversion, written branch-free
// so the epilogue loops vectorise)
template <typename T>
inline T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  uint16_t bits = f != f ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

template <>
inline c10::Half from_float<c10::Half>(float f) {
  return c10::Half(f);
}

// The bits of |v| as an unsigned integer: for floats of one sign the integer order is the value
// order (NaN's bits above inf's), so an integer max reduction, which vectorises, finds max |x|.
inline uint32_t abs_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u & 0x7FFFFFFFu;
}
inline uint32_t abs_bits(c10::BFloat16 v) { return v.x & 0x7FFFu; }
inline uint32_t abs_bits(c10::Half v) { return v.x & 0x7FFFu; }

template <typename T>
inline float from_abs_bits(uint32_t bits) {
  if constexpr (std::is_same_v<T, float>) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<float>(T(static_cast<uint16_t>(bits), T::from_bits()));
  }
}

// round half to even for |v| <= 2^22 (the float32 sum rounds off the fraction in the default
// rounding mode): std::nearbyint's value, without a libm call per element
inline float round_even(float v) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}

template <typename T>
SRT_CLONES void quantize_rows(const T* x, int8_t* q, float* s, int64_t rows, int64_t k,
                              float tiny) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * k;
    uint32_t amax_bits = 0;
    for (int64_t i = 0; i < k; ++i) amax_bits = std::max(amax_bits, abs_bits(xr[i]));
    float amax = from_abs_bits<T>(amax_bits);
    // the reference's clamp(min=tiny) then / 127 (NaN stays NaN)
    float sm = (amax < tiny ? tiny : amax) / 127.f;
    s[m] = sm;
    int8_t* qr = q + m * k;
    // |x / s| <= 127 by construction (the reference's cast never saturates)
    for (int64_t i = 0; i < k; ++i)
      qr[i] = static_cast<int8_t>(static_cast<int32_t>(round_even(to_float(xr[i]) / sm)));
  }
}

template <typename T>
SRT_CLONES void quantize_static_rows(const T* x, int8_t* q, int64_t count, float scale,
                                     float offset) {
  // clamp(round(v), -128, 127) == round(clamp(v, -128, 127)): rounding is monotonic and the
  // bounds are integers; clamping first keeps round_even in its range
  for (int64_t i = 0; i < count; ++i) {
    float v = to_float(x[i]) / scale + offset;
    v = v < -128.f ? -128.f : (v > 127.f ? 127.f : v);
    q[i] = static_cast<int8_t>(static_cast<int32_t>(round_even(v)));
  }
}

template <typename T>
SRT_CLONES void dynamic_epilogue(const int32_t* acc, const float* s, const float* ws, T* y,
                                 int64_t rows, int64_t n) {
  for (int64_t m = 0; m < rows; ++m) {
    const float sm = s[m];
    for (int64_t j = 0; j < n; ++j)
      y[m * n + j] = from_float<T>(static_cast<float>(acc[m * n + j]) * (sm * ws[j]));
  }
}

template <typename T>
SRT_CLONES void static_epilogue(const int32_t* acc, const int32_t* bias, const float* deq, T* y,
                                int64_t rows, int64_t n) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < n; ++j) {
      // the int32 sum wraps as the reference's int32 add does
      uint32_t sum = static_cast<uint32_t>(acc[m * n + j]) + static_cast<uint32_t>(bias[j]);
      y[m * n + j] = from_float<T>(static_cast<float>(static_cast<int32_t>(sum)) * deq[j]);
    }
}

void check_linear(const at::Tensor& x, const at::Tensor& wq) {
  TORCH_CHECK(x.device().is_cpu() && wq.device().is_cpu(), "cpu_int8: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && wq.dim() == 2 && x.size(1) == wq.size(1),
              "cpu_int8: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(wq.scalar_type() == at::kChar, "cpu_int8: int8 weight expected");
}

// f(T{}) for the activations' dtype T
template <typename F>
void dispatch_float(at::ScalarType dtype, const F& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    case at::kHalf:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, "cpu_int8: float32, bfloat16 or float16 activations expected");
  }
}

// parallel over rows in chunks of at least kGrain elements
template <typename F>
void over_rows(int64_t rows, int64_t width, const F& body) {
  int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t lo, int64_t hi) { body(lo, hi); });
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor& x_in, double tiny) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.dim() == 2, "cpu_int8: x [M, K] on CPU expected");
  at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({m, 1}, x.options().dtype(at::kFloat));
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = s.data_ptr<float>();
    over_rows(m, k, [&](int64_t lo, int64_t hi) {
      quantize_rows(xp + lo * k, qp + lo * k, sp + lo, hi - lo, k, static_cast<float>(tiny));
    });
  });
  return {q, s};
}

// xq [rows, k] . wq[j]: int8 products summed in int32 (exact, so the same integers as
// at::_int_mm's in any order). The compiler vectorises the inner product (sign-extended
// multiply-adds); for a few rows this is cheaper than oneDNN's primitive setup per call.
SRT_CLONES void int8_gemv(const int8_t* xq, const int8_t* w, int32_t* acc, int64_t rows,
                          int64_t n, int64_t k, int64_t lo, int64_t hi) {
  for (int64_t j = lo; j < hi; ++j) {
    const int8_t* wr = w + j * k;
    for (int64_t m = 0; m < rows; ++m) {
      const int8_t* xr = xq + m * k;
      int32_t sum = 0;
      for (int64_t i = 0; i < k; ++i) sum += static_cast<int32_t>(xr[i]) * wr[i];
      acc[m * n + j] = sum;
    }
  }
}

constexpr int64_t kGemvRows = 4;  // at most this many rows: the loop above, else oneDNN

at::Tensor int_mm(const at::Tensor& xq, const at::Tensor& wq) {
  const int64_t rows = xq.size(0), n = wq.size(0), k = wq.size(1);
  if (rows > kGemvRows || !wq.is_contiguous()) return at::_int_mm(xq, wq.t());
  at::Tensor acc = at::empty({rows, n}, xq.options().dtype(at::kInt));
  const int8_t* xp = xq.const_data_ptr<int8_t>();
  const int8_t* wp = wq.const_data_ptr<int8_t>();
  int32_t* ap = acc.data_ptr<int32_t>();
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(rows * k, 1));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    int8_gemv(xp, wp, ap, rows, n, k, lo, hi);
  });
  return acc;
}

at::Tensor w8a8_dynamic(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& ws,
                        double tiny) {
  check_linear(x, wq);
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.numel() == wq.size(0) && ws.is_contiguous(),
              "cpu_int8: float32 weight_scale [N] expected");
  const int64_t m = x.size(0), n = wq.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  auto [xq, s] = quantize_per_token(x, tiny);
  at::Tensor acc = int_mm(xq, wq);
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const int32_t* ap = acc.const_data_ptr<int32_t>();
    const float* sp = s.const_data_ptr<float>();
    const float* wp = ws.const_data_ptr<float>();
    T* yp = y.data_ptr<T>();
    over_rows(m, n, [&](int64_t lo, int64_t hi) {
      dynamic_epilogue(ap + lo * n, sp + lo, wp, yp + lo * n, hi - lo, n);
    });
  });
  return y;
}

at::Tensor w8a8_static(const at::Tensor& x_in, const at::Tensor& wq,
                       const at::Tensor& input_scale, const at::Tensor& input_offset,
                       const at::Tensor& quant_bias, const at::Tensor& deq_scale) {
  check_linear(x_in, wq);
  const int64_t n = wq.size(0);
  TORCH_CHECK(quant_bias.scalar_type() == at::kInt && quant_bias.numel() == n &&
                  deq_scale.scalar_type() == at::kFloat && deq_scale.numel() == n &&
                  quant_bias.is_contiguous() && deq_scale.is_contiguous(),
              "cpu_int8: int32 quant_bias [N] and float32 deq_scale [N] expected");
  at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float scale = input_scale.to(at::kFloat).item<float>();
  const float offset = input_offset.to(at::kFloat).item<float>();
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    int8_t* qp = xq.data_ptr<int8_t>();
    over_rows(m, k, [&](int64_t lo, int64_t hi) {
      quantize_static_rows(xp + lo * k, qp + lo * k, (hi - lo) * k, scale, offset);
    });
    at::Tensor acc = int_mm(xq, wq);
    const int32_t* ap = acc.const_data_ptr<int32_t>();
    T* yp = y.data_ptr<T>();
    const int32_t* bp = quant_bias.const_data_ptr<int32_t>();
    const float* dp = deq_scale.const_data_ptr<float>();
    over_rows(m, n, [&](int64_t lo, int64_t hi) {
      static_epilogue(ap + lo * n, bp, dp, yp + lo * n, hi - lo, n);
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(srt_cpu_int8, lib) {
  lib.def("quantize_per_token(Tensor x, float tiny) -> (Tensor, Tensor)");
  lib.def("w8a8_dynamic(Tensor x, Tensor wq, Tensor weight_scale, float tiny) -> Tensor");
  lib.def(
      "w8a8_static(Tensor x, Tensor wq, Tensor input_scale, Tensor input_offset, "
      "Tensor quant_bias, Tensor deq_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu_int8, CPU, lib) {
  lib.impl("quantize_per_token", &quantize_per_token);
  lib.impl("w8a8_dynamic", &w8a8_dynamic);
  lib.impl("w8a8_static", &w8a8_static);
}
