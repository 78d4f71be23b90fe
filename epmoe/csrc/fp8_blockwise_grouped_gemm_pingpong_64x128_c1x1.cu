// Ping-pong 64x128x128 tiles: decode-sized groups, where a 128-row tile would be mostly padding.
// One configuration per translation unit so the build parallelises; see
// fp8_blockwise_grouped_gemm.cuh for the operands and fp8_blockwise_grouped_gemm_configs.h for the list.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using Cfg_pingpong_64x128_c1x1 = Fp8GroupedGemmConfig<
    Shape<_64, _128, _128>, Shape<_1, _1, _1>, PingpongSchedule::Kernel, PingpongSchedule::Epilogue>;
EPMOE_DEFINE_FP8_GEMM_CONFIG(pingpong_64x128_c1x1, Cfg_pingpong_64x128_c1x1)

}  // namespace epmoe
