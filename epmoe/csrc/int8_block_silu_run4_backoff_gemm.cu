// GEMM1 with the fused activation (int8_block_silu_gemm.cu) on the INT8 block kernel's variant 3
// (n256_quarters_run4_backoff); int8_block_silu_gemm.cu picks it at run time.
#include "block_scaled_contiguous_gemm.cuh"

namespace epmoe {
template void int8_block_silu_gemm_variant<3>(at::Tensor&, at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, const at::Tensor&, int64_t,
                                              int64_t, bool);
}  // namespace epmoe
