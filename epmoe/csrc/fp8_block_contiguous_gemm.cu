// The one configuration built: cooperative 128x192x128 tiles (two consumer warpgroups share a
// 128-row block), 2x1 clusters (the B tile multicast to two M blocks of one expert), weight
// scales in 64-column groups (a 192-column tile meets two 128-column weight blocks): DeepGEMM's
// choice for these shapes. See fp8_block_contiguous_gemm.cuh.
#include "fp8_block_contiguous_gemm.cuh"

namespace epmoe {

using CoopConfig = Fp8ContiguousGemmConfig<Shape<_128, _192, _128>, Shape<_2, _1, _1>, 64>;

void fp8_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale,
                              const at::Tensor& offsets, int64_t raster_along_n,
                              int64_t max_swizzle) {
  run_fp8_contiguous_gemm<CoopConfig>(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                      max_swizzle);
}

int64_t fp8_contiguous_gemm_coop_workspace(at::Tensor& out, const at::Tensor& a,
                                           const at::Tensor& a_scale, const at::Tensor& b,
                                           const at::Tensor& b_scale, int64_t sm_count) {
  return workspace_size_for<CoopConfig>(out, a, a_scale, b, b_scale, sm_count);
}

}  // namespace epmoe
