// INT8 block-scaled GEMM (1x128 activation scales, 128x128 weight scales) over the contiguous or
// the masked layout: block_scaled_contiguous_gemm.cuh with int8 operands. Each 128-wide K block is
// summed exactly in int32 by the warpgroup MMAs and promoted to fp32 once, with the product of the
// row's activation scale and the block's weight scale; the K blocks add up in fp32.
// This file builds variant 0 (kInt8BlockVariants) and picks one at run time; every other variant
// has a file of its own (int8_block_*_gemm.cu) so that they compile in parallel.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {

#define EPMOE_INT8_BLOCK_ELSEWHERE(V)                                                             \
  extern template void int8_block_gemm_variant<V>(                                                \
      at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,   \
      const at::Tensor&, int64_t, int64_t, bool);
EPMOE_INT8_BLOCK_ELSEWHERE(1)
EPMOE_INT8_BLOCK_ELSEWHERE(2)
EPMOE_INT8_BLOCK_ELSEWHERE(3)
EPMOE_INT8_BLOCK_ELSEWHERE(4)
EPMOE_INT8_BLOCK_ELSEWHERE(5)
EPMOE_INT8_BLOCK_ELSEWHERE(6)
EPMOE_INT8_BLOCK_ELSEWHERE(7)
EPMOE_INT8_BLOCK_ELSEWHERE(8)
EPMOE_INT8_BLOCK_ELSEWHERE(9)
EPMOE_INT8_BLOCK_ELSEWHERE(10)
EPMOE_INT8_BLOCK_ELSEWHERE(11)
EPMOE_INT8_BLOCK_ELSEWHERE(12)
EPMOE_INT8_BLOCK_ELSEWHERE(13)
EPMOE_INT8_BLOCK_ELSEWHERE(14)
static_assert(kNumInt8BlockVariants == 15, "one case below and one source file per variant");

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
    case 3: run(Int<3>{}); break;
    case 4: run(Int<4>{}); break;
    case 5: run(Int<5>{}); break;
    case 6: run(Int<6>{}); break;
    case 7: run(Int<7>{}); break;
    case 8: run(Int<8>{}); break;
    case 9: run(Int<9>{}); break;
    case 10: run(Int<10>{}); break;
    case 11: run(Int<11>{}); break;
    case 12: run(Int<12>{}); break;
    case 13: run(Int<13>{}); break;
    case 14: run(Int<14>{}); break;
    default: run(Int<0>{});
  }
}

}  // namespace epmoe
