// Torch-op registration of the CUTLASS GEMMs over the contiguous layout: FP8 and INT8
// block-scaled (block_scaled_contiguous_gemm.cuh) and INT8 channel-scaled
// (int8_channel_contiguous_gemm.cu). The Python wrappers (epmoe/experts/cutlass_backend.py) check
// every operand before calling these; the checks here guard direct callers of the ops.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <initializer_list>
#include <string>

namespace epmoe {
void fp8_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale,
                              const at::Tensor& offsets, int64_t raster_along_n,
                              int64_t max_swizzle, bool pdl);
int64_t fp8_contiguous_gemm_coop_workspace(at::Tensor& out, const at::Tensor& a,
                                           const at::Tensor& a_scale, const at::Tensor& b,
                                           const at::Tensor& b_scale, int64_t sm_count);
// segments, masked_max_m: the contiguous layout's [E+1] offsets and 0, or the masked layout's
// [E] masked_m and its rows per expert (a, a_scale and out then hold E * max_m rows).
void int8_block_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a,
                                     const at::Tensor& a_scale, const at::Tensor& b,
                                     const at::Tensor& b_scale, const at::Tensor& segments,
                                     int64_t masked_max_m, int64_t raster_along_n,
                                     int64_t max_swizzle, int64_t schedule, bool pdl);
// GEMM1 with the activation fused (silu_quant_epilogue.cuh): q [M, N/2] int8, q_scale [M, N/256].
void int8_block_silu_gemm_coop(at::Tensor& q, at::Tensor& q_scale, const at::Tensor& a,
                               const at::Tensor& a_scale, const at::Tensor& b,
                               const at::Tensor& b_scale, const at::Tensor& segments,
                               int64_t masked_max_m, int64_t raster_along_n, int64_t max_swizzle,
                               int64_t variant, bool pdl);
void int8_contiguous_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                               const at::Tensor& b, const at::Tensor& b_scale,
                               const at::Tensor& segments, int64_t masked_max_m,
                               int64_t raster_along_n, int64_t max_swizzle, bool pdl);
void int8_dense_gemm_coop(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                          const at::Tensor& b, const at::Tensor& b_scale, int64_t raster_along_n,
                          int64_t max_swizzle, bool pdl);
void int8_dense_gemm_pingpong(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                              const at::Tensor& b, const at::Tensor& b_scale,
                              int64_t raster_along_n, int64_t max_swizzle, bool pdl);
// int8_dense_gemm's kernel argument (epmoe.kernels.configs.CUTLASS_DENSE_KERNELS, in this order).
constexpr int64_t kInt8DenseCooperative = 0;
constexpr int64_t kInt8DensePingpong = 1;
constexpr int64_t kInt8BlockVariants = 3;  // kNumInt8BlockVariants in block_scaled_contiguous_gemm.cuh
constexpr int64_t kRowBlock = 128;
// kSiluQuantVariants in block_scaled_contiguous_gemm.cuh: the schedules with a fused GEMM1 (the
// two lists and SILU_FUSED_SCHEDULES are compared by tests/test_fp8_selection.py).
constexpr int64_t kSiluQuantVariants[] = {1, 2};
}  // namespace epmoe

namespace {

// a [M, K] and b [E, N, K] of one dtype, contiguous, every operand a CUDA tensor on a's device;
// K and N positive multiples of k_multiple and n_multiple (a K loop of no tile would wait
// forever) and M, N * K within int32.
void check_ab(const char* op, const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype,
              int64_t k_multiple, int64_t n_multiple, std::initializer_list<const at::Tensor*> others) {
  for (const at::Tensor* t : others) {
    TORCH_CHECK(t->is_cuda() && a.is_cuda() && t->device() == a.device(), op,
                ": every operand must be a CUDA tensor on a's device (", a.device(), ")");
  }
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == dtype && a.is_contiguous(), op,
              ": a must be a contiguous [M, K] ", dtype, " tensor");
  TORCH_CHECK(b.dim() == 3 && b.scalar_type() == dtype && b.is_contiguous(), op,
              ": b must be a contiguous [E, N, K] ", dtype, " tensor");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TORCH_CHECK(b.size(2) == k, op, ": a has K=", k, " but b has K=", b.size(2));
  TORCH_CHECK(k > 0 && k % k_multiple == 0, op, ": K=", k, " must be a positive multiple of ", k_multiple);
  TORCH_CHECK(n > 0 && n % n_multiple == 0, op, ": N=", n, " must be a positive multiple of ", n_multiple);
  TORCH_CHECK(m < (int64_t(1) << 31) && n * k < (int64_t(1) << 31), op, ": M=", m, " or N*K=",
              n * k, " exceeds int32");
}

