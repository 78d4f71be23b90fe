// Ping-pong 64x256x128 tiles (each consumer warpgroup owns a 64x256 tile, two 64x128 WGMMAs).
// One configuration per translation unit so the build parallelises; see
// fp8_blockwise_grouped_gemm.cuh for the operands and fp8_blockwise_grouped_gemm_configs.h for the list.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using Cfg_pingpong_64x256_c1x1 = Fp8GroupedGemmConfig<
    Shape<_64, _256, _128>, Shape<_1, _1, _1>, PingpongSchedule::Kernel, PingpongSchedule::Epilogue,
    cute::GMMA::Major::K, /*MmaN=*/128>;
EPMOE_DEFINE_FP8_GEMM_CONFIG(pingpong_64x256_c1x1, Cfg_pingpong_64x256_c1x1)

}  // namespace epmoe
