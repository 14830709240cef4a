// Sparse prefill ops (CPU): the attention-mass oracle's top-k support and sparse GQA attention over a gathered
// top-k support, for oracle / indexer sparse prefill.
//
// Built by magnetar.ops.op_builder.SparseAttentionBuilder (DeepSpeed OpBuilder, JIT). The torch reference is
// magnetar.prefill.oracle.sparse_gqa_attention(..., backend="torch"); the results agree to float32 rounding.
//
//   sparse_gqa_attention(q (B, Hq, S, D) f32, k (B, Hkv, N, D) f32, v (B, Hkv, N, D) f32,
//                        idx (B, M, kk) i64, q_pos (B, S) i64, k_pos (B, N) i64,
//                        b_sel, scale, window) -> (out (B, Hq, S, D) f32, lse (B, Hq, S) f32)
//
//   Query row t belongs to selection block m = t / b_sel and attends to the keys idx[b, m, :] only (-1 = empty
//   slot); a key s is visible to t iff k_pos[s] <= q_pos[t] and, with window >= 0, k_pos[s] > q_pos[t] - window
//   (window -1: none).
//   Query head h reads KV head h / (Hq / Hkv). A query seeing none of its support gets out = 0, lse = -inf.
//
//   oracle_topk(q, k, q_pos, k_pos, topk, b_sel, scale, window) -> idx (B, ceil(S / b_sel), min(topk, N)) i64
//
//   Paper 004 Algorithm 1, steps 1-4, fused: for every query row t, the dense causal softmax of every query head
//   over the keys visible to t, averaged over the Hq heads into P(t, s); per block of b_sel rows the block max
//   P_B(s) = max_t P(t, s) over the rows that see s; the top-k keys of P_B in decreasing order, slots without a
//   visible key = -1. The torch reference is magnetar.prefill.oracle.head_averaged_topk(..., backend="torch").
//   One work item is one block; a row's logits (Hq x N floats) live in a per-thread buffer, never S x N.
//
//   indexer_topk(q (B, S, d), k (B, N, d), q_pos, k_pos, topk, b_sel, scale, window) -> idx as above
//
//   Algorithm 2's selection fused: z(t, s) = ReLU(scale q_t . k_s) of the head-collapsed indexer over the keys
//   visible to t, block max, top-k (ReLU's zeros tie: which of them fill the last slots is unspecified).
//   The torch reference is magnetar.prefill.indexer.HeadCollapsedIndexer.select(..., backend="torch").
//
// sparse_gqa_attention reads only the selected K/V rows: one work item is (b, KV head, query row); it collects
// the visible support, loads each selected K row once for the G query heads sharing it (GQA), takes an exact
// softmax over the support (max, then sum of exponentials) and accumulates the selected V rows. Nothing of size
// S x N is ever built. Parallelised with at::parallel_for over the work items.

#include "torch_op.h"

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_features.h"

namespace {

// x86-64 with GCC/Clang: each kernel body is compiled twice, for AVX2+FMA and for the baseline, and
// cpu_has_avx2_fma() (cpu_features.h) picks one at run time.
#define MAGNETAR_BODY static inline __attribute__((always_inline))

// exp(x) for x <= 0 (logits minus their max), vectorisable: x log2(e) = n + f with |f| <= 1/2, 2^f by its
// degree-7 Taylor polynomial (relative error < 1e-8, below float rounding), 2^n from the exponent bits.
// Below -87 (exp < 1.7e-38, float's normal range ends) the result is 0 as far as the softmax is concerned.
MAGNETAR_BODY float exp_nonpositive(float x) {
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

// 8-float vectors (GCC/Clang vector extensions: one AVX register in the AVX2 variant, two SSE ones otherwise)
typedef float v8f __attribute__((vector_size(32)));
MAGNETAR_BODY v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
MAGNETAR_BODY void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
MAGNETAR_BODY float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// out[j] = scale * q . rows[j] for four key rows at once (four independent accumulator chains)
MAGNETAR_BODY void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3,
                        int64_t D, float scale, float* out) {
  if (D % 8 == 0) {
    v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int64_t d = 0; d < D; d += 8) {
      const v8f x = load8(q + d);
      a0 += x * load8(k0 + d);
      a1 += x * load8(k1 + d);
      a2 += x * load8(k2 + d);
      a3 += x * load8(k3 + d);
    }
    out[0] = hsum8(a0) * scale;
    out[1] = hsum8(a1) * scale;
    out[2] = hsum8(a2) * scale;
    out[3] = hsum8(a3) * scale;
    return;
  }
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float x = q[d];
    a0 += x * k0[d];
    a1 += x * k1[d];
    a2 += x * k2[d];
    a3 += x * k3[d];
  }
  out[0] = a0 * scale;
  out[1] = a1 * scale;
  out[2] = a2 * scale;
  out[3] = a3 * scale;
}

