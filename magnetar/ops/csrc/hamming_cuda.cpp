// Bit-packed hash codes and Hamming-similarity top-k: CUDA op binding (kernels in hamming_kernel.cu).
//
// NOTE: NOT YET COMPILED OR RUN ON A GPU MACHINE (no GPU was lent when it was written); the CPU op
// (hamming.cpp) and the torch reference (magnetar/sparse/codes.py) define the semantics it must match.
// Built by magnetar.ops.op_builder.HammingCUDABuilder.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <tuple>

void pack_bits_cuda_launch(const at::Tensor& bits, at::Tensor& out);
void hamming_scores_cuda_launch(const at::Tensor& q, const at::Tensor& k, at::Tensor& scores);

namespace {
void check_codes(const torch::Tensor& q, const torch::Tensor& k) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3, "magnetar hamming: codes must be q (H, M, G, W) and k (H, N, W), got ",
              q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.scalar_type() == at::kInt && k.scalar_type() == at::kInt, "magnetar hamming: codes must be int32");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(2), "magnetar hamming: q ", q.sizes(), " and k ",
              k.sizes(), " disagree on H or W");
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && q.device() == k.device(), "magnetar hamming (CUDA op): codes must be on "
              "one CUDA device");
}
}  // namespace

torch::Tensor pack_bits(torch::Tensor bits) {
  TORCH_CHECK(bits.dim() == 2 && bits.size(1) % 32 == 0, "magnetar pack_bits: bits must be (R, nbits) with nbits "
              "a multiple of 32, got ", bits.sizes());
  TORCH_CHECK(bits.scalar_type() == at::kBool || bits.scalar_type() == at::kByte, "magnetar pack_bits: bool/uint8");
  TORCH_CHECK(bits.is_cuda(), "magnetar pack_bits (CUDA op): bits must be a CUDA tensor");
  const c10::cuda::CUDAGuard guard(bits.device());
  bits = bits.contiguous();
  auto out = torch::empty({bits.size(0), bits.size(1) / 32}, bits.options().dtype(at::kInt));
  pack_bits_cuda_launch(bits, out);
  return out;
}

torch::Tensor hamming_scores(torch::Tensor q, torch::Tensor k) {
  check_codes(q, k);
  const c10::cuda::CUDAGuard guard(q.device());
  q = q.contiguous();
  k = k.contiguous();
  auto scores = torch::empty({q.size(0), q.size(1), k.size(1)}, q.options());
  hamming_scores_cuda_launch(q, k, scores);
  return scores;
}

std::tuple<torch::Tensor, torch::Tensor> hamming_topk(torch::Tensor q, torch::Tensor k, int64_t kk) {
  check_codes(q, k);
  const int64_t N = k.size(1);
  TORCH_CHECK(kk >= 1 && kk <= N, "magnetar hamming_topk: k must be in [1, ", N, "], got ", kk);
  auto scores = hamming_scores(q, k);
  // (score desc, index asc) as one int64 key: score * 2^32 + (2^32 - 1 - index); topk of the key is exact.
  auto idx = torch::arange(N, scores.options().dtype(at::kLong));
  auto key = scores.to(at::kLong) * (int64_t(1) << 32) + ((int64_t(1) << 32) - 1 - idx);
  auto top = std::get<1>(key.topk(kk, -1, true, true));
  return {scores.gather(-1, top), top};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bits", &pack_bits, "pack (R, nbits) bits into (R, nbits/32) int32 words, LSB first");
  m.def("hamming_scores", &hamming_scores, "XNOR-popcount similarity of packed codes, summed over GQA groups");
  m.def("hamming_topk", &hamming_topk, "the k most similar keys (score desc, index asc)");
}
