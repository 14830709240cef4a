// Decode attention on the CPU (the `cpu_decode` backend of magnetar.ops.backends): a few query rows per KV head
// -- a decode step's query heads over a cached context, every key visible -- in one pass over K and V.
//
// Built by magnetar.ops.op_builder.DecodeAttentionBuilder (DeepSpeed OpBuilder, JIT). The reference is the
// fp64 attention of tests/reference.py; torch's own CPU flash kernel (the `cpu_flash` backend) computes the same.
//
//   decode_attention(q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, D), scale)
//       -> (out (B, Hq, Sq, D) in q's dtype, lse (B, Hq, Sq) float32)
//
//   float32 or bfloat16 (all three alike), every key visible to every query (no mask), query head h reads KV head
//   h / (Hq / Hkv); G x Sq <= 8 query rows per KV head (G = Hq / Hkv), D a multiple of 8 up to 256, K and V
//   contiguous along D (any other strides). Scores and the softmax in float32; a bf16 key or value is widened to
//   float32 as it is read. A NaN or +inf score makes its row (NaN, NaN); nothing here turns NaN into a finite number.
//   supported() says whether this CPU runs it (x86-64 with AVX2 and FMA); elsewhere the backend refuses.
//
//   decode_attention_checked(q, k, v, scale) -> (out, lse, clean): the same, and whether every score and every
//   output element was finite. Every key is visible to every query here, so a non-finite element of q or k makes
//   a score non-finite (inf * x is +-inf or NaN, and a sum with one stays non-finite): clean means q, k and out
//   are finite -- the front end's fast-path condition (magnetar.ops.nonfinite), read without a pass over them.
//
//   slot_attention(q (B, Hq, S, D), k (B, Hkv, C, D), v (B, Hkv, C, D), q_pos (B, S), k_pos (B, C), scale, window)
//       -> (out, lse): the static / graph decode step's call over slot buffers (magnetar.ops.slots' contract): key j
//   is visible to query row t iff k_pos[j] <= q_pos[t] (and k_pos[j] > q_pos[t] - window when window > 0); a key no
//   row sees is not read at all (an empty entry at FAR, or another request's old entry); a row that sees no key is
//   (0, -inf); a NaN in q or in a key or value the row sees makes the row NaN. int64 positions, any strides.
//
//   decode_attention_pages(q (B, Hq, Sq, D), ks, vs, first (B + 1 offsets), kv_heads, scale) -> (out, lse, clean):
//   the eager decode step's batch in one launch -- request b's rows over its KV pages ks[first[b]:first[b + 1]] /
//   vs[...] (each (1, kv_heads, n >= 1, D): its cached context, its own tokens), every key of them visible, one
//   online softmax over all of its pages (the output rounded once; merging per-page states would round each). A
//   request without pages gets (0, -inf) rows. clean as decode_attention_checked's (an empty row counts as clean).
//
//   Where the CPU has AVX-512 BF16 (avx512_bf16(); set_avx512_bf16(false) or MAGNETAR_DECODE_AVX512=0 switch it
//   off), bf16 calls with D a multiple of 32 take a second pass, every entry point alike: scores by VDPBF16PS of the
//   unscaled bf16 query against the bf16 keys, 16 keys' sums reduced in one vector (attend_bf16_512). Its products are
//   exact as the AVX2 pass's are; denormal bf16 inputs count as 0 there (the instruction's rule).
//
// Why: torch's CPU flash kernel spends a decode call on per-block packing and scalar work, not on reading the
// cache: a 4K-token call of SmolLM2-135M (3 query rows per KV head, D 64) took ~0.7 ms in fp32 and ~0.8 ms in bf16
// with the KV cold, where reading it takes ~0.35 / ~0.2 ms on one core of the AVX-512 EPYC VM. Here one work item
// is one (batch, KV head): each key row is read once for the G x Sq query rows sharing it (their dot products in
// registers), the scores of a block of keys go through one exp pass with the running max (online softmax), and
// each value row is read once into the rows' accumulators. Parallelised with at::parallel_for over the work items.
// Two keys' dot products at a time where every key is seen (twice the independent sums in flight), four rows'
// sums reduced together (hsum4), four value rows into each accumulator load and store, and the rows prefetched a
// phase ahead (a block's values during its scores, the next block's keys during its values): on the Intel
// AVX-512/AMX VM a cold 4K call of those shapes went 740-813 -> ~475 us in bf16 (docs/results.md, "The Intel
// AVX-512 / AMX VM beside vLLM, and the decode kernel").

#include "torch_op.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "vec512.h"

#ifdef MAGNETAR_X86_DISPATCH
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 128;  // keys per online-softmax block (their scores stay in L1)
constexpr int64_t kMaxRows = 8;  // query rows per KV head
constexpr int64_t kMaxDim = 256;

bool cpu_supported() {
#ifdef MAGNETAR_X86_DISPATCH
  return cpu_has_avx2_fma();
#else
  return false;
#endif
}

#ifdef MAGNETAR_X86_DISPATCH
#define AVX2_FN inline __attribute__((target("avx2,fma"), always_inline))