MAGNETAR_BODY float dot1(const float* q, const float* k, int64_t D, float scale) {
  float acc = 0.f;
  for (int64_t d = 0; d < D; ++d) acc += q[d] * k[d];
  return acc * scale;
}

// logits l[i] = scale * q . K[keys[i]] for the nv keys
MAGNETAR_BODY void row_logits(const float* q, const float* kh, const int64_t* keys, int64_t nv, int64_t D,
                              float scale, float* l) {
  int64_t i = 0;
  for (; i + 4 <= nv; i += 4)
    dot4(q, kh + keys[i] * D, kh + keys[i + 1] * D, kh + keys[i + 2] * D, kh + keys[i + 3] * D, D, scale, l + i);
  for (; i < nv; ++i) l[i] = dot1(q, kh + keys[i] * D, D, scale);
}

// o += sum_i w[i] V[keys[i]], four rows per pass over o
MAGNETAR_BODY void accumulate_rows(float* o, const float* vh, const int64_t* keys, const float* w, int64_t nv,
                                   int64_t D) {
  int64_t i = 0;
  for (; i + 4 <= nv; i += 4) {
    const float *v0 = vh + keys[i] * D, *v1 = vh + keys[i + 1] * D, *v2 = vh + keys[i + 2] * D,
                *v3 = vh + keys[i + 3] * D;
    const float w0 = w[i], w1 = w[i + 1], w2 = w[i + 2], w3 = w[i + 3];
    if (D % 8 == 0) {
      for (int64_t d = 0; d < D; d += 8)
        store8(o + d, load8(o + d) + w0 * load8(v0 + d) + w1 * load8(v1 + d) + w2 * load8(v2 + d) +
                          w3 * load8(v3 + d));
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
    }
  }
  for (; i < nv; ++i) {
    const float* vrow = vh + keys[i] * D;
    for (int64_t d = 0; d < D; ++d) o[d] += w[i] * vrow[d];
  }
}

void check(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* name) {
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

// key s of sequence b visible to a query at position qp (causal, and inside the window when window >= 0)
MAGNETAR_BODY bool visible(const Problem& P, int64_t b, int64_t qp, int64_t s) {
  const int64_t kp = P.k_pos[b * P.N + s];
  return kp <= qp && (P.window < 0 || kp > qp - P.window);
}

// every key of sequence b visible to the query at position qp, in index order, into keys; returns the count
MAGNETAR_BODY int64_t visible_keys(const Problem& P, int64_t b, int64_t qp, int64_t* keys) {
  int64_t nv = 0;
  for (int64_t s = 0; s < P.N; ++s)
    if (visible(P, b, qp, s)) keys[nv++] = s;
  return nv;
}

// l[0, nv) <- exp(l - max l); returns the sum of the exponentials (>= 1), max in *mx (log-sum-exp = mx + log sum)
MAGNETAR_BODY float exp_shifted(float* l, int64_t nv, float* mx) {
  float m = l[0];
  for (int64_t i = 1; i < nv; ++i) m = l[i] > m ? l[i] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < nv; ++i) {
    l[i] = exp_nonpositive(l[i] - m);
    sum += l[i];
  }
  *mx = m;
  return sum;
}


