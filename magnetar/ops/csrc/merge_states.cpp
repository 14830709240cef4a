// Fused merge of partial attention states (CPU).
//
// Built by magnetar.ops.op_builder.MergeStatesBuilder (DeepSpeed OpBuilder, JIT via
// torch.utils.cpp_extension.load). The torch reference is magnetar.ops.merge.merge_states_torch; the
// semantics below must stay identical to it:
//
//   outs (N, B, H, S, D) float32 / bfloat16 / float16 (float64 accepted, accumulated in float32 like the
//   reference), lses (N, B, H, S) float32. Per row r (= one (b, h, s)):
//     part n is empty     <=>  lses[n, r] == -inf          (it saw no key; its outs row is never read)
//     part n is poisoned  <=>  lses[n, r] is NaN or +inf   (non-finite input behind it)
//     any poisoned part:  out = NaN (every element), lse = NaN
//     otherwise, over the finite parts n:
//       m      = max_n lses[n, r]
//       w_n    = exp(lses[n, r] - m)
//       out    = sum_n w_n * outs[n, r, :] / sum_n w_n           (float32 accumulation)
//       lse    = m + log(sum_n w_n)
//   A row empty in every part gives out = 0, lse = -inf.
//
// As in the torch reference, the outs row of an *empty* part is never read, so NaN/inf garbage there cannot
// leak into the result. Finite parts whose weight underflows to 0 are still multiplied in, so a NaN/inf in
// their outs row stays non-finite in out (0 * NaN = NaN); lse does not depend on outs.
//
// Parallelised over rows with at::parallel_for (OpenMP in the CPU wheels; the builder passes -fopenmp).

#include "torch_op.h"

#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

inline float f32_from_bits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof(w));
  return w;
}

// Exact IEEE half -> float, the same algorithm as c10's fp16_ieee_to_fp32_value (normals, subnormals, inf,
// NaN) but with a bit-mask select instead of a branch, so the accumulation loop auto-vectorises without
// -march flags (c10::Half's conversion only does so when compiled with F16C). Checked exhaustively against
// torch's conversion by tests/test_fused_merge.py.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = UINT32_C(0xE0) << 23;
  const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const float denormalized = f32_from_bits((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
  const uint32_t is_denormal = 0u - static_cast<uint32_t>(two_w < (UINT32_C(1) << 27));  // all ones or zero
  return f32_from_bits(sign | (f32_to_bits(denormalized) & is_denormal) | (f32_to_bits(normalized) & ~is_denormal));
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

inline float to_float(c10::Half x) { return half_bits_to_float(x.x); }

template <typename scalar_t>
void merge_rows(const scalar_t* __restrict__ outs,  // (N, R, D)
                const float* __restrict__ lses,     // (N, R)
                scalar_t* __restrict__ out,         // (R, D)
                float* __restrict__ lse_out,        // (R)
                int64_t N, int64_t R, int64_t D, int64_t row_begin, int64_t row_end) {
  std::vector<float> acc(static_cast<size_t>(D));
  float* __restrict__ a = acc.data();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();

  for (int64_t r = row_begin; r < row_end; ++r) {
    // Pass 1: max over the finite parts; a NaN or +inf part poisons the row.
    float m = neg_inf;
    bool any = false;
    bool poisoned = false;
    for (int64_t n = 0; n < N; ++n) {
      const float l = lses[n * R + r];
      if (std::isfinite(l)) {
        m = any ? std::max(m, l) : l;
        any = true;
      } else if (!(l < 0.0f)) {  // NaN or +inf (-inf is an empty part)
        poisoned = true;
      }
    }
    scalar_t* __restrict__ o_row = out + r * D;
    if (poisoned) {
      for (int64_t d = 0; d < D; ++d) o_row[d] = static_cast<scalar_t>(nan);
      lse_out[r] = nan;
      continue;
    }
    if (!any) {
      for (int64_t d = 0; d < D; ++d) o_row[d] = static_cast<scalar_t>(0.0f);
      lse_out[r] = neg_inf;
      continue;
    }

    // Pass 2: weighted sum in float32.
    for (int64_t d = 0; d < D; ++d) a[d] = 0.0f;
    float denom = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float l = lses[n * R + r];
      if (!std::isfinite(l)) continue;  // empty part (-inf): ignored, including its outs row
      const float w = std::exp(l - m);
      denom += w;
      const scalar_t* __restrict__ src = outs + (n * R + r) * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * to_float(src[d]);
    }
    // denom >= 1: the part holding the max contributes exp(0) = 1.
    for (int64_t d = 0; d < D; ++d) o_row[d] = static_cast<scalar_t>(a[d] / denom);
    lse_out[r] = m + std::log(denom);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> merge_states_cpu(at::Tensor outs, at::Tensor lses) {
  TORCH_CHECK(outs.dim() == 5, "magnetar merge_states: outs must be (N, B, H, S, D), got ", outs.dim(),
              " dims with shape ", outs.sizes());
  TORCH_CHECK(lses.dim() == 4, "magnetar merge_states: lses must be (N, B, H, S), got ", lses.dim(),
              " dims with shape ", lses.sizes());
  TORCH_CHECK(lses.sizes() == outs.sizes().slice(0, 4), "magnetar merge_states: lses shape ", lses.sizes(),
              " does not match outs shape ", outs.sizes(), " without its last dim");
  TORCH_CHECK(outs.size(0) > 0, "magnetar merge_states: got N = 0 partial states; pass at least one");
  TORCH_CHECK(outs.device().is_cpu() && lses.device().is_cpu(),
              "magnetar merge_states (CPU op): outs and lses must be CPU tensors, got ", outs.device(), " and ",
              lses.device());
  TORCH_CHECK(lses.scalar_type() == at::kFloat, "magnetar merge_states: lses must be float32, got ",
              lses.scalar_type());
  TORCH_CHECK(outs.scalar_type() == at::kFloat || outs.scalar_type() == at::kBFloat16 ||
                  outs.scalar_type() == at::kHalf || outs.scalar_type() == at::kDouble,
              "magnetar merge_states: outs must be float32, bfloat16, float16 (or float64), got ", outs.scalar_type());

  outs = outs.contiguous();
  lses = lses.contiguous();

  const int64_t N = outs.size(0);
  const int64_t B = outs.size(1), H = outs.size(2), S = outs.size(3), D = outs.size(4);
  const int64_t R = B * H * S;

  auto out = at::empty({B, H, S, D}, outs.options());
  auto lse_out = at::empty({B, H, S}, lses.options());
  if (R == 0) return {out, lse_out};

  // Rows per task: aim for ~GRAIN_SIZE element reads per task so tiny merges stay on one thread.
  const int64_t work_per_row = std::max<int64_t>(1, N * (D + 1));
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / work_per_row);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, outs.scalar_type(), "magnetar_merge_states_cpu", [&] {
    const scalar_t* outs_p = outs.const_data_ptr<scalar_t>();
    const float* lses_p = lses.const_data_ptr<float>();
    scalar_t* out_p = out.mutable_data_ptr<scalar_t>();
    float* lse_p = lse_out.mutable_data_ptr<float>();
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      merge_rows<scalar_t>(outs_p, lses_p, out_p, lse_p, N, R, D, begin, end);
    });
  });
  return {out, lse_out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Magnetar fused merge of partial attention states (CPU)";
  m.def("merge_states", &merge_states_cpu,
        "merge_states(outs (N,B,H,S,D), lses (N,B,H,S) float32) -> (out (B,H,S,D), lse (B,H,S) float32)",
        pybind11::arg("outs"), pybind11::arg("lses"));
}
