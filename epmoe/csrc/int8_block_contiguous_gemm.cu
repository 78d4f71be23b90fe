// INT8 block-scaled GEMM (1x128 activation scales, 128x128 weight scales) over the contiguous or
// the masked layout: block_scaled_contiguous_gemm.cuh with int8 operands. Each 128-wide K block is
// summed exactly in int32 by the warpgroup MMAs and promoted to fp32 once, with the product of the
// row's activation scale and the block's weight scale; the K blocks add up in fp32.
// This file builds the kLockstep schedule and picks one at run time; the others have a file each
// (int8_block_staggered_gemm.cu, int8_block_split_n_gemm.cu) so that they compile in parallel.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {

void int8_block_gemm_staggered(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                               const at::Tensor& b, const at::Tensor& b_scale,
                               const at::Tensor& block_expert, int64_t raster_along_n,
                               int64_t max_swizzle);
void int8_block_gemm_split_n(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                             const at::Tensor& b, const at::Tensor& b_scale,
                             const at::Tensor& block_expert, int64_t raster_along_n,
                             int64_t max_swizzle);

// segments, masked_max_m: as expert_block_table's; schedule: a BlockScaledSchedule (checked by
// the caller).
void int8_block_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a,
                                     const at::Tensor& a_scale, const at::Tensor& b,
                                     const at::Tensor& b_scale, const at::Tensor& segments,
                                     int64_t masked_max_m, int64_t raster_along_n,
                                     int64_t max_swizzle, int64_t schedule) {
  auto block_expert = expert_block_table(a, segments, masked_max_m);
  switch (schedule) {
    case kStaggered:
      int8_block_gemm_staggered(out, a, a_scale, b, b_scale, block_expert, raster_along_n,
                                max_swizzle);
      break;
    case kSplitN:
      int8_block_gemm_split_n(out, a, a_scale, b, b_scale, block_expert, raster_along_n,
                              max_swizzle);
      break;
    default:
      run_block_scaled_by_k<int8_t, kLockstep>(out, a, a_scale, b, b_scale, block_expert,
                                               raster_along_n, max_swizzle);
  }
}

}  // namespace epmoe