// work items [begin, end) = (b, KV head, query row), row fastest; keys / logits: per-thread scratch (kk, G kk)
MAGNETAR_BODY void attend_items_body(const Problem& P, int64_t begin, int64_t end, int64_t* keys, float* logits) {
  const int64_t S = P.S, N = P.N, D = P.D, G = P.G, kk = P.kk;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item % S, hk = (item / S) % P.Hkv, b = item / (S * P.Hkv);
    const int64_t* sup = P.idx + (b * P.M + t / P.b_sel) * kk;
    const int64_t qp = P.q_pos[b * S + t];
    int64_t nv = 0;
    for (int64_t j = 0; j < kk; ++j)
      if (sup[j] >= 0 && sup[j] < N && visible(P, b, qp, sup[j])) keys[nv++] = sup[j];
    if (nv == 0) continue;  // out stays 0, lse -inf
    const float* kh = P.k + (b * P.Hkv + hk) * N * D;
    const float* vh = P.v + (b * P.Hkv + hk) * N * D;
    const int64_t row0 = (b * P.Hq + hk * G) * S + t;  // (b, first query head of the group, t); heads step S
    // logits, four keys at a time: four independent FMA chains instead of one (the dot is latency-bound)
    for (int64_t g = 0; g < G; ++g)
      row_logits(P.q + (row0 + g * S) * D, kh, keys, nv, D, P.scale, logits + g * kk);
    for (int64_t g = 0; g < G; ++g) {
      float* l = logits + g * kk;
      float mx;
      const float sum = exp_shifted(l, nv, &mx);
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t i = 0; i < nv; ++i) l[i] *= inv;
      P.lse[row0 + g * S] = mx + std::log(sum);
    }
    // out += p V, four keys per pass over the output row (a quarter of the loads/stores of it)
    for (int64_t g = 0; g < G; ++g) accumulate_rows(P.out + (row0 + g * S) * D, vh, keys, logits + g * kk, nv, D);
  }
}

// the top-k of one block's scores (n keys, -inf = not visible to any row) into out (kk slots), decreasing score,
// ties by index; -1 pads. The k-th largest value is found by nth_element on a plain copy of the values (no
// indirect comparisons), then the keys above it and, in index order, enough keys equal to it are taken.
// vals, cand: scratch of n.
void topk_row(const float* score, int64_t n, int64_t kk, float* vals, int64_t* cand, int64_t* out) {
  int64_t nc = 0;
  for (int64_t s = 0; s < n; ++s)
    if (score[s] != -std::numeric_limits<float>::infinity()) {
      vals[nc] = score[s];
      cand[nc++] = s;
    }
  int64_t take = 0;
  if (nc > kk) {
    std::nth_element(vals, vals + kk - 1, vals + nc, std::greater<float>());
    const float thr = vals[kk - 1];
    for (int64_t i = 0; i < nc; ++i)
      if (score[cand[i]] > thr) out[take++] = cand[i];
    for (int64_t i = 0; i < nc && take < kk; ++i)
      if (score[cand[i]] == thr) out[take++] = cand[i];
  } else {
    for (int64_t i = 0; i < nc; ++i) out[take++] = cand[i];
  }
  std::sort(out, out + take,
            [score](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
  for (int64_t j = take; j < kk; ++j) out[j] = -1;
}

// blocks [begin, end) = (b, block m); logits (Hq N), pblock (N), cand (N): per-thread scratch
MAGNETAR_BODY void oracle_blocks_body(const Problem& P, int64_t topk_slots, int64_t begin, int64_t end,
                                      float* logits, float* pblock, int64_t* keys, int64_t* cand, int64_t* idx_out) {
  const int64_t S = P.S, N = P.N, D = P.D, G = P.G, Hq = P.Hq;
  const float ninf = -std::numeric_limits<float>::infinity();
  const float inv_h = 1.f / static_cast<float>(Hq);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t m = item % P.M, b = item / P.M;
    for (int64_t s = 0; s < N; ++s) pblock[s] = ninf;
    const int64_t t1 = (m + 1) * P.b_sel < S ? (m + 1) * P.b_sel : S;
    for (int64_t t = m * P.b_sel; t < t1; ++t) {
      const int64_t qp = P.q_pos[b * S + t];
      const int64_t nv = visible_keys(P, b, qp, keys);
      if (nv == 0) continue;
      for (int64_t hk = 0; hk < P.Hkv; ++hk) {
        const float* kh = P.k + (b * P.Hkv + hk) * N * D;
        for (int64_t g = 0; g < G; ++g)
          row_logits(P.q + ((b * Hq + hk * G + g) * S + t) * D, kh, keys, nv, D, P.scale, logits + (hk * G + g) * N);
      }
      // per head: l <- exp(l - lse) / Hq, summed into the first head's row = P(t, .) over the visible keys
      float* p = logits;
      for (int64_t h = 0; h < Hq; ++h) {
        float* l = logits + h * N;
        float mx;
        const float sum = exp_shifted(l, nv, &mx);
        const float w = inv_h / sum;
        if (h == 0) {
#pragma omp simd
          for (int64_t i = 0; i < nv; ++i) p[i] = l[i] * w;
        } else {
#pragma omp simd
          for (int64_t i = 0; i < nv; ++i) p[i] += l[i] * w;
        }
      }
      for (int64_t i = 0; i < nv; ++i) pblock[keys[i]] = p[i] > pblock[keys[i]] ? p[i] : pblock[keys[i]];
    }
    topk_row(pblock, N, topk_slots, logits, cand, idx_out + item * topk_slots);
  }
}

// indexer blocks [begin, end) = (b, block m): z(t, s) = ReLU(scale q_t . k_s) of one head (q, k (B, S|N, D)),
// block max over the rows that see s, top-k. logits (N), pblock (N), keys (N), cand (N): per-thread scratch
MAGNETAR_BODY void indexer_blocks_body(const Problem& P, int64_t kk, int64_t begin, int64_t end, float* logits,
                                       float* pblock, int64_t* keys, int64_t* cand, int64_t* idx_out) {
  const int64_t S = P.S, N = P.N, D = P.D;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t item = begin; item < end; ++item) {
    const int64_t m = item % P.M, b = item / P.M;
    for (int64_t s = 0; s < N; ++s) pblock[s] = ninf;
    const int64_t t1 = (m + 1) * P.b_sel < S ? (m + 1) * P.b_sel : S;
    const float* kb = P.k + b * N * D;
    for (int64_t t = m * P.b_sel; t < t1; ++t) {
      const int64_t qp = P.q_pos[b * S + t];
      const int64_t nv = visible_keys(P, b, qp, keys);
      row_logits(P.q + (b * S + t) * D, kb, keys, nv, D, P.scale, logits);
      for (int64_t i = 0; i < nv; ++i) {
        const float z = logits[i] > 0.f ? logits[i] : 0.f;
        pblock[keys[i]] = z > pblock[keys[i]] ? z : pblock[keys[i]];
      }
    }
    topk_row(pblock, N, kk, logits, cand, idx_out + item * kk);
  }
}

