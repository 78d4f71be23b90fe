// Torch-op registration of the FP8 block-scaled grouped GEMM (see fp8_blockwise_grouped_gemm.cuh).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/ATen.h>

namespace epmoe {
void fp8_grouped_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                           const at::Tensor& b, const at::Tensor& b_scale,
                           const at::Tensor& offsets, int64_t raster_along_n,
                           int64_t max_swizzle);
void fp8_grouped_gemm_pingpong(at::Tensor& out, const at::Tensor& a,
                               const at::Tensor& a_scale, const at::Tensor& b,
                               const at::Tensor& b_scale, const at::Tensor& offsets,
                               int64_t raster_along_n, int64_t max_swizzle);
int64_t fp8_grouped_gemm_coop_workspace(int64_t num_groups, int64_t sm_count);
int64_t fp8_grouped_gemm_pingpong_workspace(int64_t num_groups, int64_t sm_count);
}  // namespace epmoe

namespace {

void check_operands(const at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                    const at::Tensor& b, const at::Tensor& b_scale,
                    const at::Tensor& offsets) {
  TORCH_CHECK(a.is_cuda() && a_scale.is_cuda() && b.is_cuda() && b_scale.is_cuda() &&
                  offsets.is_cuda() && out.is_cuda(),
              "fp8_grouped_gemm: all operands must be CUDA tensors");
  const auto dev = a.device();
  for (const at::Tensor* t : {&a_scale, &b, &b_scale, &offsets, &out}) {
    TORCH_CHECK(t->device() == dev, "fp8_grouped_gemm: operands on different devices");
  }
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat8_e4m3fn && a.is_contiguous(),
              "fp8_grouped_gemm: a must be a contiguous [M, K] float8_e4m3fn tensor");
  TORCH_CHECK(b.dim() == 3 && b.scalar_type() == at::kFloat8_e4m3fn && b.is_contiguous(),
              "fp8_grouped_gemm: b must be a contiguous [E, N, K] float8_e4m3fn tensor");
  const int64_t m = a.size(0), k = a.size(1), e = b.size(0), n = b.size(1);
  TORCH_CHECK(b.size(2) == k, "fp8_grouped_gemm: a has K=", k, " but b has K=", b.size(2));
  TORCH_CHECK(k % 128 == 0 && n % 128 == 0, "fp8_grouped_gemm: N=", n, " and K=", k,
              " must be multiples of 128");
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && a_scale.is_contiguous() &&
                  a_scale.dim() == 2 && a_scale.size(0) == m && a_scale.size(1) == k / 128,
              "fp8_grouped_gemm: a_scale must be a contiguous fp32 [M, K/128] tensor");
  TORCH_CHECK(b_scale.scalar_type() == at::kFloat && b_scale.is_contiguous() &&
                  b_scale.dim() == 3 && b_scale.size(0) == e && b_scale.size(1) == n / 128 &&
                  b_scale.size(2) == k / 128,
              "fp8_grouped_gemm: b_scale must be a contiguous fp32 [E, N/128, K/128] tensor");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() && offsets.dim() == 1 &&
                  offsets.size(0) == e + 1,
              "fp8_grouped_gemm: expert_offsets must be a contiguous int32 [E+1] tensor");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == m && out.size(1) == n,
              "fp8_grouped_gemm: out must be a contiguous bf16 [M, N] tensor");
}

// out[offsets[e]:offsets[e+1]] = dequant(a rows) @ dequant(b[e])^T, written in place.
// config: 0 = cooperative 128x128x128 (cluster 1x2), 1 = ping-pong 64x128x128.
void fp8_grouped_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                      const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& offsets,
                      int64_t config, int64_t raster_along_n, int64_t max_swizzle) {
  check_operands(out, a, a_scale, b, b_scale, offsets);
  if (a.size(0) == 0 || b.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  if (config == 0) {
    epmoe::fp8_grouped_gemm_coop(out, a, a_scale, b, b_scale, offsets, raster_along_n, max_swizzle);
  } else if (config == 1) {
    epmoe::fp8_grouped_gemm_pingpong(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                     max_swizzle);
  } else {
    TORCH_CHECK(false, "fp8_grouped_gemm: config=", config, " (allowed: 0 coop, 1 pingpong)");
  }
}

// Bytes of workspace GemmKernel::get_workspace_size asks for (config, groups, SM count).
int64_t workspace_size(int64_t config, int64_t num_groups, int64_t sm_count) {
  if (config == 0) return epmoe::fp8_grouped_gemm_coop_workspace(num_groups, sm_count);
  if (config == 1) return epmoe::fp8_grouped_gemm_pingpong_workspace(num_groups, sm_count);
  TORCH_CHECK(false, "workspace_size: config=", config, " (allowed: 0 coop, 1 pingpong)");
}

}  // namespace

// Registered as torch ops (torch.ops.<TORCH_EXTENSION_NAME>.*), not as a Python module, so the
// library depends on libtorch's C++ ABI only and not on the Python version it was built with.
// TORCH_LIBRARY stringifies its argument: expand TORCH_EXTENSION_NAME (set by torch's builder) first.
#define EPMOE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define EPMOE_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

EPMOE_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def(
      "fp8_grouped_gemm(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor expert_offsets, int config=0, int raster_along_n=0, int max_swizzle=1) -> ()");
  m.def("workspace_size(int config, int num_groups, int sm_count) -> int", &workspace_size);
}

EPMOE_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) { m.impl("fp8_grouped_gemm", &fp8_grouped_gemm); }
