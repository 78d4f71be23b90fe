// The INT8 channel-scaled GEMM (int8_channel_gemm.cuh: the contract and the kernel's configuration)
// on CUTLASS's cooperative kernel: over the contiguous and the masked expert layouts, and over one
// dense weight (int8_dense_gemm's kernel 0; int8_dense_pingpong_gemm.cu builds its kernel 1).
#include "int8_channel_gemm.cuh"

namespace epmoe {

// 128 x 256 tiles (two consumer warpgroups of 64 x 256, 128 int32 accumulators per thread): N =
// 4096 and 7168 are whole multiples, and a wide tile reads less shared memory per MMA.
using Int8Config = Int8ContiguousGemmConfig<Shape<_128, _256, _128>, Shape<_1, _2, _1>>;

// segments, masked_max_m: the contiguous layout's offsets (0) or the masked layout's masked_m and
// rows per expert (expert_block_table).
void int8_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                               const at::Tensor& b, const at::Tensor& b_scale,
                               const at::Tensor& segments, int64_t masked_max_m,
                               int64_t raster_along_n, int64_t max_swizzle, bool pdl) {
  auto block_expert = expert_block_table(a, segments, masked_max_m, pdl);
  run_int8_gemm<Int8Config>(out, a, a_scale, b, b_scale, block_expert.data_ptr<int32_t>(),
                            raster_along_n, max_swizzle, pdl);
}

// One weight over every row of a (a dense linear, b [1, N, K], rows a multiple of 128): the same
// kernel with no block table, so no offsets tensor and no table-building launch per call.
void int8_dense_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                          const at::Tensor& b, const at::Tensor& b_scale, int64_t raster_along_n,
                          int64_t max_swizzle, bool pdl) {
  run_int8_gemm<Int8Config>(out, a, a_scale, b, b_scale, nullptr, raster_along_n, max_swizzle, pdl);
}

}  // namespace epmoe
