// Prefill attention in bfloat16 on Intel AMX: flash-style (online softmax over key blocks), returning the
// log-sum-exp, for the query forward's two calls -- a query's rows over its own keys (causal, bottom-right) and over a
// cached prefix (every key visible).
//
// Built by magnetar.ops.op_builder.AmxAttentionBuilder (DeepSpeed OpBuilder, JIT); the `cpu_amx` attention backend
// (magnetar/ops/backends/cpu_amx.py). The reference is the fp64 attention of tests/reference.py:
//
//   attention(q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, D); bfloat16, the last dimension contiguous, any
//             other strides; Hq a multiple of Hkv (query head h reads KV head h / (Hq / Hkv)); D a multiple of 32, at
//             most 256; Sk >= 1; scale; causal)
//       -> out (B, Hq, Sq, D) bfloat16, lse (B, Hq, Sq) float32
//       causal: query row i sees keys j <= i + Sk - Sq (the last Sq positions of the keys); else every key.
//       A row that sees no key: out 0, lse -inf. Scores, their exponentials and the sums in float32; the weights
//       rounded to bfloat16 for their product with v (as torch's CPU flash kernel does).
//   attention_emulated(...) the same code with each tile instruction done by a scalar loop: runs on any AVX-512 CPU
//       (the tests check the kernel's packing, masking and softmax on machines without AMX).
//   supported() whether attention runs here: x86-64 with AVX-512 F + BW, AMX-TILE and AMX-BF16, and Linux granted
//       this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
//
// Why: torch's CPU flash kernel ran SmolLM2's 1000-token causal square (9 query heads over 3, D 64) at ~0.3 TFLOP/s
// on two cores of the Intel AMX VM, a quarter of a query's forward, where oneDNN's bf16 products run at ~1.7 (docs/
// results.md, "An AMX attention kernel"); vLLM's CPU build has its own AMX kernel. Here a block of 32 query rows
// makes its scores with AMX tiles (TDPBF16PS) against keys packed once per call in the tiles' pair layout, 32 keys a
// tile pass and up to 128 a softmax step; the exponentials are AVX-512 (2^x by a polynomial and VSCALEFPS) and the
// running output is scaled in memory, then read into the tiles that add the block's weights times v. Causal blocks
// stop at their last visible key. Blocks (b, KV head, 32 rows of its query heads' rows) are split over
// at::parallel_for.

#include "torch_op.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_features.h"
#include "vec512.h"

#if defined(MAGNETAR_X86_DISPATCH) && defined(__linux__)
#define MAGNETAR_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kRows = 32;     // query rows a block: two tiles of 16
constexpr int64_t kKeys = 128;    // keys a softmax step (a multiple of 32: one tile pass takes 32)
constexpr int kMaxDim = 256;
constexpr size_t kKeepPacked = size_t(64) << 20;  // bytes of packed K / V a thread keeps for its next call

#ifdef MAGNETAR_AMX

#define MAGNETAR_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

