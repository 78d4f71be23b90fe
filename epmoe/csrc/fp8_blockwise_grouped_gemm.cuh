// FP8 e4m3 grouped GEMM with 1x128 activation scales and 128x128 weight scales on Hopper (sm_90a),
// over the contiguous expert layout of epmoe.
//
//   out[rows of expert e] = (A[rows] * SFA[rows]) @ (B[e] * SFB[e])^T      (bf16 out, fp32 accumulate)
//
// A      [M, K]   float8_e4m3fn, row-major (K-major); rows of expert e are offsets[e]:offsets[e+1]
// SFA    [M, K/128] fp32 row-major: one multiplier per 1x128 group of A
// B      [E, N, K] float8_e4m3fn, contiguous (each expert's weight is N x K, K-major)
// SFB    [E, ceil(N/128), ceil(K/128)] fp32 contiguous: one multiplier per 128x128 block of B
// out    [M, N]   bf16 row-major
//
// Built on CUTLASS 3.x/4.x: the ptr-array ("grouped") TMA warp-specialized kernel with FP8 block
// scaling (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8BlockScaledAccum) and the
// Sm90BlockwiseScaleConfig<1, 128, 128, K-major, K-major> scale layouts, in the way of CUTLASS's
// public example 68 (hopper_fp8_warp_specialized_grouped_gemm_with_blockwise_scaling).
//
// Per-group problem sizes, pointers, strides and scale layouts are written on the GPU by a small
// kernel from expert_offsets (no host synchronisation); an expert with no rows gets M = 0 and the
// tile scheduler gives it no work. The workspace is what GemmKernel::get_workspace_size asks for,
// allocated with torch on the current stream.
#pragma once

#include <cstdint>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ATen.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace epmoe {

using namespace cute;

#define EPMOE_CHECK_CUTLASS(status, what)                                                          \
  TORCH_CHECK((status) == cutlass::Status::kSuccess, "epmoe CUTLASS FP8 grouped GEMM: ", what,   \
              " failed: ", cutlassGetStatusString(status))

// One kernel configuration: tile shape, cluster shape and mainloop/epilogue schedules.
template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_>
struct Fp8GroupedGemmConfig {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group

  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementC = void;  // no source operand: D = A @ B^T
  using ElementD = cutlass::bfloat16_t;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementBlockScale = float;

  using LayoutA = cutlass::layout::RowMajor;     // A [M, K], K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // B as K x N column-major = [N, K] K-major
  using LayoutC = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;

  static constexpr int AlignmentA = 128 / cutlass::sizeof_bits<ElementA>::value;
  static constexpr int AlignmentB = 128 / cutlass::sizeof_bits<ElementB>::value;
  static constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int AlignmentC = AlignmentD;

  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using KernelSchedule = KernelSchedule_;
  using EpilogueSchedule = EpilogueSchedule_;

  // 1x128 activation groups and 128x128 weight blocks, both K-major (row-major scale tensors).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute,
      ElementC, LayoutC*, AlignmentC, ElementD, LayoutD*, AlignmentD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC,
                                                   ElementCompute>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, AlignmentA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      AlignmentB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using UnderlyingProblemShape = typename ProblemShape::UnderlyingProblemShape;
};

// Writes the per-group arguments of expert e (one thread per expert).
template <class Cfg>
__global__ void fill_group_args_kernel(
    int num_groups, int n, int k, const int32_t* __restrict__ offsets,
    const typename Cfg::ElementA* a, const float* sfa, const typename Cfg::ElementB* b,
    const float* sfb, typename Cfg::ElementD* d,
    typename Cfg::UnderlyingProblemShape* problem_sizes, const typename Cfg::ElementA** ptr_a,
    const typename Cfg::ElementB** ptr_b, typename Cfg::ElementD** ptr_d, const float** ptr_sfa,
    const float** ptr_sfb, typename Cfg::StrideA* stride_a, typename Cfg::StrideB* stride_b,
    typename Cfg::StrideD* stride_d, typename Cfg::LayoutSFA* layout_sfa,
    typename Cfg::LayoutSFB* layout_sfb) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_groups) return;
  int64_t start = offsets[e];
  int m = static_cast<int>(offsets[e + 1] - start);
  if (m < 0) m = 0;  // malformed offsets: do nothing for this group rather than read past it
  const int64_t sk = (k + 127) / 128;  // scale columns of A per row
  const int64_t nb = (n + 127) / 128;  // scale rows of B per expert
  problem_sizes[e] = typename Cfg::UnderlyingProblemShape(m, n, k);
  ptr_a[e] = a + start * k;
  ptr_b[e] = b + static_cast<int64_t>(e) * n * k;
  ptr_d[e] = d + start * n;
  ptr_sfa[e] = sfa + start * sk;
  ptr_sfb[e] = sfb + static_cast<int64_t>(e) * nb * sk;
  typename Cfg::StrideA sa{};
  cute::get<0>(sa) = static_cast<int64_t>(k);
  typename Cfg::StrideB sb{};
  cute::get<0>(sb) = static_cast<int64_t>(k);
  typename Cfg::StrideD sd{};
  cute::get<0>(sd) = static_cast<int64_t>(n);
  stride_a[e] = sa;
  stride_b[e] = sb;
  stride_d[e] = sd;
  layout_sfa[e] = Cfg::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  layout_sfb[e] = Cfg::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Runs the grouped GEMM for configuration Cfg. Shapes were checked by the caller.