// exp(x) for x <= 0 (logits minus their running max; -inf -> 0): x log2(e) = n + f, |f| <= 1/2, 2^f by a
// degree-6 polynomial (relative error ~2e-7, float rounding), 2^n from the exponent bits; below -88 the result is
// 2^-127-ish, nothing as far as the softmax is concerned.
AVX2_FN __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <typename T>
AVX2_FN __m256 load8(const T* p);
template <>
AVX2_FN __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
AVX2_FN __m256 load8<at::BFloat16>(const at::BFloat16* p) {  // bf16 is float32's top half: widen by a shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2_FN float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

// The sums of four vectors' lanes: [sum(a0), sum(a1), sum(a2), sum(a3)] -- three horizontal adds for four rows'
// dot products, where a reduction each took as many for one.
AVX2_FN __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// Rows r < R of a[] (R <= 8) reduced into out[r]: four at a time.
template <int R>
AVX2_FN void hsum_rows(const __m256* a, float* out) {
  const __m256 z = _mm256_setzero_ps();
  alignas(16) float t[8];
  _mm_store_ps(t, hsum4(a[0], R > 1 ? a[1] : z, R > 2 ? a[2] : z, R > 3 ? a[3] : z));
  if (R > 4) _mm_store_ps(t + 4, hsum4(a[R > 4 ? 4 : 0], R > 5 ? a[5] : z, R > 6 ? a[6] : z, R > 7 ? a[7] : z));
  for (int r = 0; r < R; ++r) out[r] = t[r];
}

// Prefetch the row at p (D elements of T) into L1: the kernel's reads are two interleaved streams (a block's keys,
// then its values) that the hardware prefetchers follow late -- a cold 4K call read ~5 GB/s where one core copies 13.
// Locality 3 is _MM_HINT_T0 (into L1); the AVX-512 BF16 pass prefetches into L2 (kL2, _MM_HINT_T1): its scores take
// few enough instructions that prefetches into L1 filled the core's line-fill buffers and stalled it -- a cold 4K call
// ~400 -> ~340 us.
constexpr int64_t kAhead = 16;  // rows ahead
constexpr int kL1 = 3, kL2 = 2;
template <int Locality = kL1, typename T>
AVX2_FN void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, Locality);
}

// Which keys which rows see (the slot call; nullptr: every key, every row): key j's position kpos[j * kstride]
// against each row's query position rq[r], and the window (<= 0: none).
struct Visibility {
  const int64_t* kpos;
  int64_t kstride;
  const int64_t* rq;
  int64_t window;
};

// The state of R query rows before their first key: running max -inf, sums 0, no NaN, no key seen.
inline void start_rows(int64_t R, int64_t D, float* acc, float* m, float* l, bool* nan, bool* seen) {
  for (int64_t r = 0; r < R; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    nan[r] = false;
    seen[r] = false;
  }
  std::fill(acc, acc + R * D, 0.f);
}

