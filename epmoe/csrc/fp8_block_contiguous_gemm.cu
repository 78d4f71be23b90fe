// FP8 e4m3 block-scaled GEMM over the contiguous layout: block_scaled_contiguous_gemm.cuh with
// e4m3 operands (its configurations and the K boundary between them are there).
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {

void fp8_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale,
                              const at::Tensor& offsets, int64_t raster_along_n,
                              int64_t max_swizzle, bool pdl) {
  run_block_scaled_by_k<cutlass::float_e4m3_t>(out, a, a_scale, b, b_scale,
                                               block_expert_table(a, offsets, pdl), raster_along_n,
                                               max_swizzle, pdl);
}

int64_t fp8_contiguous_gemm_coop_workspace(at::Tensor& out, const at::Tensor& a,
                                           const at::Tensor& a_scale, const at::Tensor& b,
                                           const at::Tensor& b_scale, int64_t sm_count) {
  return workspace_size_by_k<cutlass::float_e4m3_t>(out, a, a_scale, b, b_scale, sm_count);
}

}  // namespace epmoe