template <class Cfg>
void run_fp8_grouped_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                          const at::Tensor& b, const at::Tensor& b_scale,
                          const at::Tensor& offsets, int64_t raster_along_n,
                          int64_t max_swizzle) {
  using Gemm = typename Cfg::Gemm;
  using ElementA = typename Cfg::ElementA;
  using ElementB = typename Cfg::ElementB;
  using ElementD = typename Cfg::ElementD;
  using Problem = typename Cfg::UnderlyingProblemShape;

  const int num_groups = static_cast<int>(b.size(0));
  const int n = static_cast<int>(b.size(1));
  const int k = static_cast<int>(b.size(2));
  auto stream = at::cuda::getCurrentCUDAStream(a.get_device());

  // One torch allocation holds every per-group array (16-byte aligned sub-buffers).
  const int64_t g = num_groups;
  int64_t off = 0;
  auto carve = [&](int64_t bytes) {
    int64_t at = off;
    off = align_up(off + bytes, 16);
    return at;
  };
  const int64_t o_problem = carve(g * sizeof(Problem));
  const int64_t o_ptr_a = carve(g * sizeof(void*));
  const int64_t o_ptr_b = carve(g * sizeof(void*));
  const int64_t o_ptr_d = carve(g * sizeof(void*));
  const int64_t o_ptr_sfa = carve(g * sizeof(void*));
  const int64_t o_ptr_sfb = carve(g * sizeof(void*));
  const int64_t o_stride_a = carve(g * sizeof(typename Cfg::StrideA));
  const int64_t o_stride_b = carve(g * sizeof(typename Cfg::StrideB));
  const int64_t o_stride_d = carve(g * sizeof(typename Cfg::StrideD));
  const int64_t o_layout_sfa = carve(g * sizeof(typename Cfg::LayoutSFA));
  const int64_t o_layout_sfb = carve(g * sizeof(typename Cfg::LayoutSFB));
  auto args_buf = at::empty({off}, a.options().dtype(at::kByte));
  uint8_t* base = args_buf.data_ptr<uint8_t>();

  auto* problem_sizes = reinterpret_cast<Problem*>(base + o_problem);
  auto* ptr_a = reinterpret_cast<const ElementA**>(base + o_ptr_a);
  auto* ptr_b = reinterpret_cast<const ElementB**>(base + o_ptr_b);
  auto* ptr_d = reinterpret_cast<ElementD**>(base + o_ptr_d);
  auto* ptr_sfa = reinterpret_cast<const float**>(base + o_ptr_sfa);
  auto* ptr_sfb = reinterpret_cast<const float**>(base + o_ptr_sfb);
  auto* stride_a = reinterpret_cast<typename Cfg::StrideA*>(base + o_stride_a);
  auto* stride_b = reinterpret_cast<typename Cfg::StrideB*>(base + o_stride_b);
  auto* stride_d = reinterpret_cast<typename Cfg::StrideD*>(base + o_stride_d);
  auto* layout_sfa = reinterpret_cast<typename Cfg::LayoutSFA*>(base + o_layout_sfa);
  auto* layout_sfb = reinterpret_cast<typename Cfg::LayoutSFB*>(base + o_layout_sfb);

  const int threads = 128;
  fill_group_args_kernel<Cfg><<<(num_groups + threads - 1) / threads, threads, 0, stream>>>(
      num_groups, n, k, offsets.data_ptr<int32_t>(),
      reinterpret_cast<const ElementA*>(a.data_ptr()), a_scale.data_ptr<float>(),
      reinterpret_cast<const ElementB*>(b.data_ptr()), b_scale.data_ptr<float>(),
      reinterpret_cast<ElementD*>(out.data_ptr()), problem_sizes, ptr_a, ptr_b, ptr_d, ptr_sfa,
      ptr_sfb, stride_a, stride_b, stride_d, layout_sfa, layout_sfb);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = a.get_device();
  hw_info.sm_count = at::cuda::getDeviceProperties(a.get_device())->multiProcessorCount;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_groups, problem_sizes, nullptr},  // no host copy of the problem sizes: no sync
      {ptr_a, stride_a, ptr_b, stride_b, ptr_sfa, layout_sfa, ptr_sfb, layout_sfb},
      {{}, nullptr, nullptr, ptr_d, stride_d},
      hw_info};
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = static_cast<int>(max_swizzle);

  Gemm gemm;
  EPMOE_CHECK_CUTLASS(gemm.can_implement(args), "can_implement");
  const size_t workspace_bytes = Gemm::get_workspace_size(args);
  auto workspace =
      at::empty({static_cast<int64_t>(workspace_bytes) > 0 ? static_cast<int64_t>(workspace_bytes) : 1},
                   a.options().dtype(at::kByte));
  EPMOE_CHECK_CUTLASS(gemm.initialize(args, workspace.data_ptr(), stream), "initialize");
  EPMOE_CHECK_CUTLASS(gemm.run(stream), "run");
}

template <class Cfg>
int64_t workspace_size_for(int64_t num_groups, int64_t sm_count) {
  using Gemm = typename Cfg::Gemm;
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = 0;
  hw_info.sm_count = static_cast<int>(sm_count);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {static_cast<int>(num_groups), nullptr, nullptr},
                                {},
                                {},
                                hw_info};
  return static_cast<int64_t>(Gemm::get_workspace_size(args));
}

}  // namespace epmoe
