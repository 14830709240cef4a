// Sparse GQA attention over a gathered top-k support (CPU), for oracle / indexer sparse prefill.
//
// Built by magnetar.ops.op_builder.SparseAttentionBuilder (DeepSpeed OpBuilder, JIT). The torch reference is
// magnetar.prefill.oracle.sparse_gqa_attention(..., backend="torch"); the results agree to float32 rounding.
//
//   sparse_gqa_attention(q (B, Hq, S, D) f32, k (B, Hkv, N, D) f32, v (B, Hkv, N, D) f32,
//                        idx (B, M, kk) i64, q_pos (B, S) i64, k_pos (B, N) i64,
//                        b_sel, scale, window) -> (out (B, Hq, S, D) f32, lse (B, Hq, S) f32)
//
//   Query row t belongs to selection block m = t / b_sel and attends to the keys idx[b, m, :] only (-1 = empty
//   slot); a key s is visible to t iff k_pos[s] <= q_pos[t] and, with window >= 0, k_pos[s] > q_pos[t] - window (-1: no window).
//   Query head h reads KV head h / (Hq / Hkv). A query seeing none of its support gets out = 0, lse = -inf.
//
// The kernel reads only the selected K/V rows: one work item is (b, KV head, query row); it collects the visible
// support, loads each selected K row once for the G query heads sharing it (GQA), takes an exact softmax over
// the support (max, then sum of exponentials) and accumulates the selected V rows. Nothing of size S x N is
// ever built. Parallelised with at::parallel_for over the work items.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// x86-64: the kernel is compiled twice (AVX2+FMA and baseline) and the loader picks the clone the CPU supports
// (GCC/Clang function multi-versioning), so one cached build serves every machine without -march=native.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MAGNETAR_CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define MAGNETAR_CLONES
#endif

// exp(x) for x <= 0 (logits minus their max), vectorisable: x log2(e) = n + f with |f| <= 1/2, 2^f by its
// degree-7 Taylor polynomial (relative error < 1e-8, below float rounding), 2^n from the exponent bits.
// Below -87 (exp < 1.7e-38, float's normal range ends) the result is 0 as far as the softmax is concerned.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float y = x * 1.44269504088896341f;
  const int32_t n = static_cast<int32_t>(y - 0.5f);  // y <= 0: rounds to nearest (ties up)
  const float f = (y - static_cast<float>(n)) * 0.693147180559945309f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return p * two_n;
}

void check(const torch::Tensor& t, at::ScalarType type, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "magnetar sparse attention (CPU op): ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == type, "magnetar sparse attention: ", name, " must be ", type, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "magnetar sparse attention: ", name, " must have ", dim, " dims, got shape ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), "magnetar sparse attention: ", name, " must be contiguous");
}

struct Problem {
  const float *q, *k, *v;
  const int64_t *idx, *q_pos, *k_pos;
  float *out, *lse;
  int64_t B, Hq, Hkv, G, S, N, D, M, kk, b_sel, window;
  float scale;
};