bool amx_granted() {
  static const bool granted = [] {
    __builtin_cpu_init();
    if (!cpu_has_avx512()) return false;
    // AMX-TILE and AMX-BF16: CPUID leaf 7, EDX bits 24 and 22 (__builtin_cpu_supports knows them from GCC 13 on)
    unsigned eax = 7, ebx = 0, ecx = 0, edx = 0;
    __asm__ volatile("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
    if (!((edx >> 24) & 1) || !((edx >> 22) & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The AMX tiles: eight of 16 rows x 64 bytes (palette 1), loaded once a thread's chunk.
struct AmxTiles {
  static constexpr bool kNativeBf16 = true;  // every AMX-BF16 CPU has AVX-512 BF16
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  MAGNETAR_AMX_TARGET AmxTiles() {
    Config c;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the 64: without this barrier the stores above
    // may be dropped as dead, and the first tile instruction faults (an invalid instruction: no tiles configured)
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
  }
  MAGNETAR_AMX_TARGET ~AmxTiles() { _tile_release(); }
  // The instructions name their tiles in the opcode (the intrinsics paste the number into the assembly), so each
  // tile number is spelled out.
  template <int T>
  MAGNETAR_AMX_TARGET void load(const void* p, int64_t stride) {
    static_assert(T >= 0 && T < 8, "tile 0-7");
    if constexpr (T == 0) _tile_loadd(0, p, stride);
    if constexpr (T == 1) _tile_loadd(1, p, stride);
    if constexpr (T == 2) _tile_loadd(2, p, stride);
    if constexpr (T == 3) _tile_loadd(3, p, stride);
    if constexpr (T == 4) _tile_loadd(4, p, stride);
    if constexpr (T == 5) _tile_loadd(5, p, stride);
    if constexpr (T == 6) _tile_loadd(6, p, stride);
    if constexpr (T == 7) _tile_loadd(7, p, stride);
  }
  template <int T>
  MAGNETAR_AMX_TARGET void store(void* p, int64_t stride) {
    static_assert(T >= 0 && T < 4, "accumulator tile 0-3");
    if constexpr (T == 0) _tile_stored(0, p, stride);
    if constexpr (T == 1) _tile_stored(1, p, stride);
    if constexpr (T == 2) _tile_stored(2, p, stride);
    if constexpr (T == 3) _tile_stored(3, p, stride);
  }
  template <int T>
  MAGNETAR_AMX_TARGET void zero() {
    static_assert(T >= 0 && T < 4, "accumulator tile 0-3");
    if constexpr (T == 0) _tile_zero(0);
    if constexpr (T == 1) _tile_zero(1);
    if constexpr (T == 2) _tile_zero(2);
    if constexpr (T == 3) _tile_zero(3);
  }
  // C += A B for the four products of a 2 x 2 block: C = 2 a + b' (a: A's row tile 4 / 5, b': B's tile 6 / 7)
  template <int C, int A, int B>
  MAGNETAR_AMX_TARGET void dp() {
    static_assert(C == 2 * (A - 4) + (B - 6) && (A == 4 || A == 5) && (B == 6 || B == 7), "the 2 x 2 block's tiles");
    if constexpr (C == 0) _tile_dpbf16ps(0, 4, 6);
    if constexpr (C == 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (C == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (C == 3) _tile_dpbf16ps(3, 5, 7);
  }
};

#else
#ifdef MAGNETAR_X86_DISPATCH  // x86-64 off Linux: the emulated tiles' AVX-512 code still builds
#define MAGNETAR_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#else
#define MAGNETAR_AMX_TARGET
#endif
bool amx_granted() { return false; }
#endif

// The same tiles as plain memory and loops: C (16 x 16 float32) += A (16 x 32 bfloat16) B (16 pairs x 16 x 2).
struct EmulatedTiles {
  static constexpr bool kNativeBf16 = false;
  alignas(64) uint8_t t[8][1024];
  template <int T>
  void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(t[T] + 64 * r, static_cast<const uint8_t*>(p) + r * stride, 64);
  }
  template <int T>
  void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, t[T] + 64 * r, 64);
  }
  template <int T>
  void zero() { std::memset(t[T], 0, 1024); }
  template <int C, int A, int B>
  void dp() {
    float* c = reinterpret_cast<float*>(t[C]);
    const auto* a = reinterpret_cast<const at::BFloat16*>(t[A]);
    const auto* b = reinterpret_cast<const at::BFloat16*>(t[B]);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float s = c[16 * m + n];
        for (int k = 0; k < 16; ++k)
          s += static_cast<float>(a[32 * m + 2 * k]) * static_cast<float>(b[32 * k + 2 * n]) +
               static_cast<float>(a[32 * m + 2 * k + 1]) * static_cast<float>(b[32 * k + 2 * n + 1]);
        c[16 * m + n] = s;
      }
  }
};

// K of one (b, KV head) in the B-operand layout of S = Q K^T: tile (key block kb of 16, dim chunk dc of 32) holds at
// row r, lane 2 n + t: k[16 kb + n, 32 dc + 2 r + t] (zeros past Sk) -- a 16 x 16 transpose of (dim pair) 32-bit units.
void pack_k(const at::BFloat16* k, int64_t stride, int64_t Sk, int64_t Skp, int64_t D, at::BFloat16* out) {
  const int64_t chunks = D / 32;
  for (int64_t kb = 0; kb < Skp / 16; ++kb)
    for (int64_t dc = 0; dc < chunks; ++dc) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(out + (kb * chunks + dc) * 512);
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t key = 16 * kb + n;
        if (key >= Sk) {
          for (int64_t r = 0; r < 16; ++r) tile[16 * r + n] = 0;
          continue;
        }
        uint32_t pairs[16];
        std::memcpy(pairs, k + key * stride + 32 * dc, 64);
        for (int64_t r = 0; r < 16; ++r) tile[16 * r + n] = pairs[r];
      }
    }
}

#ifdef MAGNETAR_X86_DISPATCH
// V of one (b, KV head) in the B-operand layout of O = P V: tile (key block kb of 32, dim block c of 16) holds at
// row r, lane 2 n + t: v[32 kb + 2 r + t, 16 c + n] (zeros past Sk) -- two key rows interleaved element by element.
MAGNETAR_AVX512 void pack_v(const at::BFloat16* v, int64_t stride, int64_t Sk, int64_t Skp, int64_t D,
                            at::BFloat16* out) {
  const int64_t cols = D / 16;
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t kb = 0; kb < Skp / 32; ++kb)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t key = 32 * kb + 2 * r;
      const at::BFloat16* even = v + key * stride;
      const at::BFloat16* odd = even + stride;
      for (int64_t c = 0; c < cols; ++c) {
        const __m256i a = key < Sk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + 16 * c))
                                   : _mm256_setzero_si256();
        const __m256i b = key + 1 < Sk ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + 16 * c))
                                       : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        _mm512_storeu_si512(out + (kb * cols + c) * 512 + 32 * r, _mm512_permutexvar_epi16(interleave, both));
      }
    }
}
#endif

