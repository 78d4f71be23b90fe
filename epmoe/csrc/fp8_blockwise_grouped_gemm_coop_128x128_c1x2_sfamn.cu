// Cooperative 128x128x128 tiles, cluster 1x2, activation scales MN-major ([K/128, M]): a tile's
// 128 row scales per K block are contiguous (4 sectors) instead of 128 strided loads.
// One configuration per translation unit so the build parallelises; see
// fp8_blockwise_grouped_gemm.cuh for the operands and fp8_blockwise_grouped_gemm_configs.h for the list.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using Cfg_coop_128x128_c1x2_sfamn = Fp8GroupedGemmConfig<
    Shape<_128, _128, _128>, Shape<_1, _2, _1>, CoopSchedule::Kernel, CoopSchedule::Epilogue,
    cute::GMMA::Major::MN>;
EPMOE_DEFINE_FP8_GEMM_CONFIG(coop_128x128_c1x2_sfamn, Cfg_coop_128x128_c1x2_sfamn)

}  // namespace epmoe