#ifdef MAGNETAR_X86_DISPATCH
__attribute__((target("avx2,fma"))) void attend_items_avx2(const Problem& P, int64_t begin, int64_t end,
                                                           int64_t* keys, float* logits) {
  attend_items_body(P, begin, end, keys, logits);
}
__attribute__((target("avx2,fma"))) void oracle_blocks_avx2(const Problem& P, int64_t kk, int64_t begin,
                                                            int64_t end, float* logits, float* pblock,
                                                            int64_t* keys, int64_t* cand, int64_t* idx_out) {
  oracle_blocks_body(P, kk, begin, end, logits, pblock, keys, cand, idx_out);
}
__attribute__((target("avx2,fma"))) void indexer_blocks_avx2(const Problem& P, int64_t kk, int64_t begin,
                                                             int64_t end, float* logits, float* pblock,
                                                             int64_t* keys, int64_t* cand, int64_t* idx_out) {
  indexer_blocks_body(P, kk, begin, end, logits, pblock, keys, cand, idx_out);
}
#endif

void indexer_blocks(const Problem& P, int64_t kk, int64_t begin, int64_t end, float* logits, float* pblock,
                    int64_t* keys, int64_t* cand, int64_t* idx_out) {
#ifdef MAGNETAR_X86_DISPATCH
  if (cpu_has_avx2_fma()) return indexer_blocks_avx2(P, kk, begin, end, logits, pblock, keys, cand, idx_out);
#endif
  indexer_blocks_body(P, kk, begin, end, logits, pblock, keys, cand, idx_out);
}

void attend_items(const Problem& P, int64_t begin, int64_t end, int64_t* keys, float* logits) {
#ifdef MAGNETAR_X86_DISPATCH
  if (cpu_has_avx2_fma()) return attend_items_avx2(P, begin, end, keys, logits);
#endif
  attend_items_body(P, begin, end, keys, logits);
}