#ifdef MAGNETAR_X86_DISPATCH
using namespace magnetar_vec512;

// 16 float32 lanes to bfloat16, rounded to nearest even: one VCVTNEPS2BF16 where the CPU has AVX-512 BF16 (every AMX
// CPU), else vec512's integer rounding (the emulated tiles' path on other AVX-512 CPUs).
template <bool NativeBf16>
MAGNETAR_AVX512 inline void store_weights(at::BFloat16* p, __m512 v);
template <>
MAGNETAR_AVX512 inline void store_weights<false>(at::BFloat16* p, __m512 v) { store16(p, v); }
template <>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void store_weights<true>(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// The lanes of keys 16 c ... 16 c + 15 (from a step's first) that a row seeing keys up to `seen` (from the same first)
// sees.
MAGNETAR_AVX512 inline __mmask16 visible(bool open, int64_t seen, int64_t c) {
  if (open) return 0xffff;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  seen = std::max<int64_t>(-1, std::min<int64_t>(seen, kKeys));
  return _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(int(16 * c))),
                                 _mm512_set1_epi32(int(seen)));
}

// One softmax step of a block's rows over n keys (a multiple of 32, at most kKeys) from key `first`: scores s (kRows x
// kKeys float32, unscaled) -> weights p (kRows x kKeys bfloat16); each row's running max m (base 2), sum l and output o
// (kRows x D float32) updated. Row i sees keys j <= last[i] (-1: none); `open` says every row sees all n keys (no
// mask).
// Three passes, each over independent rows (no chain of reductions from one row to the next): the rows' maxima; the
// 32 new maxima and their factors as two vectors; the weights and their sums. A weight the mask hides is exactly 0.
template <bool NativeBf16>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void softmax_step(
    const float* s, at::BFloat16* p, float* m, float* l, float* o, const int64_t* last, int64_t first, int64_t n,
    int64_t D, float scale2, bool open) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const __m512 minus_inf = _mm512_set1_ps(-kInf);
  const __m512 sc = _mm512_set1_ps(scale2);
  const int64_t vectors = n / 16;
  alignas(64) float block_max[kRows], sums[kRows], alpha[kRows], use[kRows];
  for (int64_t i = 0; i < kRows; ++i) {
    const float* si = s + i * kKeys;
    __m512 mx = minus_inf;
    for (int64_t c = 0; c < vectors; ++c)
      mx = _mm512_mask_max_ps(mx, visible(open, last[i] - first, c), mx,
                               _mm512_mul_ps(_mm512_loadu_ps(si + 16 * c), sc));
    block_max[i] = _mm512_reduce_max_ps(mx);
  }
  for (int64_t i = 0; i < kRows; i += 16) {
    const __m512 old = _mm512_loadu_ps(m + i);
    const __m512 now = _mm512_max_ps(old, _mm512_load_ps(block_max + i));
    // a row that has seen nothing yet subtracts 0 (its weights 2^-inf = 0), not -inf
    const __m512 u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(now, minus_inf, _CMP_EQ_OQ), now, _mm512_setzero_ps());
    _mm512_store_ps(use + i, u);
    _mm512_store_ps(alpha + i, exp2_nonpositive(_mm512_sub_ps(old, u)));  // old -inf: 0 (its o and l are 0)
    _mm512_storeu_ps(m + i, now);
  }
  for (int64_t i = 0; i < kRows; ++i) {
    const float* si = s + i * kKeys;
    at::BFloat16* pi = p + i * kKeys;
    const __m512 mv = _mm512_set1_ps(use[i]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < vectors; ++c) {
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * c), sc, mv);
      const __m512 e = _mm512_maskz_mov_ps(visible(open, last[i] - first, c), exp2_nonpositive(x));
      sum = _mm512_add_ps(sum, e);
      store_weights<NativeBf16>(pi + 16 * c, e);
    }
    sums[i] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t i = 0; i < kRows; i += 16)
    _mm512_storeu_ps(l + i, _mm512_fmadd_ps(_mm512_loadu_ps(l + i), _mm512_load_ps(alpha + i),
                                            _mm512_load_ps(sums + i)));
  for (int64_t i = 0; i < kRows; ++i) {
    if (alpha[i] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(alpha[i]);
    float* oi = o + i * D;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(oi + d, _mm512_mul_ps(_mm512_loadu_ps(oi + d), a));
  }
}
#endif