// One (batch, KV head): R query rows qf (R x D, already scaled) over Sk keys and values of row strides ks / vs,
// continuing the rows' state (start_rows before the first call; a request's KV pages are attended one call each).
// Leaves each row's unnormalised sum in acc (R x D), its running max in m, its sum of exponentials in l, whether a
// score was NaN or +inf in nan and whether it saw a key in seen; clears *finite when a score was not finite (NaN
// or +-inf). s: R x kBlock scratch, live: kBlock flags. With a Visibility, a key no row sees is skipped (neither
// row read) and a key a row does not see scores -inf in that row.
template <typename T, int R, bool Masked>
__attribute__((target("avx2,fma"))) void attend(const float* qf, const T* kb, int64_t ks, const T* vb, int64_t vs,
                                                int64_t Sk, int64_t D, float* acc, float* m, float* l, bool* nan,
                                                bool* seen, bool* finite, float* s, char* live,
                                                const Visibility& vis) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (!Masked && Sk > 0) {
    for (int r = 0; r < R; ++r) seen[r] = true;
  }
  // two keys at a time where every key is seen (2R independent sums in flight; R <= 4: the registers hold them)
  constexpr bool kPairs = !Masked && R <= 4;
  for (int64_t j0 = 0; j0 < Sk; j0 += kBlock) {
    const int64_t n = std::min(kBlock, Sk - j0);
    int64_t j = 0;
    if (kPairs) {
      for (; j + 2 <= n; j += 2) {  // scores: each key row read once for the R rows
        const T* k0 = kb + (j0 + j) * ks;
        const T* k1 = k0 + ks;
        prefetch_row(k0 + kAhead * ks, D);  // this block's later keys, and its values (read after its scores)
        prefetch_row(k1 + kAhead * ks, D);
        prefetch_row(vb + (j0 + j) * vs, D);
        prefetch_row(vb + (j0 + j + 1) * vs, D);
        __m256 a[R], b[R];
        for (int r = 0; r < R; ++r) a[r] = b[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 x0 = load8<T>(k0 + d), x1 = load8<T>(k1 + d);
          for (int r = 0; r < R; ++r) {
            const __m256 q8 = _mm256_loadu_ps(qf + r * D + d);
            a[r] = _mm256_fmadd_ps(q8, x0, a[r]);
            b[r] = _mm256_fmadd_ps(q8, x1, b[r]);
          }
        }
        float t0[R], t1[R];
        hsum_rows<R>(a, t0);
        hsum_rows<R>(b, t1);
        for (int r = 0; r < R; ++r) {
          s[r * kBlock + j] = t0[r];
          s[r * kBlock + j + 1] = t1[r];
        }
      }
    }
    for (; j < n; ++j) {  // scores: each key row read once for the R rows
      bool sees[R];
      if (Masked) {
        const int64_t kp = vis.kpos[(j0 + j) * vis.kstride];
        bool any = false;
        for (int r = 0; r < R; ++r) {
          sees[r] = kp <= vis.rq[r] && (vis.window <= 0 || kp > vis.rq[r] - vis.window);
          any = any || sees[r];
        }
        live[j] = any;
        if (!any) {
          for (int r = 0; r < R; ++r) s[r * kBlock + j] = neg_inf;
          continue;
        }
      }
      const T* kj = kb + (j0 + j) * ks;
      __m256 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 k8 = load8<T>(kj + d);
        for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * D + d), k8, a[r]);
      }
      float t[R];
      hsum_rows<R>(a, t);
      for (int r = 0; r < R; ++r) {
        s[r * kBlock + j] = Masked && !sees[r] ? neg_inf : t[r];
        if (Masked) seen[r] = seen[r] || sees[r];
      }
    }
    for (int r = 0; r < R; ++r) {  // online softmax: the block's max, its exponentials, the rescaled sums
      float* sr = s + r * kBlock;
      float bm = neg_inf;
      bool bad = false, odd = false;
      for (int64_t j = 0; j < n; ++j) {
        bm = sr[j] > bm ? sr[j] : bm;
        bad |= sr[j] != sr[j] || sr[j] == -neg_inf;  // NaN, or +inf (inf - inf has no softmax): the row is NaN
        if (!Masked) odd |= sr[j] - sr[j] != 0.f;    // NaN or +-inf (a slot call's flag is not read: unseen
      }                                              // keys score -inf there)
      nan[r] = nan[r] || bad;
      *finite = *finite && !odd;
      const float nm = std::max(m[r], bm);
      const float corr = m[r] == nm ? 1.f : std::exp(m[r] - nm);
      const __m256 nm8 = _mm256_set1_ps(nm == neg_inf ? 0.f : nm);  // every score -inf so far: p = 0
      __m256 sum8 = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(sr + j);
        __m256 p = exp_nonpositive(_mm256_sub_ps(x, nm8));
        // a key the row does not see weighs exactly 0 (the polynomial's floor is ~1e-38, which times a NaN value
        // would still be NaN)
        if (Masked) p = _mm256_and_ps(p, _mm256_cmp_ps(x, _mm256_set1_ps(neg_inf), _CMP_GT_OQ));
        _mm256_storeu_ps(sr + j, p);
        sum8 = _mm256_add_ps(sum8, p);
      }
      float sum = hsum(sum8);
      for (; j < n; ++j) {
        sr[j] = nm == neg_inf ? 0.f : std::exp(sr[j] - nm);
        sum += sr[j];
      }
      l[r] = l[r] * corr + sum;
      m[r] = nm;
      if (corr != 1.f) {
        float* ar = acc + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
    }
    j = 0;
    for (; j + 4 <= n; j += 4) {  // values, four keys at a time: each accumulator loaded and stored once for them
      if (Masked && !(live[j] && live[j + 1] && live[j + 2] && live[j + 3])) {
        break;  // a key no row sees is not read: this block goes on key by key
      }
      const T* v0 = vb + (j0 + j) * vs;
      const T* v1 = v0 + vs;
      const T* v2 = v1 + vs;
      const T* v3 = v2 + vs;
      if (j0 + kBlock < Sk) {  // the next block's keys
        for (int i = 0; i < 4; ++i) prefetch_row(kb + (j0 + kBlock + j + i) * ks, D);
      }
      __m256 p[R][4];
      for (int r = 0; r < R; ++r) {
        for (int i = 0; i < 4; ++i) p[r][i] = _mm256_set1_ps(s[r * kBlock + j + i]);
      }
      for (int64_t d = 0; d < D; d += 8) {  // each value row read once for the R rows
        const __m256 x0 = load8<T>(v0 + d), x1 = load8<T>(v1 + d), x2 = load8<T>(v2 + d), x3 = load8<T>(v3 + d);
        for (int r = 0; r < R; ++r) {
          float* ar = acc + r * D + d;
          __m256 x = _mm256_loadu_ps(ar);
          x = _mm256_fmadd_ps(p[r][0], x0, x);
          x = _mm256_fmadd_ps(p[r][1], x1, x);
          x = _mm256_fmadd_ps(p[r][2], x2, x);
          x = _mm256_fmadd_ps(p[r][3], x3, x);
          _mm256_storeu_ps(ar, x);
        }
      }
    }
    for (; j < n; ++j) {  // values: each row read once into the R accumulators
      if (Masked && !live[j]) continue;  // no row sees it: its value is not read (a NaN there stays out)
      const T* vj = vb + (j0 + j) * vs;
      __m256 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_set1_ps(s[r * kBlock + j]);
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 v8 = load8<T>(vj + d);
        for (int r = 0; r < R; ++r) {
          float* ar = acc + r * D + d;
          _mm256_storeu_ps(ar, _mm256_fmadd_ps(p[r], v8, _mm256_loadu_ps(ar)));
        }
      }
    }
  }
}

// -- AVX-512 BF16: the same pass for bfloat16 (every entry point: calls, pages, slots) ----------------------------
// The scores of 16 keys for one row by VDPBF16PS -- the key's bf16 pairs times the query's, summed in float32: no
// widening of K, where the AVX2 pass spends as many instructions widening as multiplying (a bf16 call ran at ~9 GB/s
// warm where a float32 one ran at ~16) -- and their 16 lane sums reduced in one vector (sum16). The query is the
// unscaled bf16 row (its products exact), the scale applied to the sums. Values as the AVX2 pass, 16 lanes wide.
#define AVX512BF16_FN __attribute__((target("avx2,fma,avx512f,avx512bw,avx512bf16")))