// The block-scaled ops' inputs (FP8 e4m3 or INT8): K and N multiples of 128, 1x128 and 128x128
// scales; outputs: every tensor that must be on a's device besides them.
void check_inputs(const char* op, at::ScalarType dtype, const at::Tensor& a, const at::Tensor& a_scale,
                  const at::Tensor& b, const at::Tensor& b_scale,
                  std::initializer_list<const at::Tensor*> outputs) {
  check_ab(op, a, b, dtype, 128, 128, {&a_scale, &b, &b_scale});
  for (const at::Tensor* t : outputs) {
    TORCH_CHECK(t->is_cuda() && t->device() == a.device(), op,
                ": every operand must be a CUDA tensor on a's device (", a.device(), ")");
  }
  const int64_t m = a.size(0), k = a.size(1), e = b.size(0), n = b.size(1);
  // a_scale row-major, or the kernel's own MN-major layout seen transposed (strides (1, M4), M4 =
  // M rounded up to 4), which the kernels then read without a transposing copy.
  const int64_t m4 = (m + 3) / 4 * 4;
  const bool a_scale_mn = a_scale.dim() == 2 && a_scale.stride(0) == 1 && a_scale.stride(1) == m4;
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && (a_scale.is_contiguous() || a_scale_mn) &&
                  a_scale.dim() == 2 && a_scale.size(0) == m && a_scale.size(1) == k / 128,
              op, ": a_scale must be a contiguous (or MN-major, strides (1, M4)) fp32 [M, K/128] tensor");
  // One weight scale per 128x128 block, or the block scales already repeated to the kernels'
  // 64-column groups (kernel_scales checks that against the configuration).
  TORCH_CHECK(b_scale.scalar_type() == at::kFloat && b_scale.is_contiguous() &&
                  b_scale.dim() == 3 && b_scale.size(0) == e &&
                  (b_scale.size(1) == n / 128 || b_scale.size(1) == n / 64) &&
                  b_scale.size(2) == k / 128,
              op, ": b_scale must be a contiguous fp32 [E, N/128, K/128] (or [E, N/64, K/128]) tensor");
}

// check_inputs and a bf16 out [M, N].
void check_operands(const char* op, at::ScalarType dtype, const at::Tensor& out, const at::Tensor& a,
                    const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale) {
  check_inputs(op, dtype, a, a_scale, b, b_scale, {&out});
  const int64_t m = a.size(0), n = b.size(1);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == m && out.size(1) == n,
              op, ": out must be a contiguous bf16 [M, N] tensor");
}

void check_block_offsets_arg(const char* op, const at::Tensor& a, const at::Tensor& b,
                             const at::Tensor& offsets, int64_t max_swizzle) {
  TORCH_CHECK(offsets.is_cuda() && offsets.device() == a.device() &&
                  offsets.scalar_type() == at::kInt && offsets.is_contiguous() &&
                  offsets.dim() == 1 && offsets.size(0) == b.size(0) + 1,
              op, ": expert_offsets must be a contiguous int32 [E+1] CUDA tensor on a's device");
  TORCH_CHECK(max_swizzle >= 1, op, ": max_swizzle=", max_swizzle, " (allowed >= 1)");
}

