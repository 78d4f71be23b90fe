// Cooperative 128x256x128 tiles (two 64x128 WGMMAs per warpgroup), cluster 2x1 (B multicast to the
// two M tiles of one expert).
// One configuration per translation unit so the build parallelises; see
// fp8_blockwise_grouped_gemm.cuh for the operands and fp8_blockwise_grouped_gemm_configs.h for the list.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using Cfg_coop_128x256_c2x1 = Fp8GroupedGemmConfig<
    Shape<_128, _256, _128>, Shape<_2, _1, _1>, CoopSchedule::Kernel, CoopSchedule::Epilogue,
    cute::GMMA::Major::K, /*MmaN=*/128>;
EPMOE_DEFINE_FP8_GEMM_CONFIG(coop_128x256_c2x1, Cfg_coop_128x256_c2x1)

}  // namespace epmoe