constexpr int64_t kAhead512 = 32;  // keys ahead the scores prefetch (two groups)
// Key c of a group of 16 accumulates in vector kSlot[c], so that sum16 leaves its score in lane c.
constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// The sums of 16 vectors' lanes in one vector: lane L holds the sum of v[(L % 4) * 4 + L / 4] -- four rounds of
// shuffles and adds (45 instructions for 16 sums, where a reduction each takes ~8).
AVX512BF16_FN inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {  // [a0 + a2, a1 + a3, b0 + b2, b1 + b3] in 128-bit chunks
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // chunk k: four partial sums of vector 4 i + k
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  }
  // chunk k: two partial sums of vectors k and 4 + k (y0), of 8 + k and 12 + k (y1)
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x44), _mm512_shuffle_ps(x[0], x[1], 0xEE));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_ps(x[2], x[3], 0x44), _mm512_shuffle_ps(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x88), _mm512_shuffle_ps(y0, y1, 0xDD));
}

// As attend<bf16, R, Masked> for R rows of unscaled bf16 queries qb (R x D, D = 32 DC): the same state, the same
// flags; with a Visibility (Masked: the slot call), a key no row sees is neither read nor weighed, and a key a row
// does not see scores -inf in that row and weighs exactly 0.
template <int DC, bool Masked>
AVX512BF16_FN void attend_bf16_512(const at::BFloat16* qb, float scale, int64_t R, const at::BFloat16* kb, int64_t ks,
                                   const at::BFloat16* vb, int64_t vs, int64_t Sk, float* acc, float* m, float* l,
                                   bool* nan, bool* seen, bool* finite, float* s, char* live, const Visibility& vis) {
  constexpr int64_t D = 32 * DC;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float log2e = 1.44269504088896341f;
  if (!Masked && Sk > 0) {
    for (int64_t r = 0; r < R; ++r) seen[r] = true;
  }
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-kInf);
  using magnetar_vec512::exp2_nonpositive;
  using magnetar_vec512::load16;  // 16 bf16 widened to float32
  for (int64_t j0 = 0; j0 < Sk; j0 += kBlock) {
    const int64_t n = std::min(kBlock, Sk - j0);
    for (int64_t j = 0; j < n; j += 16) {  // scores, 16 keys at a time (the last group may hold fewer)
      const int64_t cnt = std::min<int64_t>(16, n - j);
      const at::BFloat16* k0 = kb + (j0 + j) * ks;
      for (int64_t c = 0; c < 16; ++c) {  // the next 16 keys, and these keys' values (read after the scores)
        if (j0 + j + kAhead512 + c < Sk) prefetch_row<kL2>(k0 + (kAhead512 + c) * ks, D);
        if (c < cnt) prefetch_row<kL2>(vb + (j0 + j + c) * vs, D);
      }
      __mmask16 sees[kMaxRows] = {}, any = cnt == 16 ? __mmask16(0xffff) : __mmask16((1u << cnt) - 1);
      if (Masked) {  // which rows see which of these keys; a key no row sees is not read
        any = 0;
        for (int64_t c = 0; c < cnt; ++c) {
          const int64_t kp = vis.kpos[(j0 + j + c) * vis.kstride];
          for (int64_t r = 0; r < R; ++r) {
            if (kp <= vis.rq[r] && (vis.window <= 0 || kp > vis.rq[r] - vis.window)) sees[r] |= __mmask16(1u << c);
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          any |= sees[r];
          seen[r] = seen[r] || sees[r] != 0;
        }
        for (int64_t c = 0; c < 16; ++c) live[j + c] = (any >> c) & 1;
      }
      for (int64_t r = 0; r < R; ++r) {
        __m512bh qv[DC];
        for (int i = 0; i < DC; ++i) qv[i] = (__m512bh)_mm512_loadu_si512(qb + r * D + 32 * i);
        __m512 a[16];
        for (int c = 0; c < 16; ++c) {
          __m512 t = _mm512_setzero_ps();
          if ((any >> c) & 1) {
            const at::BFloat16* kc = k0 + c * ks;
            for (int i = 0; i < DC; ++i) t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(kc + 32 * i), qv[i]);
          }
          a[kSlot[c]] = t;
        }
        // (a short last group's other lanes hold 0s inside the row's kBlock entries, never read)
        const __m512 x = _mm512_mul_ps(sum16(a), sc);
        _mm512_storeu_ps(s + r * kBlock + j, Masked ? _mm512_mask_blend_ps(sees[r], minus_inf, x) : x);
      }
    }
    for (int64_t r = 0; r < R; ++r) {  // online softmax: the block's max, its exponentials, the rescaled sums
      float* sr = s + r * kBlock;
      __m512 mx = minus_inf;
      __mmask16 bad = 0, odd = 0;
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(in, sr + j);
        mx = _mm512_mask_max_ps(mx, in, x, mx);  // a NaN score leaves the max as it was
        // NaN, or +inf (inf - inf has no softmax): the row is NaN; NaN or +-inf: not clean
        bad |= _mm512_mask_cmp_ps_mask(in, x, x, _CMP_UNORD_Q) | _mm512_mask_cmp_ps_mask(in, x, _mm512_set1_ps(kInf),
                                                                                          _CMP_EQ_OQ);
        // (a slot call's flag is not read: unseen keys score -inf there)
        if (!Masked) odd |= _mm512_mask_cmp_ps_mask(in, _mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ);
      }
      nan[r] = nan[r] || bad != 0;
      *finite = *finite && odd == 0;
      const float bm = _mm512_reduce_max_ps(mx);
      const float nm = std::max(m[r], bm);
      const float corr = m[r] == nm ? 1.f : std::exp(m[r] - nm);
      const __m512 nm2 = _mm512_set1_ps(nm == -kInf ? 0.f : nm * log2e);  // every score -inf so far: p = 0
      const __m512 l2e = _mm512_set1_ps(log2e);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(in, sr + j);
        // a key the row does not see weighs exactly 0 (times a NaN value it would still be NaN otherwise)
        const __mmask16 use = Masked ? in & _mm512_cmp_ps_mask(x, minus_inf, _CMP_GT_OQ) : in;
        const __m512 p = _mm512_maskz_mov_ps(use, exp2_nonpositive(_mm512_fmsub_ps(x, l2e, nm2)));
        _mm512_mask_storeu_ps(sr + j, in, p);
        sum = _mm512_add_ps(sum, p);
      }
      l[r] = l[r] * corr + _mm512_reduce_add_ps(sum);
      m[r] = nm;
      if (corr != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr);
        float* ar = acc + r * D;
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(ar + d, _mm512_mul_ps(cv, _mm512_loadu_ps(ar + d)));
      }
    }
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {  // values, four keys at a time: each accumulator loaded and stored once for them
      if (Masked && !(live[j] && live[j + 1] && live[j + 2] && live[j + 3])) {
        break;  // a key no row sees is not read: this block goes on key by key
      }
      const at::BFloat16* v0 = vb + (j0 + j) * vs;
      if (j0 + kBlock < Sk) {  // the next block's keys
        for (int i = 0; i < 4; ++i) prefetch_row(kb + (j0 + kBlock + j + i) * ks, D);
      }
      for (int64_t d = 0; d < D; d += 16) {  // each value row read once for the R rows
        const __m512 x0 = load16(v0 + d), x1 = load16(v0 + vs + d), x2 = load16(v0 + 2 * vs + d),
                     x3 = load16(v0 + 3 * vs + d);
        for (int64_t r = 0; r < R; ++r) {
          const float* p = s + r * kBlock + j;
          float* ar = acc + r * D + d;
          __m512 x = _mm512_loadu_ps(ar);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[0]), x0, x);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[1]), x1, x);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[2]), x2, x);
          x = _mm512_fmadd_ps(_mm512_set1_ps(p[3]), x3, x);
          _mm512_storeu_ps(ar, x);
        }
      }
    }
    for (; j < n; ++j) {  // the block's last values, one at a time
      if (Masked && !live[j]) continue;  // no row sees it: its value is not read (a NaN there stays out)
      const at::BFloat16* vj = vb + (j0 + j) * vs;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 x = load16(vj + d);
        for (int64_t r = 0; r < R; ++r) {
          float* ar = acc + r * D + d;
          _mm512_storeu_ps(ar, _mm512_fmadd_ps(_mm512_set1_ps(s[r * kBlock + j]), x, _mm512_loadu_ps(ar)));
        }
      }
    }
  }
}