// out[offsets[e]:offsets[e+1]] = dequant(a rows) @ dequant(b[e])^T, written in place. The offsets
// must be non-decreasing multiples of 128 within the rows of a; they stay on the device, where the
// kernel that maps row blocks to experts checks them (a device-side assert on a bad batch).
void fp8_contiguous_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                         const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& offsets,
                         int64_t raster_along_n, int64_t max_swizzle, bool pdl) {
  check_operands("fp8_contiguous_gemm", at::kFloat8_e4m3fn, out, a, a_scale, b, b_scale);
  check_block_offsets_arg("fp8_contiguous_gemm", a, b, offsets, max_swizzle);
  if (a.size(0) == 0 || b.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  epmoe::fp8_contiguous_gemm_coop(out, a, a_scale, b, b_scale, offsets, raster_along_n,
                                  max_swizzle, pdl);
}

void check_schedule(const char* op, int64_t schedule) {
  TORCH_CHECK(schedule >= 0 && schedule < epmoe::kInt8BlockVariants, op, ": schedule=", schedule,
              " (allowed 0 to ", epmoe::kInt8BlockVariants - 1, ")");
}

// The same contract with int8 operands: each 128-wide K block summed exactly in int32, promoted
// to fp32 with a_scale[row, kb] * b_scale[e, nb, kb]; schedule: the kernel's variant (an index of
// kInt8BlockVariants: how the consumer warpgroups overlap the MMAs and the promotion, and the tile
// width).
void int8_block_contiguous_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                                const at::Tensor& b, const at::Tensor& b_scale,
                                const at::Tensor& offsets, int64_t raster_along_n,
                                int64_t max_swizzle, int64_t schedule, bool pdl) {
  check_operands("int8_block_contiguous_gemm", at::kChar, out, a, a_scale, b, b_scale);
  check_block_offsets_arg("int8_block_contiguous_gemm", a, b, offsets, max_swizzle);
  check_schedule("int8_block_contiguous_gemm", schedule);
  if (a.size(0) == 0 || b.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  epmoe::int8_block_contiguous_gemm_coop(out, a, a_scale, b, b_scale, offsets, 0, raster_along_n,
                                         max_swizzle, schedule, pdl);
}

// The fused GEMM1's operands: check_inputs (int8), N a multiple of 256 (a tile is 128 gate rows
// and the same 128 up rows), q an int8 [M, N/2] with unit column stride and 16-byte aligned rows
// (the epilogue stores 16-byte chunks), q_scale an fp32 [M, N/256] (any strides), schedule one
// with a fused build.
void check_silu_operands(const char* op, const at::Tensor& q, const at::Tensor& q_scale,
                         const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                         const at::Tensor& b_scale, int64_t schedule) {
  check_inputs(op, at::kChar, a, a_scale, b, b_scale, {&q, &q_scale});
  const int64_t m = a.size(0), n = b.size(1);
  TORCH_CHECK(n % 256 == 0, op, ": N=", n, " must be a multiple of 256 (gate and up halves of 128-row blocks)");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(0) == m && q.size(1) == n / 2 &&
                  q.stride(1) == 1 && q.stride(0) >= n / 2 && q.stride(0) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0,
              op, ": q must be an int8 [M, N/2] tensor with unit column stride and rows 16-byte aligned; got ",
              q.sizes(), " with strides ", q.strides());
  TORCH_CHECK(q_scale.scalar_type() == at::kFloat && q_scale.dim() == 2 && q_scale.size(0) == m &&
                  q_scale.size(1) == n / 256,
              op, ": q_scale must be an fp32 [M, N/256] tensor; got ", q_scale.sizes());
  bool fused = false;
  std::string allowed;
  for (int64_t v : epmoe::kSiluQuantVariants) {
    fused |= v == schedule;
    allowed += (allowed.empty() ? "" : ", ") + std::to_string(v);
  }
  TORCH_CHECK(fused, op, ": schedule=", schedule, " has no fused build (allowed: ", allowed, ")");
}

// q, q_scale = silu(gate) * up of the block-scaled GEMM of the rows of each expert, quantized to
// 1x128 int8 (b's rows: w13's, gate rows then up rows); rows outside offsets[0]:
// offsets[E] are not written.
void int8_block_silu_gemm(at::Tensor q, at::Tensor q_scale, const at::Tensor& a,
                          const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
                          const at::Tensor& offsets, int64_t raster_along_n, int64_t max_swizzle,
                          int64_t schedule, bool pdl) {
  const char* op = "int8_block_silu_gemm";
  check_silu_operands(op, q, q_scale, a, a_scale, b, b_scale, schedule);
  check_block_offsets_arg(op, a, b, offsets, max_swizzle);
  if (a.size(0) == 0 || b.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  epmoe::int8_block_silu_gemm_coop(q, q_scale, a, a_scale, b, b_scale, offsets, 0, raster_along_n,
                                   max_swizzle, schedule, pdl);
}

// The masked layout's a [E, max_m, K], its scales [E, max_m, ...] and out [E, max_m, N] as the
// E * max_m rows the contiguous kernels take (views), after checking what the masked ops add:
// max_m a multiple of 128, masked_m a contiguous int32 [E] tensor on a's device.
struct MaskedRows {
  at::Tensor out, a, a_scale;
  int64_t max_m;
};
// out_shape: how the messages name out ("out ... [E, max_m, N]", or the fused GEMM1's q).
MaskedRows masked_rows(const char* op, const at::Tensor& out, const at::Tensor& a,
                       const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& masked_m,
                       const char* out_shape = "out must be a contiguous [E, max_m, N] tensor") {
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && b.dim() == 3 && a.size(0) == b.size(0), op,
              ": a must be a contiguous [E, max_m, K] tensor with b's E; got a ", a.sizes(),
              " and b ", b.sizes());
  const int64_t e = a.size(0), max_m = a.size(1);
  TORCH_CHECK(max_m % epmoe::kRowBlock == 0, op, ": max_m=", max_m, " must be a multiple of ",
              epmoe::kRowBlock);
  TORCH_CHECK(a_scale.dim() >= 2 && a_scale.size(0) == e && a_scale.size(1) == max_m &&
                  a_scale.is_contiguous(),
              op, ": a_scale must be a contiguous [E, max_m, ...] tensor; got ", a_scale.sizes());
  TORCH_CHECK(out.dim() == 3 && out.size(0) == e && out.size(1) == max_m && out.is_contiguous(), op,
              ": ", out_shape, "; got ", out.sizes());
  TORCH_CHECK(masked_m.is_cuda() && masked_m.device() == a.device() &&
                  masked_m.scalar_type() == at::kInt && masked_m.is_contiguous() &&
                  masked_m.dim() == 1 && masked_m.size(0) == e,
              op, ": masked_m must be a contiguous int32 [E] CUDA tensor on a's device");
  const int64_t rows = e * max_m;
  auto rest = a_scale.sizes().slice(2).vec();
  rest.insert(rest.begin(), rows);
  return {out.view({rows, out.size(2)}), a.view({rows, a.size(2)}), a_scale.view(rest), max_m};
}

