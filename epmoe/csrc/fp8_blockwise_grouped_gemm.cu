// Cooperative configuration (two consumer warpgroups share a 128-row tile): prefill-sized groups.
// See fp8_blockwise_grouped_gemm.cuh for the operands.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using CoopConfig = Fp8GroupedGemmConfig<
    Shape<_128, _128, _128>, Shape<_1, _2, _1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

void fp8_grouped_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                           const at::Tensor& b, const at::Tensor& b_scale,
                           const at::Tensor& offsets, int64_t raster_along_n,
                           int64_t max_swizzle) {
  run_fp8_grouped_gemm<CoopConfig>(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                   max_swizzle);
}

int64_t fp8_grouped_gemm_coop_workspace(int64_t num_groups, int64_t sm_count) {
  return workspace_size_for<CoopConfig>(num_groups, sm_count);
}

}  // namespace epmoe
