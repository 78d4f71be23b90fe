// The INT8 block-scaled GEMM's variant 6 (kInt8BlockVariants in block_scaled_contiguous_gemm.cuh:
// the kSplitN schedule from zero, 128 x 128 tiles); int8_block_contiguous_gemm.cu picks it at run time.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {
template void int8_block_gemm_variant<6>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          int64_t, int64_t, bool);
}  // namespace epmoe
