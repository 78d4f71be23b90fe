// Ping-pong 128x128x128 tiles (each consumer warpgroup owns a 128x128 tile).
// 256 fp32 accumulator registers per thread (main + FP8 partial): ptxas spills a little.
// One configuration per translation unit so the build parallelises; see
// fp8_blockwise_grouped_gemm.cuh for the operands and fp8_blockwise_grouped_gemm_configs.h for the list.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using Cfg_pingpong_128x128_c1x1 = Fp8GroupedGemmConfig<
    Shape<_128, _128, _128>, Shape<_1, _1, _1>, PingpongSchedule::Kernel, PingpongSchedule::Epilogue>;
EPMOE_DEFINE_FP8_GEMM_CONFIG(pingpong_128x128_c1x1, Cfg_pingpong_128x128_c1x1)

}  // namespace epmoe