using AttendBf16Fn = void (*)(const at::BFloat16*, float, int64_t, const at::BFloat16*, int64_t, const at::BFloat16*,
                              int64_t, int64_t, float*, float*, float*, bool*, bool*, bool*, float*, char*,
                              const Visibility&);

// The AVX-512 BF16 pass for head dimension D, or nullptr: not a multiple of 32, or this CPU / build lacks it, or
// switched off (set_avx512_bf16, or MAGNETAR_DECODE_AVX512=0 in the environment when the op loads).
std::atomic<bool> g_avx512{[] {
  const char* env = std::getenv("MAGNETAR_DECODE_AVX512");
  return env == nullptr || std::strcmp(env, "0") != 0;
}()};
template <bool Masked>
AttendBf16Fn attend_bf16_for(int64_t D) {
  if (!g_avx512.load(std::memory_order_relaxed) || !cpu_has_avx512_bf16() || D % 32 != 0) return nullptr;
  switch (D / 32) {
    case 1: return attend_bf16_512<1, Masked>;
    case 2: return attend_bf16_512<2, Masked>;
    case 3: return attend_bf16_512<3, Masked>;
    case 4: return attend_bf16_512<4, Masked>;
    case 5: return attend_bf16_512<5, Masked>;
    case 6: return attend_bf16_512<6, Masked>;
    case 7: return attend_bf16_512<7, Masked>;
    case 8: return attend_bf16_512<8, Masked>;
    default: return nullptr;
  }
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, int64_t, const T*, int64_t, int64_t, int64_t, float*, float*,
                          float*, bool*, bool*, bool*, float*, char*, const Visibility&);

template <typename T, bool Masked>
AttendFn<T> attend_for(int64_t rows) {
  switch (rows) {
    case 1: return attend<T, 1, Masked>;
    case 2: return attend<T, 2, Masked>;
    case 3: return attend<T, 3, Masked>;
    case 4: return attend<T, 4, Masked>;
    case 5: return attend<T, 5, Masked>;
    case 6: return attend<T, 6, Masked>;
    case 7: return attend<T, 7, Masked>;
    default: return attend<T, 8, Masked>;
  }
}

