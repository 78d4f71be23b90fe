// The configurations built: cooperative 128x192x128 tiles (two consumer warpgroups share a
// 128-row block), 2x1 clusters (the B tile multicast to two M blocks of one expert), weight
// scales in 64-column groups (a 192-column tile meets two 128-column weight blocks): DeepGEMM's
// choice for these shapes. The epilogue depends on K (see kWholeTileEpilogueMaxK).
// See fp8_block_contiguous_gemm.cuh.
#include "fp8_block_contiguous_gemm.cuh"

namespace epmoe {

using TileShape = Shape<_128, _192, _128>;
using ClusterShape = Shape<_2, _1, _1>;
// Whole-tile epilogue, four mainloop stages: the epilogue's fixed cost per tile weighs most when
// a tile has few k blocks.
using ShortKConfig = Fp8ContiguousGemmConfig<TileShape, ClusterShape, 64, true>;
// CUTLASS's subtiled epilogue, five mainloop stages: a deeper pipeline for long k loops.
using LongKConfig = Fp8ContiguousGemmConfig<TileShape, ClusterShape, 64, false>;
// On the H200 (session 11, docs/fp8.md) the whole-tile epilogue took GEMM2 (K = 2048) from 1.13
// to 1.08-1.10x DeepGEMM's time, and was 0-5 % slower on GEMM1 (K = 7168). The boundary between
// the two measured K is a choice.
constexpr int64_t kWholeTileEpilogueMaxK = 4096;

void fp8_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale,
                              const at::Tensor& offsets, int64_t raster_along_n,
                              int64_t max_swizzle) {
  if (b.size(2) <= kWholeTileEpilogueMaxK) {
    run_fp8_contiguous_gemm<ShortKConfig>(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                          max_swizzle);
  } else {
    run_fp8_contiguous_gemm<LongKConfig>(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                         max_swizzle);
  }
}

int64_t fp8_contiguous_gemm_coop_workspace(at::Tensor& out, const at::Tensor& a,
                                           const at::Tensor& a_scale, const at::Tensor& b,
                                           const at::Tensor& b_scale, int64_t sm_count) {
  return b.size(2) <= kWholeTileEpilogueMaxK
             ? workspace_size_for<ShortKConfig>(out, a, a_scale, b, b_scale, sm_count)
             : workspace_size_for<LongKConfig>(out, a, a_scale, b, b_scale, sm_count);
}

}  // namespace epmoe