// Denormal results flushed to 0 and denormal inputs read as 0 while a thread runs blocks (the MXCSR's FTZ and DAZ
// bits, restored after): a weight below 2^-126 is then 0 without the microcode assist each such lane costs (a call of
// 1000 rows over 47 keys took 1.3-2 ms with them, where its scores take ~0.3).
struct FlushDenormals {
#ifdef MAGNETAR_X86_DISPATCH
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

struct Shapes {
  int64_t B, Hq, Hkv, Sq, Sk, Skp, D;
  bool causal;
  float scale2;  // scale log2(e): scores in base 2
};

// One block of kRows query rows of KV head hk's group (b, hk, rows r0 ...): the G = Hq / Hkv query heads reading KV
// head hk laid out as G x Sq rows, row r being query head hk G + r / Sq's row r % Sq -- so a short query's heads fill
// one block and each K / V tile a block loads serves all of them. Scores, softmax steps and products over the block's
// visible keys.
template <typename Tiles>
MAGNETAR_AMX_TARGET void run_block(Tiles& tiles, const Shapes& sh, const at::Tensor& q, const at::BFloat16* kp,
                                   const at::BFloat16* vp, at::BFloat16* out, float* lse, int64_t b, int64_t hk,
                                   int64_t r0, std::vector<float>& buf, std::vector<at::BFloat16>& bbuf) {
#ifdef MAGNETAR_X86_DISPATCH
  const int64_t G = sh.Hq / sh.Hkv, D = sh.D, chunks = D / 32, rows = std::min(kRows, G * sh.Sq - r0);
  float* s = buf.data();                 // kRows x kKeys scores
  float* o = s + kRows * kKeys;          // kRows x D running output
  float* m = o + kRows * D;              // kRows running max (base 2)
  float* l = m + kRows;                  // kRows running sums
  at::BFloat16* p = bbuf.data();         // kRows x kKeys weights
  at::BFloat16* qpad = p + kRows * kKeys;  // kRows x D: rows gathered from two heads, or the last ones zero-padded
  int64_t last[kRows];
  const int64_t offset = sh.Sk - sh.Sq;
  int64_t end = 0;  // keys the block reads: up to its last row's last visible one
  for (int64_t i = 0; i < kRows; ++i) {
    // a padding row (i >= rows) reads as every key, so it never stops a step from going unmasked
    last[i] = sh.causal && i < rows ? std::min((r0 + i) % sh.Sq + offset, sh.Sk - 1) : sh.Sk - 1;
    if (i < rows) end = std::max(end, last[i] + 1);
    m[i] = -std::numeric_limits<float>::infinity();
    l[i] = 0.0f;
  }
  std::fill(o, o + kRows * D, 0.0f);
  const auto* qb = q.data_ptr<at::BFloat16>() + b * q.stride(0);
  auto q_row = [&](int64_t r) {  // row r of the group
    return qb + (hk * G + r / sh.Sq) * q.stride(1) + (r % sh.Sq) * q.stride(2);
  };
  const at::BFloat16* qrows = q_row(r0);
  int64_t qstride = q.stride(2) * 2;
  if (rows < kRows || r0 / sh.Sq != (r0 + kRows - 1) / sh.Sq) {  // not 32 rows of one head
    std::fill(qpad + rows * D, qpad + kRows * D, at::BFloat16(0.0f));
    for (int64_t i = 0; i < rows; ++i) std::memcpy(qpad + i * D, q_row(r0 + i), D * 2);
    qrows = qpad;
    qstride = D * 2;
  }
  const at::BFloat16* kh = kp + (b * sh.Hkv + hk) * sh.Skp * D;
  const at::BFloat16* vh = vp + (b * sh.Hkv + hk) * sh.Skp * D;
  for (int64_t first = 0; first < end; first += kKeys) {
    const int64_t n = std::min(kKeys, (end - first + 31) / 32 * 32);
    for (int64_t j = 0; j < n; j += 32) {  // scores of keys first + j ... + 31: four tiles
      tiles.template zero<0>();
      tiles.template zero<1>();
      tiles.template zero<2>();
      tiles.template zero<3>();
      const int64_t kb = (first + j) / 16;
      for (int64_t dc = 0; dc < chunks; ++dc) {
        tiles.template load<4>(qrows + 32 * dc, qstride);
        tiles.template load<5>(reinterpret_cast<const uint8_t*>(qrows + 32 * dc) + 16 * qstride, qstride);
        tiles.template load<6>(kh + (kb * chunks + dc) * 512, 64);
        tiles.template load<7>(kh + ((kb + 1) * chunks + dc) * 512, 64);
        tiles.template dp<0, 4, 6>();
        tiles.template dp<1, 4, 7>();
        tiles.template dp<2, 5, 6>();
        tiles.template dp<3, 5, 7>();
      }
      tiles.template store<0>(s + j, kKeys * 4);
      tiles.template store<1>(s + j + 16, kKeys * 4);
      tiles.template store<2>(s + 16 * kKeys + j, kKeys * 4);
      tiles.template store<3>(s + 16 * kKeys + j + 16, kKeys * 4);
    }
    bool open = true;  // every row of the block sees every one of the n keys
    for (int64_t i = 0; i < kRows; ++i) open = open && last[i] >= first + n - 1;
    softmax_step<Tiles::kNativeBf16>(s, p, m, l, o, last, first, n, D, sh.scale2, open);
    for (int64_t c = 0; c < D / 16; c += 2) {  // o[:, 16 c ... 16 c + 31] += p v
      tiles.template load<0>(o + 16 * c, D * 4);
      tiles.template load<1>(o + 16 * c + 16, D * 4);
      tiles.template load<2>(o + 16 * D + 16 * c, D * 4);
      tiles.template load<3>(o + 16 * D + 16 * c + 16, D * 4);
      for (int64_t j = 0; j < n; j += 32) {
        const int64_t kb = (first + j) / 32;
        tiles.template load<4>(p + j, kKeys * 2);
        tiles.template load<5>(p + 16 * kKeys + j, kKeys * 2);
        tiles.template load<6>(vh + (kb * (D / 16) + c) * 512, 64);
        tiles.template load<7>(vh + (kb * (D / 16) + c + 1) * 512, 64);
        tiles.template dp<0, 4, 6>();
        tiles.template dp<1, 4, 7>();
        tiles.template dp<2, 5, 6>();
        tiles.template dp<3, 5, 7>();
      }
      tiles.template store<0>(o + 16 * c, D * 4);
      tiles.template store<1>(o + 16 * c + 16, D * 4);
      tiles.template store<2>(o + 16 * D + 16 * c, D * 4);
      tiles.template store<3>(o + 16 * D + 16 * c + 16, D * 4);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t h = hk * G + (r0 + i) / sh.Sq, t = (r0 + i) % sh.Sq;
    at::BFloat16* oh = out + ((b * sh.Hq + h) * sh.Sq + t) * D;
    const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    const __m512 a = _mm512_set1_ps(inv);
    for (int64_t d = 0; d < D; d += 16) store16(oh + d, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), a));
    lse[(b * sh.Hq + h) * sh.Sq + t] =
        l[i] > 0.0f ? float(M_LN2) * (m[i] + std::log2(l[i])) : -std::numeric_limits<float>::infinity();
  }
#endif
}

