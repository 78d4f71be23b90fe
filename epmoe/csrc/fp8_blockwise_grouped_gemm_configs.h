// The kernel configurations of the FP8 block-scaled grouped GEMM (see fp8_blockwise_grouped_gemm.cuh)
// as a registry the torch binding dispatches on. This header needs torch only (no CUTLASS): each
// configuration is compiled in its own translation unit, fp8_blockwise_grouped_gemm_<name>.cu,
// which defines fp8_gemm_config_<name>() with EPMOE_DEFINE_FP8_GEMM_CONFIG.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace epmoe {

using Fp8GemmRunFn = void (*)(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale,
                              const at::Tensor& offsets, int64_t raster_along_n,
                              int64_t max_swizzle);
using Fp8GemmWorkspaceFn = int64_t (*)(int64_t num_groups, int64_t sm_count);

struct Fp8GemmConfigEntry {
  const char* name;  // e.g. "coop_128x128_c1x2": schedule, tile MxN (K is 128), cluster MxN
  bool sfa_mn;       // activation scales MN-major ([K/128, M]) rather than K-major ([M, K/128])
  Fp8GemmRunFn run;
  Fp8GemmWorkspaceFn workspace;
};

// X(id, name): the config id is the index the op takes. Keep in the order of CONFIGS in
// epmoe/experts/cutlass_backend.py (checked when the library loads, through config_name()).
#define EPMOE_FP8_GEMM_CONFIGS(X)  \
  X(0, coop_128x128_c1x2)          \
  X(1, pingpong_64x128_c1x1)       \
  X(2, coop_128x128_c2x1)          \
  X(3, coop_128x256_c1x1)          \
  X(4, coop_128x256_c2x1)          \
  X(5, coop_256x128_c1x1)          \
  X(6, coop_256x128_c1x2)          \
  X(7, pingpong_128x128_c1x1)      \
  X(8, pingpong_64x256_c1x1)       \
  X(9, coop_128x128_c1x2_sfamn)    \
  X(10, coop_128x128_c2x1_sfamn)   \
  X(11, coop_128x256_c1x1_sfamn)

#define EPMOE_DECLARE_FP8_GEMM_CONFIG(id, name) const Fp8GemmConfigEntry& fp8_gemm_config_##name();
EPMOE_FP8_GEMM_CONFIGS(EPMOE_DECLARE_FP8_GEMM_CONFIG)
#undef EPMOE_DECLARE_FP8_GEMM_CONFIG

}  // namespace epmoe