// One work item's rows, widened to float32 and scaled: the G query heads of KV head hk (each Sq tokens) of
// request b, row g * Sq + t -- or, for the AVX-512 BF16 pass (qb not null), as they are.
template <typename T>
void load_rows(const at::Tensor& q, int64_t b, int64_t hk, int64_t G, double scale, float* qf, T* qb = nullptr) {
  const int64_t Sq = q.size(2), D = q.size(3);
  const T* qp = q.data_ptr<T>();
  const auto qs = q.strides();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < Sq; ++t) {
      const T* src = qp + b * qs[0] + (hk * G + g) * qs[1] + t * qs[2];
      if (qb != nullptr) {
        for (int64_t d = 0; d < D; ++d) qb[(g * Sq + t) * D + d] = src[d * qs[3]];
        continue;
      }
      float* dst = qf + (g * Sq + t) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d * qs[3]]) * static_cast<float>(scale);
    }
  }
}

// Writes one work item's rows (their state after attend) to out / lse: a NaN row is (NaN, NaN), a row that saw no
// key (0, -inf), else acc / l and m + log(l). Returns whether every element written was finite.
template <typename T>
bool write_rows(at::Tensor& out, at::Tensor& lse, int64_t b, int64_t hk, int64_t G, const float* acc,
                const float* m, const float* l, const bool* nan, const bool* seen) {
  const int64_t Sq = out.size(2), D = out.size(3);
  T* op = out.data_ptr<T>();
  float* lp = lse.data_ptr<float>();
  const auto os = out.strides(), ls = lse.strides();
  const float nan_f = std::numeric_limits<float>::quiet_NaN();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  bool finite = true;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < Sq; ++t) {
      const int64_t r = g * Sq + t, h = hk * G + g;
      T* dst = op + b * os[0] + h * os[1] + t * os[2];
      const bool empty = !seen[r] && !nan[r];  // a row that sees no key: (0, -inf)
      const float inv = empty ? 0.f : 1.f / l[r];
      float odd = 0.f;  // stays 0 while every element written is finite (x - x is NaN for inf and NaN)
      for (int64_t d = 0; d < D; ++d) {
        const T y = static_cast<T>(nan[r] ? nan_f : acc[r * D + d] * inv);
        dst[d * os[3]] = y;
        odd += static_cast<float>(y) - static_cast<float>(y);
      }
      const float lse_r = nan[r] ? nan_f : empty ? neg_inf : m[r] + std::log(l[r]);
      lp[b * ls[0] + h * ls[1] + t * ls[2]] = lse_r;
      finite = finite && odd == 0.f && (empty || lse_r - lse_r == 0.f);  // an empty row's -inf is its rule
    }
  }
  return finite;
}

// A work item's buffers (one per thread of at::parallel_for).
struct Rows {
  std::vector<float> qf, acc, s, m, l;
  std::vector<at::BFloat16> qb;  // the rows unscaled, for the AVX-512 BF16 pass
  std::vector<int64_t> rq;
  std::vector<char> live;
  std::unique_ptr<bool[]> nan, seen;
  Rows(int64_t R, int64_t D)
      : qf(R * D), acc(R * D), s(R * kBlock), m(R), l(R), qb(R * D), rq(R), live(kBlock), nan(new bool[R]),
        seen(new bool[R]) {}
};

// The pass over one run of keys of a work item (its rows' state in w): the AVX-512 BF16 pass where `fast` is one
// (attend_bf16_for: bf16, D a multiple of 32), else the AVX2 pass fn.
template <typename T>
void attend_run(AttendFn<T> fn, AttendBf16Fn fast, Rows& w, int64_t R, double scale, const T* k, int64_t ks,
                const T* v, int64_t vs, int64_t Sk, int64_t D, bool* finite, const Visibility& vis) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (fast != nullptr) {
      fast(w.qb.data(), static_cast<float>(scale), R, k, ks, v, vs, Sk, w.acc.data(), w.m.data(), w.l.data(),
           w.nan.get(), w.seen.get(), finite, w.s.data(), w.live.data(), vis);
      return;
    }
  }
  fn(w.qf.data(), k, ks, v, vs, Sk, D, w.acc.data(), w.m.data(), w.l.data(), w.nan.get(), w.seen.get(), finite,
     w.s.data(), w.live.data(), vis);
}

// The AVX-512 BF16 pass for these calls (masked: a slot call's), or nullptr (float32, or attend_bf16_for's reasons).
template <typename T>
AttendBf16Fn fast_pass(bool masked, int64_t D) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return masked ? attend_bf16_for<true>(D) : attend_bf16_for<false>(D);
  }
  return nullptr;
}

