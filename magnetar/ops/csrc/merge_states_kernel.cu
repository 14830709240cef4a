// Fused merge of partial attention states: CUDA kernel.
//
// NOTE: NOT YET COMPILED OR RUN ON A GPU MACHINE. It was only compile-checked on a machine without a GPU
// (nvcc 13.0, sm_80 + sm_90, against the torch 2.13 headers) -- never built through the builder on a GPU, never
// executed. The CUDA tests in tests/test_fused_merge.py (skipped without CUDA) check it against fp64 and torch
// references; run them on a GPU before relying on this kernel. Kept deliberately simple so it is easy to check
// by reading.
//
// Semantics: identical to merge_states.cpp (the CPU op) and magnetar.ops.merge.merge_states_torch:
//   part n of row r is empty iff lses[n, r] is -inf (its outs row is ignored);
//   a part with lses[n, r] NaN or +inf poisons the row: out = NaN (every element), lse = NaN;
//   otherwise m = max over the finite parts; w_n = exp(lses[n, r] - m);
//   out = sum_n w_n * outs[n, r, :] / sum_n w_n (float32 accumulation; a finite part's outs row is read even
//   when w_n underflows to 0, so NaN there stays NaN); lse = m + log(sum_n w_n);
//   a row empty in every part gives out = 0, lse = -inf.
// The non-finite rule was changed by reading only, like the rest of this file: compile-check and run the CUDA
// tests of tests/test_fused_merge.py and tests/test_nonfinite.py on a GPU.
//
// Layout (contiguous): outs (N, R, D), lses (N, R) float32, out (R, D), lse_out (R) float32, R = B*H*S.
// Mapping: one warp per row. Every lane reads the N lse values of its row (N is small; the loads are
// broadcast within the warp) and computes m and the denominator itself, so no shuffles or shared memory are
// needed; then lane j handles d = j, j + 32, ... (coalesced reads of each part's row), looping over the parts.
// Each thread's work is independent, so there is no synchronisation at all.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cfloat>
#include <cstdint>

namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;

// Finite test that does not depend on fast-math settings: NaN compares false, +-inf exceed FLT_MAX.
__device__ __forceinline__ bool is_finite_f(float x) { return fabsf(x) <= FLT_MAX; }

__device__ __forceinline__ float neg_inf_f() { return -__int_as_float(0x7f800000); }  // -inf

__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }  // quiet NaN

// -inf by its bit pattern, so the test holds whatever the math flags.
__device__ __forceinline__ bool is_neg_inf_f(float x) { return __float_as_uint(x) == 0xff800000u; }

template <typename scalar_t>
__global__ void merge_states_kernel(const scalar_t* __restrict__ outs, const float* __restrict__ lses,
                                    scalar_t* __restrict__ out, float* __restrict__ lse_out, int64_t N, int64_t R,
                                    int64_t D) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (r >= R) return;  // no __syncthreads / shuffles below, so an early exit is safe

  // Pass 1: max over the finite parts; a NaN or +inf part poisons the row.
  float m = neg_inf_f();
  bool any = false;
  bool poisoned = false;
  for (int64_t n = 0; n < N; ++n) {
    const float l = lses[n * R + r];
    if (is_finite_f(l)) {
      m = any ? fmaxf(m, l) : l;
      any = true;
    } else if (!is_neg_inf_f(l)) {
      poisoned = true;
    }
  }

  scalar_t* o_row = out + r * D;
  if (poisoned) {
    for (int64_t d = lane; d < D; d += kWarpSize) o_row[d] = static_cast<scalar_t>(nan_f());
    if (lane == 0) lse_out[r] = nan_f();
    return;
  }
  if (!any) {
    for (int64_t d = lane; d < D; d += kWarpSize) o_row[d] = static_cast<scalar_t>(0.0f);
    if (lane == 0) lse_out[r] = neg_inf_f();
    return;
  }

  // Denominator (same summation order as the CPU op). >= 1: the max part contributes exp(0) = 1.
  float denom = 0.0f;
  for (int64_t n = 0; n < N; ++n) {
    const float l = lses[n * R + r];
    if (is_finite_f(l)) denom += expf(l - m);
  }

  // Pass 2: each lane accumulates its columns in float32 over the parts.
  for (int64_t d = lane; d < D; d += kWarpSize) {
    float acc = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float l = lses[n * R + r];
      if (!is_finite_f(l)) continue;  // empty part (-inf): ignored, including its outs row
      const float w = expf(l - m);
      acc += w * static_cast<float>(outs[(n * R + r) * D + d]);
    }
    o_row[d] = static_cast<scalar_t>(acc / denom);
  }
  if (lane == 0) lse_out[r] = m + logf(denom);
}

}  // namespace

// Called by merge_states_cuda.cpp with contiguous CUDA tensors on the current device, shapes already checked.
void merge_states_cuda_launch(const at::Tensor& outs, const at::Tensor& lses, at::Tensor& out,
                              at::Tensor& lse_out) {
  const int64_t N = outs.size(0);
  const int64_t D = outs.size(4);
  const int64_t R = outs.size(1) * outs.size(2) * outs.size(3);
  if (R == 0) return;
  const int64_t blocks = (R + kWarpsPerBlock - 1) / kWarpsPerBlock;
  TORCH_CHECK(blocks <= static_cast<int64_t>(INT32_MAX), "magnetar merge_states (CUDA): too many rows (", R, ")");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, outs.scalar_type(), "magnetar_merge_states_cuda", [&] {
    merge_states_kernel<scalar_t><<<static_cast<unsigned int>(blocks), kThreadsPerBlock, 0, stream>>>(
        outs.const_data_ptr<scalar_t>(), lses.const_data_ptr<float>(), out.mutable_data_ptr<scalar_t>(),
        lse_out.mutable_data_ptr<float>(), N, R, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}