// out[e, :masked_m[e]] = the block-scaled GEMM of a[e, :masked_m[e]] with b[e]; rows past
// masked_m[e] hold anything. masked_m stays on the device (checked there, as the offsets are).
void int8_block_masked_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                            const at::Tensor& b, const at::Tensor& b_scale,
                            const at::Tensor& masked_m, int64_t raster_along_n, int64_t max_swizzle,
                            int64_t schedule, bool pdl) {
  const char* op = "int8_block_masked_gemm";
  auto rows = masked_rows(op, out, a, a_scale, b, masked_m);
  check_operands(op, at::kChar, rows.out, rows.a, rows.a_scale, b, b_scale);
  TORCH_CHECK(max_swizzle >= 1, op, ": max_swizzle=", max_swizzle, " (allowed >= 1)");
  check_schedule(op, schedule);
  if (rows.a.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  epmoe::int8_block_contiguous_gemm_coop(rows.out, rows.a, rows.a_scale, b, b_scale, masked_m,
                                         rows.max_m, raster_along_n, max_swizzle, schedule, pdl);
}

// int8_block_silu_gemm on the masked layout: q [E, max_m, N/2], q_scale [E, max_m, N/256]
// contiguous; rows past masked_m[e] hold anything.
void int8_block_silu_masked_gemm(at::Tensor q, at::Tensor q_scale, const at::Tensor& a,
                                 const at::Tensor& a_scale, const at::Tensor& b,
                                 const at::Tensor& b_scale, const at::Tensor& masked_m,
                                 int64_t raster_along_n, int64_t max_swizzle, int64_t schedule,
                                 bool pdl) {
  const char* op = "int8_block_silu_masked_gemm";
  auto rows = masked_rows(op, q, a, a_scale, b, masked_m, "q must be a contiguous [E, max_m, N/2] tensor");
  TORCH_CHECK(q_scale.dim() == 3 && q_scale.size(0) == a.size(0) && q_scale.size(1) == rows.max_m &&
                  q_scale.is_contiguous(),
              op, ": q_scale must be a contiguous [E, max_m, N/256] tensor; got ", q_scale.sizes());
  at::Tensor row_scales = q_scale.view({rows.a.size(0), q_scale.size(2)});
  check_silu_operands(op, rows.out, row_scales, rows.a, rows.a_scale, b, b_scale, schedule);
  TORCH_CHECK(max_swizzle >= 1, op, ": max_swizzle=", max_swizzle, " (allowed >= 1)");
  if (rows.a.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  epmoe::int8_block_silu_gemm_coop(rows.out, row_scales, rows.a, rows.a_scale, b, b_scale, masked_m,
                                   rows.max_m, raster_along_n, max_swizzle, schedule, pdl);
}

// The INT8 channel-scaled op's operands (named op in the messages): a [M, K], a_scale [M] or
// [M, 1], b [E, N, K], b_scale [E, N] or [E, N, 1], out bf16 [M, N].
void check_int8_channel(const char* op, const at::Tensor& out, const at::Tensor& a,
                        const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale) {
  // K in 16-byte TMA rows of A and B; N in 16-byte rows of the bf16 output.
  check_ab(op, a, b, at::kChar, 16, 8, {&a_scale, &b, &b_scale, &out});
  const int64_t m = a.size(0), e = b.size(0), n = b.size(1);
  const bool a_scale_ok = a_scale.dim() == 1 ? a_scale.size(0) == m
                                             : a_scale.dim() == 2 && a_scale.size(0) == m && a_scale.size(1) == 1;
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && a_scale.is_contiguous() && a_scale_ok,
              op, ": a_scale must be a contiguous fp32 [M] or [M, 1] tensor, M=", m,
              "; got ", a_scale.sizes());
  const bool b_scale_ok =
      b_scale.size(0) == e && b_scale.size(1) == n &&
      (b_scale.dim() == 2 || (b_scale.dim() == 3 && b_scale.size(2) == 1));
  TORCH_CHECK(b_scale.scalar_type() == at::kFloat && b_scale.is_contiguous() && b_scale.dim() >= 2 &&
                  b_scale_ok,
              op, ": b_scale must be a contiguous fp32 [E, N] or [E, N, 1] tensor, E=", e,
              ", N=", n, "; got ", b_scale.sizes());
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == m && out.size(1) == n,
              op, ": out must be a contiguous bf16 [M, N] tensor");
}

