// Ping-pong configuration (64-row tiles, two consumer warpgroups alternate tiles): decode-sized
// groups, where a 128-row tile would be mostly padding. See fp8_blockwise_grouped_gemm.cuh.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using PingpongConfig = Fp8GroupedGemmConfig<
    Shape<_64, _128, _128>, Shape<_1, _1, _1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

void fp8_grouped_gemm_pingpong(at::Tensor& out, const at::Tensor& a,
                               const at::Tensor& a_scale, const at::Tensor& b,
                               const at::Tensor& b_scale, const at::Tensor& offsets,
                               int64_t raster_along_n, int64_t max_swizzle) {
  run_fp8_grouped_gemm<PingpongConfig>(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                       max_swizzle);
}

int64_t fp8_grouped_gemm_pingpong_workspace(int64_t num_groups, int64_t sm_count) {
  return workspace_size_for<PingpongConfig>(num_groups, sm_count);
}

}  // namespace epmoe
