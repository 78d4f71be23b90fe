// GEMM1 of an INT8 block-scaled experts pass with the activation fused into its epilogue
// (silu_quant_epilogue.cuh): the INT8 block kernel's variants listed in kSiluQuantVariants
// (block_scaled_contiguous_gemm.cuh), over the contiguous or the masked layout. This file builds
// variant 2 (n256_quarters_run4) and picks one at run time; int8_block_silu_run2_gemm.cu builds
// variant 1, so that they compile in parallel.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {

extern template void int8_block_silu_gemm_variant<1>(at::Tensor&, at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&, int64_t,
                                                     int64_t, bool);
template void int8_block_silu_gemm_variant<2>(at::Tensor&, at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, int64_t,
                                              int64_t, bool);
static_assert(kNumSiluQuantVariants == 2 && kSiluQuantVariants[0] == 1 && kSiluQuantVariants[1] == 2,
              "one case below and one instantiation per fused variant");

// segments, masked_max_m: as expert_block_table's; variant: an index of kInt8BlockVariants that is
// one of kSiluQuantVariants (checked by the caller).
void int8_block_silu_gemm_coop(at::Tensor& q, at::Tensor& q_scale, const at::Tensor& a,
                               const at::Tensor& a_scale, const at::Tensor& b,
                               const at::Tensor& b_scale, const at::Tensor& segments,
                               int64_t masked_max_m, int64_t raster_along_n, int64_t max_swizzle,
                               int64_t variant, bool pdl) {
  auto block_expert = expert_block_table(a, segments, masked_max_m, pdl);
  if (variant == 1) {
    int8_block_silu_gemm_variant<1>(q, q_scale, a, a_scale, b, b_scale, block_expert,
                                     raster_along_n, max_swizzle, pdl);
  } else {
    int8_block_silu_gemm_variant<2>(q, q_scale, a, a_scale, b, b_scale, block_expert,
                                     raster_along_n, max_swizzle, pdl);
  }
}

}  // namespace epmoe