// work items [begin, end) = (b, KV head, query row), row fastest; keys / logits: per-thread scratch (kk, G kk)
MAGNETAR_CLONES
void attend_items(const Problem& P, int64_t begin, int64_t end, int64_t* keys, float* logits) {
  const int64_t S = P.S, N = P.N, D = P.D, G = P.G, kk = P.kk;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item % S, hk = (item / S) % P.Hkv, b = item / (S * P.Hkv);
    const int64_t* sup = P.idx + (b * P.M + t / P.b_sel) * kk;
    const int64_t qp = P.q_pos[b * S + t];
    int64_t nv = 0;
    for (int64_t j = 0; j < kk; ++j) {
      const int64_t s = sup[j];
      if (s < 0 || s >= N) continue;
      const int64_t kp = P.k_pos[b * N + s];
      if (kp > qp || (P.window >= 0 && kp <= qp - P.window)) continue;
      keys[nv++] = s;
    }
    if (nv == 0) continue;  // out stays 0, lse -inf
    const float* kh = P.k + (b * P.Hkv + hk) * N * D;
    const float* vh = P.v + (b * P.Hkv + hk) * N * D;
    const int64_t row0 = (b * P.Hq + hk * G) * S + t;  // (b, first query head of the group, t); heads step S
    // logits, four keys at a time: four independent FMA chains instead of one (the dot is latency-bound)
    for (int64_t g = 0; g < G; ++g) {
      const float* qrow = P.q + (row0 + g * S) * D;
      float* l = logits + g * kk;
      int64_t i = 0;
      for (; i + 4 <= nv; i += 4) {
        const float *k0 = kh + keys[i] * D, *k1 = kh + keys[i + 1] * D, *k2 = kh + keys[i + 2] * D,
                    *k3 = kh + keys[i + 3] * D;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (int64_t d = 0; d < D; ++d) {
          const float x = qrow[d];
          a0 += x * k0[d];
          a1 += x * k1[d];
          a2 += x * k2[d];
          a3 += x * k3[d];
        }
        l[i] = a0 * P.scale;
        l[i + 1] = a1 * P.scale;
        l[i + 2] = a2 * P.scale;
        l[i + 3] = a3 * P.scale;
      }
      for (; i < nv; ++i) {
        const float* krow = kh + keys[i] * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qrow[d] * krow[d];
        l[i] = acc * P.scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* l = logits + g * kk;
      float mx = l[0];
      for (int64_t i = 1; i < nv; ++i) mx = l[i] > mx ? l[i] : mx;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < nv; ++i) {
        l[i] = exp_nonpositive(l[i] - mx);
        sum += l[i];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t i = 0; i < nv; ++i) l[i] *= inv;
      P.lse[row0 + g * S] = mx + std::log(sum);
    }
    // out += p V, four keys per pass over the output row (a quarter of the loads/stores of it)
    for (int64_t g = 0; g < G; ++g) {
      float* o = P.out + (row0 + g * S) * D;
      const float* l = logits + g * kk;
      int64_t i = 0;
      for (; i + 4 <= nv; i += 4) {
        const float *v0 = vh + keys[i] * D, *v1 = vh + keys[i + 1] * D, *v2 = vh + keys[i + 2] * D,
                    *v3 = vh + keys[i + 3] * D;
        const float w0 = l[i], w1 = l[i + 1], w2 = l[i + 2], w3 = l[i + 3];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
      }
      for (; i < nv; ++i) {
        const float* vrow = vh + keys[i] * D;
        const float w = l[i];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += w * vrow[d];
      }
    }
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> sparse_gqa_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                               const torch::Tensor& v, const torch::Tensor& idx,
                                                               const torch::Tensor& q_pos,
                                                               const torch::Tensor& k_pos, int64_t b_sel,
                                                               double scale, int64_t window) {
  check(q, at::kFloat, 4, "q");
  check(k, at::kFloat, 4, "k");
  check(v, at::kFloat, 4, "v");
  check(idx, at::kLong, 3, "idx");
  check(q_pos, at::kLong, 2, "q_pos");
  check(k_pos, at::kLong, 2, "k_pos");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), N = k.size(2), M = idx.size(1), kk = idx.size(2);
  TORCH_CHECK(b_sel >= 1, "magnetar sparse attention: b_sel must be >= 1, got ", b_sel);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && v.sizes() == k.sizes(), "magnetar sparse attention: q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " disagree");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "magnetar sparse attention: Hq=", Hq, " is not a multiple of Hkv=", Hkv);
  TORCH_CHECK(idx.size(0) == B && M == (S + b_sel - 1) / b_sel, "magnetar sparse attention: idx ", idx.sizes(),
              " must be (B, ceil(S / b_sel), kk) for S=", S, ", b_sel=", b_sel);
  TORCH_CHECK(q_pos.size(0) == B && q_pos.size(1) == S && k_pos.size(0) == B && k_pos.size(1) == N,
              "magnetar sparse attention: positions must be (B, S) and (B, N), got ", q_pos.sizes(), " and ",
              k_pos.sizes());
  const int64_t G = Hq / Hkv;
  auto out = torch::zeros_like(q);
  auto lse = torch::full({B, Hq, S}, -std::numeric_limits<float>::infinity(), q.options());
  if (B == 0 || S == 0 || kk == 0) return {out, lse};

  Problem P{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), idx.data_ptr<int64_t>(),
            q_pos.data_ptr<int64_t>(), k_pos.data_ptr<int64_t>(), out.data_ptr<float>(), lse.data_ptr<float>(),
            B, Hq, Hkv, G, S, N, D, M, kk, b_sel, window, static_cast<float>(scale)};
  at::parallel_for(0, B * Hkv * S, 8, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys(kk);
    std::vector<float> logits(G * kk);
    attend_items(P, begin, end, keys.data(), logits.data());
  });
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_gqa_attention", &sparse_gqa_attention,
        "attention of each query over its block's gathered top-k support (GQA, causal/window by positions)");
}