void oracle_blocks(const Problem& P, int64_t kk, int64_t begin, int64_t end, float* logits, float* pblock,
                   int64_t* keys, int64_t* cand, int64_t* idx_out) {
#ifdef MAGNETAR_X86_DISPATCH
  if (cpu_has_avx2_fma()) return oracle_blocks_avx2(P, kk, begin, end, logits, pblock, keys, cand, idx_out);
#endif
  oracle_blocks_body(P, kk, begin, end, logits, pblock, keys, cand, idx_out);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sparse_gqa_attention(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& idx,
                                                               const at::Tensor& q_pos,
                                                               const at::Tensor& k_pos, int64_t b_sel,
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
  auto out = at::zeros_like(q);
  auto lse = at::full({B, Hq, S}, -std::numeric_limits<float>::infinity(), q.options());
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

// oracle_topk (Hq heads, softmax mass) and indexer_topk (one head, ReLU scores; q, k as (B, 1, S|N, d)) share
// the checks, the output and the parallel loop over (b, block)
at::Tensor block_topk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_pos,
                         const at::Tensor& k_pos, int64_t topk, int64_t b_sel, double scale, int64_t window,
                         bool indexer) {
  const char* what = indexer ? "magnetar indexer top-k: " : "magnetar oracle top-k: ";
  check(q, at::kFloat, 4, "q");
  check(k, at::kFloat, 4, "k");
  check(q_pos, at::kLong, 2, "q_pos");
  check(k_pos, at::kLong, 2, "k_pos");
  const int64_t B = q.size(0), Hq = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1), N = k.size(2);
  TORCH_CHECK(topk >= 1 && b_sel >= 1, what, "topk and b_sel must be >= 1, got ", topk, ", ", b_sel);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D, what, "q ", q.sizes(), " and k ", k.sizes(), " disagree");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, what, "Hq=", Hq, " is not a multiple of Hkv=", Hkv);
  TORCH_CHECK(q_pos.size(0) == B && q_pos.size(1) == S && k_pos.size(0) == B && k_pos.size(1) == N, what,
              "positions must be (B, S) and (B, N), got ", q_pos.sizes(), " and ", k_pos.sizes());
  const int64_t M = (S + b_sel - 1) / b_sel, kk = topk < N ? topk : N;
  auto idx = at::full({B, M, kk}, -1, q_pos.options());
  if (B == 0 || S == 0 || kk == 0) return idx;
  Problem P{q.data_ptr<float>(), k.data_ptr<float>(), nullptr, nullptr, q_pos.data_ptr<int64_t>(),
            k_pos.data_ptr<int64_t>(), nullptr, nullptr, B, Hq, Hkv, Hq / Hkv, S, N, D, M, kk, b_sel, window,
            static_cast<float>(scale)};
  int64_t* out = idx.data_ptr<int64_t>();
  at::parallel_for(0, B * M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits(Hq * N), pblock(N);
    std::vector<int64_t> keys(N), cand(N);
    if (indexer)
      indexer_blocks(P, kk, begin, end, logits.data(), pblock.data(), keys.data(), cand.data(), out);
    else
      oracle_blocks(P, kk, begin, end, logits.data(), pblock.data(), keys.data(), cand.data(), out);
  });
  return idx;
}

at::Tensor oracle_topk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_pos,
                          const at::Tensor& k_pos, int64_t topk, int64_t b_sel, double scale, int64_t window) {
  return block_topk(q, k, q_pos, k_pos, topk, b_sel, scale, window, false);
}

at::Tensor indexer_topk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& q_pos,
                           const at::Tensor& k_pos, int64_t topk, int64_t b_sel, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "magnetar indexer top-k: q and k must be (B, S, d) and (B, N, d), got ",
              q.sizes(), " and ", k.sizes());
  return block_topk(q.unsqueeze(1), k.unsqueeze(1), q_pos, k_pos, topk, b_sel, scale, window, true);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_gqa_attention", &sparse_gqa_attention,
        "attention of each query over its block's gathered top-k support (GQA, causal/window by positions)");
  m.def("oracle_topk", &oracle_topk,
        "top-k keys of the head-averaged dense attention per query block (block max), -1 padded");
  m.def("indexer_topk", &indexer_topk,
        "top-k keys of one head's ReLU(scale q.k) scores per query block (block max), -1 padded");
}
