// The INT8 block-scaled GEMM's variant 1 (kInt8BlockVariants in block_scaled_contiguous_gemm.cuh:
// the kSplitN4 schedule from zero with the native conversion and the subtiled epilogue at every K,
// K blocks in runs (kUnroll2), 128 x 256 tiles); int8_block_contiguous_gemm.cu picks it at run time.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {
template void int8_block_gemm_variant<1>(at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, int64_t, bool);
}  // namespace epmoe
