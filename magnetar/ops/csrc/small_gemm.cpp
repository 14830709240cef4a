// Few-row products of bf16 weights on the CPU (the decode step's linear layers: magnetar.engine.gemv).
//
// Built by magnetar.ops.op_builder.SmallGemmBuilder (DeepSpeed OpBuilder, JIT). The reference is an fp64 product
// (tests/test_small_gemm.py); torch's F.linear computes the same up to the order of the float32 sums.
//
//   pack(w (N, K) bfloat16, any strides, K even) -> packed (ceil(N / 32), K / 2, 32, 2) bfloat16: block j, pair p,
//       lane c holds w[32 j + c, 2 p] and w[32 j + c, 2 p + 1] (zeros past N)
//   gemm(x (M, K) bfloat16, contiguous along K, packed, N, bias (N) bfloat16 or None) -> y (M, N) bfloat16:
//       y = x w^T + bias, every product and sum in float32 (AVX-512 BF16's dot products of pairs), rounded to
//       bfloat16 once at the end (round to nearest even, as torch rounds)
//   supported() says whether this CPU runs gemm (x86-64 with AVX-512F and AVX-512 BF16); elsewhere the caller keeps
//   its other products.
//
// Why: a decode step reads every weight once for a few rows, so it runs at the speed weights stream from memory.
// oneDNN's bf16 kernel (torch.ops.mkldnn._linear_pointwise on a prepacked copy) read them at 10-13 GB/s on one core
// of the AVX-512 EPYC VM, where the core reads memory at ~22 GB/s. Here the packed layout puts the 32 outputs of a
// block side by side for each pair of inputs: one 64-byte load per 16 outputs and pair, one VDPBF16PS per row of x
// (the pair broadcast), no horizontal sums; the weights are read once, in order, for up to 8 rows at a time (more
// rows: the block is read again from cache for each further 8). Parallelised with at::parallel_for over the blocks.

#include "torch_op.h"

#include <algorithm>
#include <cstdint>

#include "cpu_features.h"

#ifdef MAGNETAR_X86_DISPATCH
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // outputs per packed block: two 16-lane float32 accumulators per row of x
constexpr int kMaxTile = 8;     // rows of x per pass over a block (8 x 2 accumulators of the 32 registers)
// how far ahead (64-byte lines) the loads prefetch: 16 (1 KiB) measured 12-13 ms for SmolLM2-135M's decode products
// on one core, 32 lines 13 ms, 64 lines 14 ms, one line of the two per pair at 16 ahead 18 ms (AVX-512 EPYC VM)
constexpr int kAhead = 16;

#ifdef MAGNETAR_X86_DISPATCH
#define MAGNETAR_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Rounds 16 float32 lanes to bfloat16 (nearest even) and stores them.
MAGNETAR_BF16 inline void store_bf16(uint16_t* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

// 16 bfloat16 values widened to float32 (bf16 is float32's top half).
MAGNETAR_BF16 inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The first n (<= 32) of the 32 bfloat16 values at p as two float32 vectors, zeros past n (masked loads: nothing
// past n is read).
MAGNETAR_BF16 inline void load_bias(const uint16_t* p, int64_t n, __m512& b0, __m512& b1) {
  const auto mask = [](int64_t k) { return (__mmask16)(k >= 16 ? 0xFFFFu : k <= 0 ? 0u : (1u << k) - 1u); };
  b0 = widen_bf16(_mm256_maskz_loadu_epi16(mask(n), p));
  b1 = widen_bf16(_mm256_maskz_loadu_epi16(mask(n - 16), p + 16));
}

// One block of 32 outputs for MT rows of x: acc[m] over every pair of inputs, then the block's bias (its first
// `outputs` values; none when bias is null), rounding and the store (all 32: the output rows are padded to whole
// blocks).
template <int MT>
MAGNETAR_BF16 void block_rows(const uint32_t* const* xrows, const uint16_t* wblock, int64_t pairs,
                              const uint16_t* bias, int64_t outputs, uint16_t* const* yrows) {
  __m512 lo[MT], hi[MT];
  for (int m = 0; m < MT; ++m) {
    lo[m] = _mm512_setzero_ps();
    hi[m] = _mm512_setzero_ps();
  }
  const __m512i* w = reinterpret_cast<const __m512i*>(wblock);
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p + kAhead), _MM_HINT_T0);  // both lines of a later pair
    _mm_prefetch(reinterpret_cast<const char*>(w + 2 * p + kAhead + 1), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 2 * p);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 2 * p + 1);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xrows[m][p]));
      lo[m] = _mm512_dpbf16_ps(lo[m], w0, xb);
      hi[m] = _mm512_dpbf16_ps(hi[m], w1, xb);
    }
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    load_bias(bias, outputs, b0, b1);
  }
  for (int m = 0; m < MT; ++m) {
    store_bf16(yrows[m], _mm512_add_ps(lo[m], b0));
    store_bf16(yrows[m] + 16, _mm512_add_ps(hi[m], b1));
  }
}

