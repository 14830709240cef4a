// RMSNorm of Llama-family models on the CPU, as one pass over each row (magnetar.engine.norms swaps it in).
//
// Built by magnetar.ops.op_builder.RMSNormBuilder (DeepSpeed OpBuilder, JIT). The reference is the fp64 RMSNorm of
// tests/test_rms_norm.py; Hugging Face's LlamaRMSNorm computes the same roundings:
//
//   rms_norm(x (rows, H) float32 or bfloat16, contiguous, weight (H) of x's dtype, eps) -> y (rows, H), x's dtype:
//       inv = 1 / sqrt(mean(x^2) + eps)   (float32: the squares and their sum in float32)
//       y   = weight * round(x * inv)     (round: to x's dtype, nearest even -- HF's `.to(input_dtype)` -- then
//                                          the product in float32, rounded once more: torch's bf16 multiply)
//   A NaN or inf in a row makes its sum non-finite and every element of the row NaN (or inf): nothing here turns
//   them into a finite number.
//
// Why: torch runs LlamaRMSNorm as eight ops (a float32 copy, pow, mean, add, rsqrt, mul, the cast back, the
// weight's mul), each a pass over the row and most a parallel region: a 1000-row bf16 norm of SmolLM2 (H 576) took
// 0.5-1.8 ms on two cores of the Intel AMX VM -- 61 of them a forward, up to a sixth of a 1000-token query forward
// -- and torch's fused F.rms_norm, which rounds once less than HF, ~0.9 of that (benchmarks/bench_norm.py). Here a
// row is read twice from cache (the sum, then the product) and written once; AVX-512 code is chosen at run time (a
// scalar loop elsewhere). Rows are split over at::parallel_for, a small
// input (a decode step's few rows) on the calling thread.

#include "torch_op.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_features.h"
#include "vec512.h"

namespace {

constexpr int64_t kParallelElements = 1 << 15;  // elements per parallel chunk: a decode step's rows stay on one thread

// The scalar row: the same sums in the same order as the vector code's lanes would not give (one accumulator), but
// the same roundings of each element.
template <typename T>
void row_scalar(const T* x, const T* w, T* y, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    const T n = static_cast<T>(static_cast<float>(x[i]) * inv);  // HF's .to(input_dtype)
    y[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(n));
  }
}

#ifdef MAGNETAR_X86_DISPATCH
using namespace magnetar_vec512;

template <typename T>
MAGNETAR_AVX512 void row_avx512(const T* x, const T* w, T* y, int64_t H, float eps) {
  const int64_t body = H - H % 16;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= body; i += 32) {
    const __m512 v0 = load16(x + i), v1 = load16(x + i + 16);
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  for (; i < body; i += 16) {
    const __m512 v = load16(x + i);
    a0 = _mm512_fmadd_ps(v, v, a0);
  }
  float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (int64_t t = body; t < H; ++t) {
    const float v = static_cast<float>(x[t]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  const __m512 s = _mm512_set1_ps(inv);
  for (i = 0; i < body; i += 16) {
    const __m512 n = rounded(_mm512_mul_ps(load16(x + i), s), x);
    store16(y + i, _mm512_mul_ps(load16(w + i), n));
  }
  for (int64_t t = body; t < H; ++t) {
    const T n = static_cast<T>(static_cast<float>(x[t]) * inv);
    y[t] = static_cast<T>(static_cast<float>(w[t]) * static_cast<float>(n));
  }
}
#endif

template <typename T>
void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps, bool allow_vector) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const float e = static_cast<float>(eps);
  const bool vec = allow_vector && avx512_here();
  at::parallel_for(0, rows, std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, H)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
#ifdef MAGNETAR_X86_DISPATCH
                       if (vec) {
                         row_avx512<T>(xp + r * H, wp, yp + r * H, H, e);
                         continue;
                       }
#endif
                       row_scalar<T>(xp + r * H, wp, yp + r * H, H, e);
                     }
                   });
}

}  // namespace

at::Tensor rms_norm_with(const at::Tensor& x, const at::Tensor& weight, double eps, bool allow_vector) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous (rows, H) tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: weight must be a contiguous (H) tensor, H = x.size(1)");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x and weight both float32 or both bfloat16");
  TORCH_CHECK(x.size(1) > 0, "rms_norm: H must be positive");
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, weight, y, eps, allow_vector);
  } else {
    run<at::BFloat16>(x, weight, y, eps, allow_vector);
  }
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_with(x, weight, eps, true);
}

// The scalar loop whatever the CPU: the tests check it on machines that would otherwise run the AVX-512 code.
at::Tensor rms_norm_scalar(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_with(x, weight, eps, false);
}

bool vectorized() { return avx512_here(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "Llama's RMSNorm of each row: weight * round(x / sqrt(mean(x^2) + eps))");
  m.def("rms_norm_scalar", &rms_norm_scalar, "rms_norm by the scalar loop on any CPU (for tests)");
  m.def("vectorized", &vectorized, "whether rms_norm runs its AVX-512 code on this CPU (else a scalar loop)");
}
