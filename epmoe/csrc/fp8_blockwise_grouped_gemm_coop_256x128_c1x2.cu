// Cooperative 256x128x128 tiles (each consumer warpgroup 128x128), cluster 1x2 (A multicast).
// One configuration per translation unit so the build parallelises; see
// fp8_blockwise_grouped_gemm.cuh for the operands and fp8_blockwise_grouped_gemm_configs.h for the list.
#include "fp8_blockwise_grouped_gemm.cuh"

namespace epmoe {

using Cfg_coop_256x128_c1x2 = Fp8GroupedGemmConfig<
    Shape<_256, _128, _128>, Shape<_1, _2, _1>, CoopSchedule::Kernel, CoopSchedule::Epilogue>;
EPMOE_DEFINE_FP8_GEMM_CONFIG(coop_256x128_c1x2, Cfg_coop_256x128_c1x2)

}  // namespace epmoe