using BlockFn = void (*)(const uint32_t* const*, const uint16_t*, int64_t, const uint16_t*, int64_t,
                        uint16_t* const*);
const BlockFn kBlockFns[kMaxTile + 1] = {nullptr,           block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>,
                                         block_rows<5>, block_rows<6>, block_rows<7>, block_rows<8>};
#endif

void check_packed(const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kBlock &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "small_gemm: packed must be the (ceil(N/32), K/2, 32, 2) bfloat16 tensor pack() made, got ",
              packed.sizes());
  TORCH_CHECK(N > 0 && (N + kBlock - 1) / kBlock == packed.size(0),
              "small_gemm: N = ", N, " does not match the packed blocks (", packed.size(0), " of 32)");
}

}  // namespace

bool supported() {
#ifdef MAGNETAR_X86_DISPATCH
  return cpu_has_avx512_bf16();
#else
  return false;
#endif
}

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "small_gemm.pack: w must be a 2-D bfloat16 CPU tensor (N, K), got ", w.sizes(), " ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N > 0 && K > 0 && K % 2 == 0, "small_gemm.pack: K must be even and N, K positive, got ", w.sizes());
  const int64_t blocks = (N + kBlock - 1) / kBlock, pairs = K / 2;
  auto packed = at::empty({blocks, pairs, kBlock, 2}, w.options().memory_format(at::MemoryFormat::Contiguous));
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t s0 = w.stride(0), s1 = w.stride(1);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      uint16_t* out = dst + j * pairs * kBlock * 2;
      for (int64_t p = 0; p < pairs; ++p) {
        for (int64_t c = 0; c < kBlock; ++c) {
          const int64_t n = j * kBlock + c;
          const bool real = n < N;
          out[(p * kBlock + c) * 2] = real ? src[n * s0 + (2 * p) * s1] : 0;
          out[(p * kBlock + c) * 2 + 1] = real ? src[n * s0 + (2 * p + 1) * s1] : 0;
        }
      }
    }
  });
  return packed;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "small_gemm: this CPU lacks AVX-512 BF16 (supported() is false)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "small_gemm: x must be a (M, K) bfloat16 CPU tensor contiguous along K, got ", x.sizes());
  check_packed(packed, N);
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(K == 2 * pairs, "small_gemm: x has K = ", K, ", the packed weight ", 2 * pairs);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kBFloat16,
                "small_gemm: bias must be (N,) bfloat16, got ", bias->sizes(), " ", bias->scalar_type());
    b = bias->contiguous();  // read in place, each block its own 32 (fewer in the last)
  }
  // every block writes its 32 outputs: rows of blocks * 32, trimmed by a view when N is not a multiple of 32
  auto y = at::empty({M, blocks * kBlock}, x.options());
  if (M == 0) {
    return y.narrow(1, 0, N);
  }
#ifdef MAGNETAR_X86_DISPATCH
  const auto* xp = reinterpret_cast<const uint8_t*>(x.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0) * 2;  // bytes between rows
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto* bp = b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t ys = blocks * kBlock;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    const uint32_t* xrows[kMaxTile];
    uint16_t* yrows[kMaxTile];
    for (int64_t j = begin; j < end; ++j) {
      const uint16_t* wblock = wp + j * pairs * kBlock * 2;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int mt = static_cast<int>(std::min<int64_t>(kMaxTile, M - m0));
        for (int i = 0; i < mt; ++i) {
          xrows[i] = reinterpret_cast<const uint32_t*>(xp + (m0 + i) * xs);
          yrows[i] = yp + (m0 + i) * ys + j * kBlock;
        }
        kBlockFns[mt](xrows, wblock, pairs, bp == nullptr ? nullptr : bp + j * kBlock, N - j * kBlock, yrows);
      }
    }
  });
#endif
  return ys == N ? y : y.narrow(1, 0, N);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "bf16 weight (N, K) -> the blocked layout gemm reads: (ceil(N/32), K/2, 32, 2)");
  m.def("gemm", &gemm, "x (M, K) bf16 @ packed^T (+ bias) -> (M, N) bf16, float32 sums (AVX-512 BF16)");
  m.def("supported", &supported, "whether this CPU runs gemm (x86-64 with AVX-512F, AVX-512BW and AVX-512 BF16)");
}
