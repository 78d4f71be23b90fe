// INT8 block-scaled GEMM (1x128 activation scales, 128x128 weight scales) over the contiguous
// layout: block_scaled_contiguous_gemm.cuh with int8 operands. Each 128-wide K block is summed
// exactly in int32 by the warpgroup MMAs and promoted to fp32 once, with the product of the row's
// activation scale and the block's weight scale; the K blocks add up in fp32.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {

void int8_block_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a,
                                     const at::Tensor& a_scale, const at::Tensor& b,
                                     const at::Tensor& b_scale, const at::Tensor& offsets,
                                     int64_t raster_along_n, int64_t max_swizzle) {
  run_block_scaled_by_k<int8_t>(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                max_swizzle);
}

}  // namespace epmoe
