// INT8 block-scaled GEMM (1x128 activation scales, 128x128 weight scales) over the contiguous or
// the masked layout: block_scaled_contiguous_gemm.cuh with int8 operands. Each 128-wide K block is
// summed exactly in int32 by the warpgroup MMAs and promoted to fp32 once, with the product of the
// row's activation scale and the block's weight scale; the K blocks add up in fp32.
// This file builds variant 0 (kInt8BlockVariants: n256_quarters_i2f_s4) and picks one at run time;
// the other variants have a file of their own (int8_block_*_gemm.cu) so that they compile in
// parallel.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {

extern template void int8_block_gemm_variant<1>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, int64_t, int64_t, bool);
extern template void int8_block_gemm_variant<2>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, int64_t, int64_t, bool);
static_assert(kNumInt8BlockVariants == 3, "one case below and one source file per variant");

// segments, masked_max_m: as expert_block_table's; variant: an index of kInt8BlockVariants
// (checked by the caller).
void int8_block_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a,
                                     const at::Tensor& a_scale, const at::Tensor& b,
                                     const at::Tensor& b_scale, const at::Tensor& segments,
                                     int64_t masked_max_m, int64_t raster_along_n,
                                     int64_t max_swizzle, int64_t variant, bool pdl) {
  auto block_expert = expert_block_table(a, segments, masked_max_m, pdl);
  auto run = [&](auto v) {
    int8_block_gemm_variant<decltype(v)::value>(out, a, a_scale, b, b_scale, block_expert,
                                                raster_along_n, max_swizzle, pdl);
  };
  switch (variant) {
    case 1: run(Int<1>{}); break;
    case 2: run(Int<2>{}); break;
    default: run(Int<0>{});
  }
}

}  // namespace epmoe