// out[offsets[e]:offsets[e+1]] = (a rows @ b[e]^T) * a_scale[rows] * b_scale[e], bf16, int32 K sum;
// offsets as in fp8_contiguous_gemm (checked on the device); raster_along_n, max_swizzle: the
// persistent tiles' walk (the same sums whichever).
void int8_contiguous_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                          const at::Tensor& b, const at::Tensor& b_scale,
                          const at::Tensor& offsets, int64_t raster_along_n, int64_t max_swizzle,
                          bool pdl) {
  check_int8_channel("int8_contiguous_gemm", out, a, a_scale, b, b_scale);
  TORCH_CHECK(max_swizzle >= 1, "int8_contiguous_gemm: max_swizzle=", max_swizzle, " (allowed >= 1)");
  TORCH_CHECK(offsets.is_cuda() && offsets.device() == a.device(),
              "int8_contiguous_gemm: expert_offsets must be on a's device");
  const int64_t m = a.size(0), e = b.size(0);
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.is_contiguous() && offsets.dim() == 1 &&
                  offsets.size(0) == e + 1,
              "int8_contiguous_gemm: expert_offsets must be a contiguous int32 [E+1] tensor");
  if (m == 0 || e == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  epmoe::int8_contiguous_gemm_coop(out, a, a_scale, b, b_scale, offsets, 0, raster_along_n,
                                   max_swizzle, pdl);
}

// out = (a @ b[0]^T) * a_scale * b_scale[0] for one weight (b [1, N, K]) over every row of a, whose
// rows are a multiple of 128 (a dense linear's, padded): no offsets, no block table. kernel: 0 the
// cooperative kernel (128 x 256 tiles), 1 the pingpong one (128 x 128 tiles, one warpgroup's
// epilogue under the other's MMAs); the same int32 sums and epilogue, so the same bits.
void int8_dense_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                     const at::Tensor& b, const at::Tensor& b_scale, int64_t raster_along_n,
                     int64_t max_swizzle, bool pdl, int64_t kernel) {
  check_int8_channel("int8_dense_gemm", out, a, a_scale, b, b_scale);
  TORCH_CHECK(b.size(0) == 1, "int8_dense_gemm: b must hold one weight, [1, N, K]; got ", b.sizes());
  TORCH_CHECK(a.size(0) % epmoe::kRowBlock == 0, "int8_dense_gemm: the rows of a (", a.size(0),
              ") must be a multiple of ", epmoe::kRowBlock);
  TORCH_CHECK(max_swizzle >= 1, "int8_dense_gemm: max_swizzle=", max_swizzle, " (allowed >= 1)");
  TORCH_CHECK(kernel == epmoe::kInt8DenseCooperative || kernel == epmoe::kInt8DensePingpong,
              "int8_dense_gemm: kernel=", kernel, " (allowed ", epmoe::kInt8DenseCooperative,
              ": cooperative, ", epmoe::kInt8DensePingpong, ": pingpong)");
  if (a.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  const auto run = kernel == epmoe::kInt8DensePingpong ? epmoe::int8_dense_gemm_pingpong
                                                       : epmoe::int8_dense_gemm_coop;
  run(out, a, a_scale, b, b_scale, raster_along_n, max_swizzle, pdl);
}

// out[e, :masked_m[e]] = (a[e] @ b[e]^T) * a_scale[e] * b_scale[e] over the masked layout
// (a [E, max_m, K], a_scale [E, max_m, 1] or [E, max_m]); rows past masked_m[e] hold anything.
void int8_masked_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                      const at::Tensor& b, const at::Tensor& b_scale, const at::Tensor& masked_m,
                      bool pdl) {
  auto rows = masked_rows("int8_masked_gemm", out, a, a_scale, b, masked_m);
  check_int8_channel("int8_masked_gemm", rows.out, rows.a, rows.a_scale, b, b_scale);
  if (rows.a.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(a.device());
  epmoe::int8_contiguous_gemm_coop(rows.out, rows.a, rows.a_scale, b, b_scale, masked_m, rows.max_m,
                                   1, 1, pdl);
}

// Bytes of workspace GemmKernel::get_workspace_size asks for on this problem and SM count.
int64_t workspace_size(at::Tensor out, const at::Tensor& a, const at::Tensor& a_scale,
                       const at::Tensor& b, const at::Tensor& b_scale, int64_t sm_count) {
  check_operands("workspace_size", at::kFloat8_e4m3fn, out, a, a_scale, b, b_scale);
  return epmoe::fp8_contiguous_gemm_coop_workspace(out, a, a_scale, b, b_scale, sm_count);
}

}  // namespace

