// The rotary position embedding of Llama-family models on the CPU, as one pass over q or k (magnetar.engine.rotary
// puts it in transformers' apply_rotary_pos_emb where it gives that function's values).
//
// Built by magnetar.ops.op_builder.RotaryBuilder (DeepSpeed OpBuilder, JIT; -ffp-contract=off: no product and sum
// fused into one rounding). The reference is the fp64 formula of tests/test_rotary.py; transformers'
// apply_rotary_pos_emb (unsqueeze_dim=1) computes the same roundings:
//
//   rotary(x (B, H, S, D), cos (Bc, S, D), sin (Bc, S, D); float32 or bfloat16, one dtype; Bc 1 or B; D even; the
//          last dimensions contiguous, any other strides)
//       -> round(round(x * cos) + round(rotate_half(x) * sin))   x's shape, strides and dtype
//       rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]); round: to the dtype, nearest even (a no-op in float32)
//   A NaN or inf stays one: nothing here turns them into a finite number.
//
// Why: torch runs the embedding as nine ops a tensor (two multiplies, two slices, a negation, a concatenation, a
// sum), each a pass over memory and most a parallel region: 0.7-1.4 ms a layer for a 1000-token bf16 query of
// SmolLM2 on two cores of the Intel AMX VM, 2.6-4.5 ms for four of them joined (docs/results.md, "One pass for the
// rotary embedding"). Here q and k are read once and written once; AVX-512 code is chosen at run time where D / 2 is
// a multiple of 16, a scalar loop elsewhere. Rows (b, h, s) are split over at::parallel_for, a small input (a decode
// step's few rows) on the calling thread.

#include "torch_op.h"

#include <algorithm>
#include <cstdint>

#include "cpu_features.h"
#include "vec512.h"

namespace {

constexpr int64_t kParallelElements = 1 << 15;  // elements per parallel chunk: a decode step's rows stay on one thread

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);  // c10's float -> bfloat16: nearest even, NaN kept
}

// The scalar row: the same roundings element by element.
template <typename T>
void rotary_row_scalar(const T* x, const T* c, const T* s, T* y, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float r = i < h ? -static_cast<float>(x[i + h]) : static_cast<float>(x[i - h]);
    const T a = round_to<T>(static_cast<float>(x[i]) * static_cast<float>(c[i]));
    const T b = round_to<T>(r * static_cast<float>(s[i]));
    y[i] = round_to<T>(static_cast<float>(a) + static_cast<float>(b));
  }
}

#ifdef MAGNETAR_X86_DISPATCH
using namespace magnetar_vec512;

// One row of D = 2 h elements, h a multiple of 16: each half from both halves of x.
template <typename T>
MAGNETAR_AVX512 void rotary_row_avx512(const T* x, const T* c, const T* s, T* y, int64_t D) {
  const int64_t h = D / 2;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + h + i);
    // first half: x1 cos - x2 sin; second half: x2 cos + x1 sin (each product rounded, then the sum)
    const __m512 a1 = rounded(_mm512_mul_ps(x1, load16(c + i)), x);
    const __m512 b1 = rounded(_mm512_mul_ps(_mm512_sub_ps(zero, x2), load16(s + i)), x);
    store16(y + i, _mm512_add_ps(a1, b1));
    const __m512 a2 = rounded(_mm512_mul_ps(x2, load16(c + h + i)), x);
    const __m512 b2 = rounded(_mm512_mul_ps(x1, load16(s + h + i)), x);
    store16(y + h + i, _mm512_add_ps(a2, b2));
  }
}
#endif

template <typename T>
void run_rotary(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, at::Tensor& y, bool allow_vector) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  const int64_t cb = c.size(0) == 1 ? 0 : c.stride(0), sb = s.size(0) == 1 ? 0 : s.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* sp = s.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const bool vec = allow_vector && avx512_here() && (D / 2) % 16 == 0;
  const bool heads_inner = x.stride(1) < x.stride(2);
  at::parallel_for(0, B * H * S, std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, D)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       // rows in memory order: a view of the projection's heads (B, S, H, D) transposed holds a
                       // token's heads side by side -- heads inner, and each token's cos / sin read once
                       const int64_t b = r / (H * S);
                       const int64_t hh = heads_inner ? r % H : (r / S) % H, t = heads_inner ? (r / H) % S : r % S;
                       const T* xr = xp + b * x.stride(0) + hh * x.stride(1) + t * x.stride(2);
                       const T* cr = cp + b * cb + t * c.stride(1);
                       const T* sr = sp + b * sb + t * s.stride(1);
                       T* yr = yp + b * y.stride(0) + hh * y.stride(1) + t * y.stride(2);
#ifdef MAGNETAR_X86_DISPATCH
                       if (vec) {
                         rotary_row_avx512<T>(xr, cr, sr, yr, D);
                         continue;
                       }
#endif
                       rotary_row_scalar<T>(xr, cr, sr, yr, D);
                     }
                   });
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

}  // namespace

at::Tensor rotary_with(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool allow_vector) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rotary: CPU tensors");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "rotary: x must be (B, H, S, D) with D even");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == x.size(2) && cos.size(2) == x.size(3) &&
                  (cos.size(0) == 1 || cos.size(0) == x.size(0)),
              "rotary: cos and sin must be (B or 1, S, D) of x's S and D");
  TORCH_CHECK(x.stride(3) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1,
              "rotary: the last dimension of x, cos and sin must be contiguous");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() && float_or_bf16(x),
              "rotary: x, cos and sin all float32 or all bfloat16");
  at::Tensor y = at::empty_like(x);  // x's strides where x is dense (a view of the projection's heads): torch's too
  if (x.scalar_type() == at::kFloat) {
    run_rotary<float>(x, cos, sin, y, allow_vector);
  } else {
    run_rotary<at::BFloat16>(x, cos, sin, y, allow_vector);
  }
  return y;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_with(x, cos, sin, true);
}

// The scalar loop whatever the CPU: the tests check it on machines that would otherwise run the AVX-512 code.
at::Tensor rotary_scalar(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_with(x, cos, sin, false);
}

bool vectorized() { return avx512_here(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary", &rotary, "x * cos + rotate_half(x) * sin of (B, H, S, D) x, each product rounded");
  m.def("rotary_scalar", &rotary_scalar, "rotary by the scalar loop on any CPU (for tests)");
  m.def("vectorized", &vectorized, "whether rotary runs its AVX-512 code on this CPU (else a scalar loop)");
}
