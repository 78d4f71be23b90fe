// The INT8 block-scaled GEMM with the kStaggered schedule of its consumer warpgroups
// (block_scaled_contiguous_gemm.cuh, BlockScaledSchedule); int8_block_contiguous_gemm.cu picks it.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {

void int8_block_gemm_staggered(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                               const at::Tensor& b, const at::Tensor& b_scale,
                               const at::Tensor& block_expert, int64_t raster_along_n,
                               int64_t max_swizzle) {
  run_block_scaled_by_k<int8_t, kStaggered>(out, a, a_scale, b, b_scale, block_expert,
                                            raster_along_n, max_swizzle);
}

}  // namespace epmoe