// Registered as torch ops (torch.ops.<TORCH_EXTENSION_NAME>.*), not as a Python module, so the
// library depends on libtorch's C++ ABI only and not on the Python version it was built with.
// TORCH_LIBRARY stringifies its argument: expand TORCH_EXTENSION_NAME (set by torch's builder) first.
#define EPMOE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define EPMOE_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

EPMOE_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def(
      "fp8_contiguous_gemm(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor expert_offsets, int raster_along_n=1, int max_swizzle=1, bool pdl=False) -> ()");
  m.def(
      "workspace_size(Tensor out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "int sm_count) -> int");
  m.def(
      "int8_contiguous_gemm(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor expert_offsets, int raster_along_n=1, int max_swizzle=1, bool pdl=False) -> ()");
  m.def(
      "int8_block_contiguous_gemm(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, "
      "Tensor b_scale, Tensor expert_offsets, int raster_along_n=1, int max_swizzle=1, "
      "int schedule=2, bool pdl=False) -> ()");
  m.def(
      "int8_block_masked_gemm(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, "
      "Tensor b_scale, Tensor masked_m, int raster_along_n=1, int max_swizzle=1, "
      "int schedule=2, bool pdl=False) -> ()");
  m.def(
      "int8_block_silu_gemm(Tensor(a!) q, Tensor(b!) q_scale, Tensor a, Tensor a_scale, Tensor b, "
      "Tensor b_scale, Tensor expert_offsets, int raster_along_n=1, int max_swizzle=1, "
      "int schedule=2, bool pdl=False) -> ()");
  m.def(
      "int8_block_silu_masked_gemm(Tensor(a!) q, Tensor(b!) q_scale, Tensor a, Tensor a_scale, "
      "Tensor b, Tensor b_scale, Tensor masked_m, int raster_along_n=1, int max_swizzle=1, "
      "int schedule=2, bool pdl=False) -> ()");
  m.def(
      "int8_masked_gemm(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "Tensor masked_m, bool pdl=False) -> ()");
  m.def(
      "int8_dense_gemm(Tensor(a!) out, Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, "
      "int raster_along_n=1, int max_swizzle=1, bool pdl=False, int kernel=0) -> ()");
}

EPMOE_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CUDA, m) {
  m.impl("fp8_contiguous_gemm", &fp8_contiguous_gemm);
  m.impl("workspace_size", &workspace_size);
  m.impl("int8_contiguous_gemm", &int8_contiguous_gemm);
  m.impl("int8_block_contiguous_gemm", &int8_block_contiguous_gemm);
  m.impl("int8_block_masked_gemm", &int8_block_masked_gemm);
  m.impl("int8_block_silu_gemm", &int8_block_silu_gemm);
  m.impl("int8_block_silu_masked_gemm", &int8_block_silu_masked_gemm);
  m.impl("int8_masked_gemm", &int8_masked_gemm);
  m.impl("int8_dense_gemm", &int8_dense_gemm);
}