// Returns whether every score and output element was finite (decode_attention_checked's clean). q_pos / k_pos
// (int64, (B, Sq) / (B, Sk)) undefined: every key visible to every row; else the slot call's visibility.
template <typename T>
bool run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         double scale, const at::Tensor& q_pos = at::Tensor(), const at::Tensor& k_pos = at::Tensor(),
         int64_t window = 0) {
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Sk = k.size(2), G = Hq / Hkv, R = G * Sq;
  const bool masked = k_pos.defined();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int64_t* qpos = masked ? q_pos.data_ptr<int64_t>() : nullptr;
  const int64_t* kpos = masked ? k_pos.data_ptr<int64_t>() : nullptr;
  const auto ks = k.strides(), vs = v.strides();
  const AttendFn<T> fn = masked ? attend_for<T, true>(R) : attend_for<T, false>(R);
  const AttendBf16Fn fast = fast_pass<T>(masked, D);
  std::vector<char> clean(B * Hkv, 1);  // per work item (each written by one thread)
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Rows w(R, D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, hk = item % Hkv;
      load_rows<T>(q, b, hk, G, scale, w.qf.data(), fast != nullptr ? reinterpret_cast<T*>(w.qb.data()) : nullptr);
      if (masked) {
        for (int64_t r = 0; r < R; ++r) w.rq[r] = qpos[b * q_pos.stride(0) + (r % Sq) * q_pos.stride(1)];
      }
      const Visibility vis{masked ? kpos + b * k_pos.stride(0) : nullptr, masked ? k_pos.stride(1) : 0, w.rq.data(),
                           window};
      bool finite = true;
      start_rows(R, D, w.acc.data(), w.m.data(), w.l.data(), w.nan.get(), w.seen.get());
      attend_run<T>(fn, fast, w, R, scale, kp + b * ks[0] + hk * ks[1], ks[2], vp + b * vs[0] + hk * vs[1], vs[2], Sk,
                    D, &finite, vis);
      clean[item] = write_rows<T>(out, lse, b, hk, G, w.acc.data(), w.m.data(), w.l.data(), w.nan.get(),
                                  w.seen.get()) && finite;
    }
  });
  return std::all_of(clean.begin(), clean.end(), [](char c) { return c != 0; });
}

// decode_attention_pages: request b's rows over its pages ks[first[b]:first[b + 1]] (each (1, Hkv, n_i, D)), every
// key of them visible -- one online softmax over all of a request's pages, so its output is rounded once.
template <typename T>
bool run_pages(const at::Tensor& q, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
               const std::vector<int64_t>& first, int64_t Hkv, at::Tensor& out, at::Tensor& lse, double scale) {
  const int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), D = q.size(3), G = Hq / Hkv, R = G * Sq;
  const AttendFn<T> fn = attend_for<T, false>(R);
  const AttendBf16Fn fast = fast_pass<T>(false, D);
  const Visibility every{nullptr, 0, nullptr, 0};
  std::vector<char> clean(B * Hkv, 1);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    Rows w(R, D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, hk = item % Hkv;
      load_rows<T>(q, b, hk, G, scale, w.qf.data(), fast != nullptr ? reinterpret_cast<T*>(w.qb.data()) : nullptr);
      bool finite = true;
      start_rows(R, D, w.acc.data(), w.m.data(), w.l.data(), w.nan.get(), w.seen.get());
      for (int64_t i = first[b]; i < first[b + 1]; ++i) {
        const at::Tensor& k = ks[i];
        const at::Tensor& v = vs[i];
        attend_run<T>(fn, fast, w, R, scale, k.data_ptr<T>() + hk * k.stride(1), k.stride(2),
                      v.data_ptr<T>() + hk * v.stride(1), v.stride(2), k.size(2), D, &finite, every);
      }
      clean[item] = write_rows<T>(out, lse, b, hk, G, w.acc.data(), w.m.data(), w.l.data(), w.nan.get(),
                                  w.seen.get()) && finite;
    }
  });
  return std::all_of(clean.begin(), clean.end(), [](char c) { return c != 0; });
}
#endif  // MAGNETAR_X86_DISPATCH

}  // namespace

bool supported() { return cpu_supported(); }

// Whether bf16 calls where every key is seen take the AVX-512 BF16 pass here (this CPU has it and it is not switched
// off); set_avx512_bf16(false) sends them to the AVX2 pass (the tests check both on one machine). Returns the previous
// setting.
bool avx512_bf16() {
#ifdef MAGNETAR_X86_DISPATCH
  return g_avx512.load() && cpu_has_avx512_bf16();
#else
  return false;
#endif
}

bool set_avx512_bf16(bool on) {
#ifdef MAGNETAR_X86_DISPATCH
  return g_avx512.exchange(on);
#else
  (void)on;
  return false;
#endif
}

namespace {

// What every entry point checks of q (name: the function, in each message) for Hkv KV heads.
void check_q(const char* name, const at::Tensor& q, int64_t Hkv) {
  TORCH_CHECK(cpu_supported(), name, ": this CPU lacks AVX2/FMA (use the cpu_flash / torch backend)");
  TORCH_CHECK(q.device().is_cpu(), name, ": CPU tensors");
  TORCH_CHECK(q.dim() == 4, name, ": q must be 4-D (B, Hq, Sq, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, name,
              ": q, k, v all float32 or all bfloat16");
  const int64_t Hq = q.size(1), Sq = q.size(2), D = q.size(3);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, name, ": Hq must be a multiple of Hkv");
  TORCH_CHECK(Sq > 0, name, ": at least one query");
  TORCH_CHECK((Hq / Hkv) * Sq <= kMaxRows, name, ": at most 8 query rows per KV head");
  TORCH_CHECK(D % 8 == 0 && D <= kMaxDim, name, ": D a multiple of 8, at most 256");
}

// What every entry point checks of a k, v pair against q (already check_q'd): batch B, q's dtype and D, at least
// one key, contiguous along D.
void check_kv(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t B) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu(), name, ": CPU tensors");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4, name, ": k, v must be 4-D");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), name,
              ": q, k, v all float32 or all bfloat16");
  const int64_t D = q.size(3), Hkv = k.size(1), Sk = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Sk && k.size(3) == D &&
                  v.size(3) == D, name, ": k and v must be (B, Hkv, Sk, D) alike, q (B, Hq, Sq, D)");
  TORCH_CHECK(Sk > 0, name, ": at least one key");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, name, ": k and v contiguous along D");
}

