// Fused merge of partial attention states: CUDA op binding (kernel in merge_states_kernel.cu).
//
// NOTE: NOT YET COMPILED OR RUN ON A GPU MACHINE (only compile-checked without a GPU; see the kernel file).
// Built by magnetar.ops.op_builder.MergeStatesCUDABuilder. Semantics: see merge_states.cpp.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>

#include <tuple>

void merge_states_cuda_launch(const at::Tensor& outs, const at::Tensor& lses, at::Tensor& out,
                              at::Tensor& lse_out);

std::tuple<torch::Tensor, torch::Tensor> merge_states_cuda(torch::Tensor outs, torch::Tensor lses) {
  TORCH_CHECK(outs.dim() == 5, "magnetar merge_states: outs must be (N, B, H, S, D), got ", outs.dim(),
              " dims with shape ", outs.sizes());
  TORCH_CHECK(lses.dim() == 4, "magnetar merge_states: lses must be (N, B, H, S), got ", lses.dim(),
              " dims with shape ", lses.sizes());
  TORCH_CHECK(lses.sizes() == outs.sizes().slice(0, 4), "magnetar merge_states: lses shape ", lses.sizes(),
              " does not match outs shape ", outs.sizes(), " without its last dim");
  TORCH_CHECK(outs.size(0) > 0, "magnetar merge_states: got N = 0 partial states; pass at least one");
  TORCH_CHECK(outs.is_cuda() && lses.is_cuda(),
              "magnetar merge_states (CUDA op): outs and lses must be CUDA tensors, got ", outs.device(), " and ",
              lses.device());
  TORCH_CHECK(outs.device() == lses.device(), "magnetar merge_states: outs on ", outs.device(), " but lses on ",
              lses.device());
  TORCH_CHECK(lses.scalar_type() == at::kFloat, "magnetar merge_states: lses must be float32, got ",
              lses.scalar_type());
  TORCH_CHECK(outs.scalar_type() == at::kFloat || outs.scalar_type() == at::kBFloat16 ||
                  outs.scalar_type() == at::kHalf || outs.scalar_type() == at::kDouble,
              "magnetar merge_states: outs must be float32, bfloat16, float16 (or float64), got ", outs.scalar_type());

  const c10::cuda::CUDAGuard device_guard(outs.device());
  outs = outs.contiguous();
  lses = lses.contiguous();
  auto out = at::empty({outs.size(1), outs.size(2), outs.size(3), outs.size(4)}, outs.options());
  auto lse_out = at::empty({outs.size(1), outs.size(2), outs.size(3)}, lses.options());
  merge_states_cuda_launch(outs, lses, out, lse_out);
  return {out, lse_out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Magnetar fused merge of partial attention states (CUDA)";
  m.def("merge_states", &merge_states_cuda,
        "merge_states(outs (N,B,H,S,D), lses (N,B,H,S) float32) -> (out (B,H,S,D), lse (B,H,S) float32)",
        pybind11::arg("outs"), pybind11::arg("lses"));
}
