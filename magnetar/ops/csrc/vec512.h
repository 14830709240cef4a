// AVX-512 helpers of the CPU ops that round each result to the tensor's dtype as torch does (rms_norm.cpp,
// rotary.cpp): 16 float32 lanes loaded from float32 or bfloat16, rounded to bfloat16 (nearest even, NaN kept) and
// stored back; and 2^x for the attention kernels' softmax (amx_attention.cpp, decode_attention.cpp).
// Compiled with target attributes (MAGNETAR_AVX512), called only where avx512_here() says so.
#pragma once

#include "cpu_features.h"

// Whether the helpers below run here: an x86-64 build (GCC / Clang) on a CPU with AVX-512 F + BW.
inline bool avx512_here() {
#ifdef MAGNETAR_X86_DISPATCH
  return cpu_has_avx512();
#else
  return false;
#endif
}

#ifdef MAGNETAR_X86_DISPATCH
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#define MAGNETAR_AVX512 __attribute__((target("avx512f,avx512bw")))

namespace magnetar_vec512 {

MAGNETAR_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MAGNETAR_AVX512 inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float32 -> bfloat16 bits in the low half of each lane: round to nearest even, any NaN -> 0x7FC0 (c10's rule).
MAGNETAR_AVX512 inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
}

// v rounded to T and widened back (the value a T holds).
MAGNETAR_AVX512 inline __m512 rounded(__m512 v, const float*) { return v; }
MAGNETAR_AVX512 inline __m512 rounded(__m512 v, const at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

MAGNETAR_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
MAGNETAR_AVX512 inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// 2^x for x <= 0 (and -inf): the softmax weights of amx_attention.cpp and decode_attention.cpp. 2^f by a degree-6
// polynomial on f in [-1/2, 1/2] (relative error < 2e-7), scaled by 2^n with VSCALEFPS; x clamped at -200, whose 2^x
// is 0.
MAGNETAR_AVX512 inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace magnetar_vec512
#endif