// The checks of a call over one (k, v).
void check_qkv(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 4, name, ": k must be 4-D (B, Hkv, Sk, D)");
  check_q(name, q, k.size(1));
  check_kv(name, q, k, v, q.size(0));
}

// The results every entry point fills: out (q's shape and dtype, contiguous) and lse (B, Hq, Sq) float32.
std::tuple<at::Tensor, at::Tensor> outputs(const at::Tensor& q) {
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat))};
}

// (out, lse, clean) of the kernel; q_pos / k_pos undefined: every key visible.
std::tuple<at::Tensor, at::Tensor, bool> launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double scale, const at::Tensor& q_pos = at::Tensor(),
                                                const at::Tensor& k_pos = at::Tensor(), int64_t window = 0) {
  auto [out, lse] = outputs(q);
  bool clean = false;
#ifdef MAGNETAR_X86_DISPATCH
  if (q.scalar_type() == at::kFloat) {
    clean = run<float>(q, k, v, out, lse, scale, q_pos, k_pos, window);
  } else {
    clean = run<at::BFloat16>(q, k, v, out, lse, scale, q_pos, k_pos, window);
  }
#endif
  return {out, lse, clean};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, bool> decode_attention_checked(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& v, double scale) {
  check_qkv("decode_attention", q, k, v);
  return launch(q, k, v, scale);
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale) {
  auto checked = decode_attention_checked(q, k, v, scale);
  return {std::get<0>(checked), std::get<1>(checked)};
}

std::tuple<at::Tensor, at::Tensor> slot_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& q_pos, const at::Tensor& k_pos, double scale,
                                                  int64_t window) {
  check_qkv("slot_attention", q, k, v);
  TORCH_CHECK(q_pos.device().is_cpu() && k_pos.device().is_cpu() && q_pos.scalar_type() == at::kLong &&
                  k_pos.scalar_type() == at::kLong && q_pos.dim() == 2 && k_pos.dim() == 2 &&
                  q_pos.size(0) == q.size(0) && q_pos.size(1) == q.size(2) && k_pos.size(0) == q.size(0) &&
                  k_pos.size(1) == k.size(2),
              "slot_attention: int64 CPU q_pos (B, S) and k_pos (B, C)");
  auto res = launch(q, k, v, scale, q_pos, k_pos, window);
  return {std::get<0>(res), std::get<1>(res)};
}

std::tuple<at::Tensor, at::Tensor, bool> decode_attention_pages(const at::Tensor& q, const std::vector<at::Tensor>& ks,
                                                                const std::vector<at::Tensor>& vs,
                                                                const std::vector<int64_t>& first, int64_t kv_heads,
                                                                double scale) {
  const char* name = "decode_attention_pages";
  check_q(name, q, kv_heads);
  TORCH_CHECK(q.size(0) > 0, name, ": at least one request");
  TORCH_CHECK(ks.size() == vs.size(), name, ": as many value pages as key pages");
  TORCH_CHECK(first.size() == static_cast<size_t>(q.size(0)) + 1 && first.front() == 0 &&
                  first.back() == static_cast<int64_t>(ks.size()),
              name, ": first must hold B + 1 offsets into the pages, from 0 to their count");
  for (size_t b = 0; b + 1 < first.size(); ++b) TORCH_CHECK(first[b] <= first[b + 1], name, ": first not sorted");
  for (size_t i = 0; i < ks.size(); ++i) {
    TORCH_CHECK(ks[i].dim() == 4 && ks[i].size(1) == kv_heads, name, ": every page (1, kv_heads, n, D)");
    check_kv(name, q, ks[i], vs[i], 1);
  }
  auto [out, lse] = outputs(q);
  bool clean = false;
#ifdef MAGNETAR_X86_DISPATCH
  clean = q.scalar_type() == at::kFloat ? run_pages<float>(q, ks, vs, first, kv_heads, out, lse, scale)
                                        : run_pages<at::BFloat16>(q, ks, vs, first, kv_heads, out, lse, scale);
#endif
  return {out, lse, clean};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "attention of a few query rows per KV head over every key (decode), one pass over K and V: (out, lse)");
  m.def("decode_attention_checked", &decode_attention_checked,
        "decode_attention and whether every score and output element was finite: (out, lse, clean)");
  m.def("slot_attention", &slot_attention,
        "a decode step over slot buffers: key j visible to query t iff k_pos[j] <= q_pos[t] (and within window "
        "> 0); keys no row sees are not read: (out, lse)");
  m.def("decode_attention_pages", &decode_attention_pages,
        "each request's query rows over its KV pages (ks[first[b]:first[b + 1]], each (1, kv_heads, n, D)), every key "
        "visible, one softmax over all of them: (out, lse, clean)");
  m.def("supported", &supported, "whether this CPU runs decode_attention (x86-64 with AVX2 and FMA)");
  m.def("avx512_bf16", &avx512_bf16,
        "whether bf16 calls where every key is seen take the AVX-512 BF16 pass here (the CPU has it, not switched "
        "off)");
  m.def("set_avx512_bf16", &set_avx512_bf16,
        "switch the AVX-512 BF16 pass on or off (off: the AVX2 pass for every call); returns the previous setting");
}
