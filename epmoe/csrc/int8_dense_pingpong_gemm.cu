// The dense INT8 channel-scaled GEMM (int8_dense_gemm's kernel 1) on CUTLASS's pingpong kernel:
// two consumer warpgroups on tiles of their own, taking turns at the MMAs, so that one's epilogue
// (the scaling and the bf16 store) runs under the other's mainloop. The cooperative kernel
// (int8_channel_contiguous_gemm.cu) puts both warpgroups on one tile and leaves its epilogue
// un-overlapped: a large share of a tile's time where K is short (K = 1536, 2048: 12 or 16 K
// blocks a tile).
//
// Dense only (no block table), refused otherwise at compile time (ScheduleTraits,
// make_int8_arguments): the pingpong kernel's second consumer advances to its first tile before
// the scheduler's PDL wait, and stepping over skipped blocks reads the table. The scheduler still
// skips here, the M blocks a swizzle rounds the grid up to past the rows; it walks the same tiles
// for the producer (one tile a step) and the two consumers (two a step, one apart) because
// advance_to_next_work counts tiles of the walk, not grid strides.
#include "int8_channel_gemm.cuh"

namespace epmoe {

// 128 x 128 tiles: each warpgroup holds a whole tile's accumulators, 128 x 128 / 128 threads = 128
// int32 registers a thread, as many as the cooperative kernel's 128 x 256 tile split in two (a
// wider one would not fit in the registers). Clusters of two N tiles of one 128-row block multicast
// the A tile, as the cooperative kernel's do (vLLM's pingpong INT8 GEMMs pair M tiles instead,
// 2 x 1; here that would park the odd block's partner past M, see parked_block_offset, and
// Int8ContiguousGemmConfig keeps to 1 x 2 for the expert layouts).
using Int8PingpongConfig =
    Int8ContiguousGemmConfig<Shape<_128, _128, _128>, Shape<_1, _2, _1>,
                             cutlass::gemm::KernelTmaWarpSpecializedPingpong>;

// As int8_dense_gemm_coop (int8_channel_contiguous_gemm.cu), on the pingpong kernel.
void int8_dense_gemm_pingpong(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale,
                              int64_t raster_along_n, int64_t max_swizzle, bool pdl) {
  run_int8_gemm<Int8PingpongConfig>(out, a, a_scale, b, b_scale, nullptr, raster_along_n,
                                    max_swizzle, pdl);
}

}  // namespace epmoe
