// CUDA kernels of the Hamming op (binding in hamming_cuda.cpp). NOT YET COMPILED OR RUN ON A GPU MACHINE.
//
// pack_bits: one thread per output word reads its 32 bytes.  hamming_scores: one thread per (row, key); the
// row's G x W query words sit in shared memory, __popc counts the differing bits.

#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

__global__ void pack_bits_kernel(const uint8_t* __restrict__ bits, uint32_t* __restrict__ out, int64_t words) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= words) return;
  const uint8_t* src = bits + i * 32;
  uint32_t w = 0;
#pragma unroll
  for (int b = 0; b < 32; ++b) w |= static_cast<uint32_t>(src[b] != 0) << b;
  out[i] = w;
}

__global__ void hamming_scores_kernel(const uint32_t* __restrict__ q, const uint32_t* __restrict__ k,
                                      int32_t* __restrict__ scores, int64_t M, int64_t G, int64_t W, int64_t N) {
  extern __shared__ uint32_t qs[];
  const int64_t row = blockIdx.y;  // (h, m)
  const int64_t h = row / M;
  for (int64_t i = threadIdx.x; i < G * W; i += blockDim.x) qs[i] = q[row * G * W + i];
  __syncthreads();
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const uint32_t* kv = k + (h * N + n) * W;
  int32_t diff = 0;
  for (int64_t w = 0; w < W; ++w) {
    const uint32_t kw = kv[w];
    for (int64_t g = 0; g < G; ++g) diff += __popc(qs[g * W + w] ^ kw);
  }
  scores[row * N + n] = static_cast<int32_t>(32 * W * G) - diff;
}

}  // namespace

void pack_bits_cuda_launch(const at::Tensor& bits, at::Tensor& out) {
  const int64_t words = out.numel();
  if (words == 0) return;
  const int threads = 256;
  const int64_t blocks = (words + threads - 1) / threads;
  pack_bits_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint8_t*>(bits.data_ptr()), reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()), words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void hamming_scores_cuda_launch(const at::Tensor& q, const at::Tensor& k, at::Tensor& scores) {
  const int64_t H = q.size(0), M = q.size(1), G = q.size(2), W = q.size(3), N = k.size(1);
  if (H * M == 0 || N == 0) return;
  const int threads = 256;
  dim3 grid((N + threads - 1) / threads, H * M);
  const size_t shmem = sizeof(uint32_t) * G * W;
  hamming_scores_kernel<<<grid, threads, shmem, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint32_t*>(q.data_ptr<int32_t>()), reinterpret_cast<const uint32_t*>(k.data_ptr<int32_t>()),
      scores.data_ptr<int32_t>(), M, G, W, N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