template <typename Tiles>
std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                       bool causal) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "amx attention: CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "amx attention: q, k and v bfloat16");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3), "amx attention: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D)");
  const int64_t D = q.size(3);
  TORCH_CHECK(D % 32 == 0 && D <= kMaxDim, "amx attention: head dimension a multiple of 32, at most 256, got ", D);
  TORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, "amx attention: Hq a multiple of Hkv");
  TORCH_CHECK(k.size(2) >= 1, "amx attention: at least one key");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "amx attention: q, k and v contiguous along the head dimension");
  TORCH_CHECK(avx512_here(), "amx attention: this CPU lacks AVX-512 F + BW");
#ifdef MAGNETAR_X86_DISPATCH
  Shapes sh{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), (k.size(2) + 31) / 32 * 32, D, causal,
            float(scale * M_LOG2E)};
  at::Tensor out = at::empty({sh.B, sh.Hq, sh.Sq, D}, q.options());
  at::Tensor lse = at::empty({sh.B, sh.Hq, sh.Sq}, q.options().dtype(at::kFloat));
  if (sh.Sq == 0) return {out, lse};
  // K and V packed into this thread's buffer, kept from call to call up to kKeepPacked bytes: a fresh allocation of a
  // long context's copy is fresh pages -- one fault each, in every call of every layer (an 8K-key call of SmolLM2
  // took 2.8-3.4 ms where its work takes ~0.9) unless the allocator keeps freed memory (magnetar serve has it do so)
  thread_local std::vector<at::BFloat16> packed;
  const size_t need = size_t(2 * sh.B * sh.Hkv * sh.Skp * D);
  if (packed.size() < need) packed.resize(need);
  auto* kpp = packed.data();
  auto* vpp = kpp + need / 2;
  at::parallel_for(0, sh.B * sh.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / sh.Hkv, hk = i % sh.Hkv;
      pack_k(k.data_ptr<at::BFloat16>() + b * k.stride(0) + hk * k.stride(1), k.stride(2), sh.Sk, sh.Skp, D,
             kpp + i * sh.Skp * D);
      pack_v(v.data_ptr<at::BFloat16>() + b * v.stride(0) + hk * v.stride(1), v.stride(2), sh.Sk, sh.Skp, D,
             vpp + i * sh.Skp * D);
    }
  });
  const int64_t blocks = (sh.Hq / sh.Hkv * sh.Sq + kRows - 1) / kRows;  // a KV head's group of rows
  auto* outp = out.data_ptr<at::BFloat16>();
  auto* lsep = lse.data_ptr<float>();
  at::parallel_for(0, sh.B * sh.Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    Tiles tiles;
    std::vector<float> buf(kRows * kKeys + kRows * D + 2 * kRows);
    std::vector<at::BFloat16> bbuf(kRows * kKeys + kRows * D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t blk = t % blocks, hk = (t / blocks) % sh.Hkv, b = t / (blocks * sh.Hkv);
      run_block(tiles, sh, q, kpp, vpp, outp, lsep, b, hk, blk * kRows, buf, bbuf);
    }
  });
  if (packed.size() * sizeof(at::BFloat16) > kKeepPacked) std::vector<at::BFloat16>().swap(packed);
  return {out, lse};
#else
  return {};  // not reached: avx512_here() is false
#endif
}

}  // namespace

bool supported() { return amx_granted(); }

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             double scale, bool causal) {
#ifdef MAGNETAR_AMX
  TORCH_CHECK(amx_granted(), "amx attention: this CPU or kernel offers no AMX-BF16 tiles (see supported())");
  return run<AmxTiles>(q, k, v, scale, causal);
#else
  TORCH_CHECK(false, "amx attention: built without x86-64 Linux support");
#endif
}

std::tuple<at::Tensor, at::Tensor> attention_emulated(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      double scale, bool causal) {
  return run<EmulatedTiles>(q, k, v, scale, causal);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "bf16 attention with its log-sum-exp on AMX tiles (full or bottom-right causal)");
  m.def("attention_emulated", &attention_emulated, "attention with each tile instruction a scalar loop (for tests)");
  m.def("supported", &supported, "whether attention runs here (AVX-512, AMX-BF16, the tile state granted)");
}
