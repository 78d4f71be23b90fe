// The INT8 block-scaled GEMM's variant 3 (kInt8BlockVariants in block_scaled_contiguous_gemm.cuh:
// n256_quarters_run4 with the producers' backoff, kProducerBackoff); int8_block_contiguous_gemm.cu
// picks it at run time.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {
template void int8_block_gemm_variant<3>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, int64_t, bool);
}  // namespace epmoe
