// The INT8 GEMM with per-token activation scales and per-channel weight scales on Hopper (sm_90a),
// over epmoe's contiguous expert layout with segments aligned to 128 rows:
//
//   out[offsets[e]:offsets[e+1]] = bf16(float(A[rows] @ B[e]^T) * SA[rows] * SB[e])   (int32 accum)
//
// A      [M, K]  int8 row-major; offsets[e] and every segment length are multiples of 128
// SA     [M]     fp32: one multiplier per row of A
// B      [E, N, K] int8 contiguous (each expert's weight is N x K, K-major)
// SB     [E, N]  fp32: one multiplier per output channel of each expert
// out    [M, N]  bf16 row-major; rows outside offsets[0]:offsets[E] are not written
//
// CUTLASS's own TMA warp-specialized kernels (cooperative; pingpong for the dense op) and mainloop
// (the K sum stays in the int32 accumulator, exact) with an epilogue visitor tree that scales the
// accumulator by the row and column vectors (vLLM's ScaledEpilogue for its INT8 c3x GEMMs), over
// the expert-block scheduler of contiguous_gemm_common.cuh. Clusters pair two N tiles of one
// 128-row block (1 x 2): both CTAs have the same expert, so the A tile can be multicast; pairing M
// blocks instead would multicast one B tile to blocks of two experts.
//
// This header holds the kernel's configuration and arguments; int8_channel_contiguous_gemm.cu
// builds the cooperative kernel, int8_dense_pingpong_gemm.cu the pingpong one (files of their own
// so that they compile in parallel).
#pragma once

#include "contiguous_gemm_common.cuh"

#include <cuda_bf16.h>

#include <cstddef>
#include <type_traits>

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace epmoe {

using namespace cute;

// What goes with a kernel schedule: CUTLASS's epilogue schedule for it (the cooperative kernel's
// two consumer warpgroups store one tile together, the pingpong kernel's each store their own) and
// the tile scheduler: the pingpong kernel gets the dense one only (DenseBlockSchedulerTag: its
// second consumer advances before the PDL wait, where a block table must not be read yet).
template <class KernelSchedule>
struct ScheduleTraits;
template <>
struct ScheduleTraits<cutlass::gemm::KernelTmaWarpSpecializedCooperative> {
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Scheduler = ExpertBlockSchedulerTag;
};
template <>
struct ScheduleTraits<cutlass::gemm::KernelTmaWarpSpecializedPingpong> {
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = DenseBlockSchedulerTag;
};

// KernelSchedule: CUTLASS's cooperative kernel (both consumer warpgroups on one tile) or its
// pingpong kernel (each warpgroup on a tile of its own, one's epilogue under the other's MMAs).
template <class TileShape_, class ClusterShape_,
          class KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative>
struct Int8ContiguousGemmConfig : ContiguousStrides {
  static_assert(size<0>(TileShape_{}) == kRowBlock, "a tile's rows are one aligned block");
  static_assert(size<0>(ClusterShape_{}) == 1, "clusters pair N tiles of one M block");
  using ProblemShape = Shape<int, int, int, int>;  // (M, N, K, L = experts)
  using ElementA = int8_t;
  using ElementB = int8_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementAccumulator = int32_t;
  using ElementCompute = float;
  static constexpr int AlignmentA = 16;
  static constexpr int AlignmentB = 16;
  static constexpr int AlignmentD = 8;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;

  // acc * SB[e][n] (a row vector per expert: CUTLASS's row broadcast, L stride N), then * SA[m] (a
  // column vector shared by every expert: column broadcast, L stride 0), rounded to bf16 once.
  using TokenScale = cutlass::epilogue::fusion::Sm90ColBroadcast<
      0, TileShape, float, float, cute::Stride<cute::_1, cute::_0, cute::_0>>;
  using ChannelScale = cutlass::epilogue::fusion::Sm90RowBroadcast<
      0, TileShape, float, float, cute::Stride<cute::_0, cute::_1, int64_t>>;
  using Round = cutlass::FloatRoundStyle;
  using ScaledByChannel = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                             Round::round_to_nearest>,
      ChannelScale, cutlass::epilogue::fusion::Sm90AccFetch>;
  using Scaled = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                             Round::round_to_nearest>,
      TokenScale, ScaledByChannel>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute, void,
      StrideD, AlignmentD, ElementD, StrideD, AlignmentD,
      typename ScheduleTraits<KernelSchedule>::Epilogue, Scaled>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, StrideA, AlignmentA, ElementB,
      StrideB, AlignmentB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      ProblemShape, CollectiveMainloop, CollectiveEpilogue,
      typename ScheduleTraits<KernelSchedule>::Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// block_expert: the layout's block table (const int32_t*), or nullptr for a dense GEMM (one weight
// over every row); a table is refused at compile time on a dense scheduler (the pingpong kernel's),
// which would ignore it.
template <class Cfg, class Table>
typename Cfg::Gemm::Arguments make_int8_arguments(at::Tensor& out, const at::Tensor& a,
                                                  const at::Tensor& a_scale, const at::Tensor& b,
                                                  const at::Tensor& b_scale, Table block_expert,
                                                  int sm_count, int64_t raster_along_n,
                                                  int64_t max_swizzle) {
  static_assert(std::is_same_v<Table, std::nullptr_t> || !Cfg::GemmKernel::TileScheduler::kDense,
                "the pingpong kernel runs dense GEMMs only: its scheduler reads no block table");
  const int num_experts = static_cast<int>(b.size(0));
  const int n = static_cast<int>(b.size(1));
  const int k = static_cast<int>(b.size(2));
  const int m = static_cast<int>(a.size(0));
  auto [stride_a, stride_b, stride_d] = contiguous_strides<Cfg>(n, k);
  typename Cfg::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, num_experts},
      {reinterpret_cast<const int8_t*>(a.data_ptr()), stride_a,
       reinterpret_cast<const int8_t*>(b.data_ptr()), stride_b},
      {{}, nullptr, stride_d, reinterpret_cast<typename Cfg::ElementD*>(out.data_ptr()), stride_d},
      hardware_info(a, sm_count)};
  // Tree arguments in the visitor's order (children, then the node's op):
  // {token scale, {channel scale, accumulator, op}, op}.
  args.epilogue.thread = {
      {a_scale.data_ptr<float>(), 0.0f, {}},
      {{b_scale.data_ptr<float>(), 0.0f, {cute::_0{}, cute::_1{}, static_cast<int64_t>(n)}}, {}, {}},
      {}};
  using RasterOrder = decltype(args.scheduler.raster_order);
  // Along N a weight wider than L2 is re-read from HBM for every 128-row block; along M (with a
  // swizzle) once per wave of blocks. The dense plan measures which wins per shape.
  args.scheduler.raster_order = raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = static_cast<int>(max_swizzle);
  set_block_table(args.scheduler, block_expert, m);
  return args;
}

// The GEMM of configuration Cfg on a's device and current stream (block_expert as in
// make_int8_arguments), as a programmatic dependent launch when pdl.
template <class Cfg, class Table>
void run_int8_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                   const at::Tensor& b, const at::Tensor& b_scale, Table block_expert,
                   int64_t raster_along_n, int64_t max_swizzle, bool pdl) {
  const int sm_count = at::cuda::getDeviceProperties(a.get_device())->multiProcessorCount;
  run_gemm<typename Cfg::Gemm>(make_int8_arguments<Cfg>(out, a, a_scale, b, b_scale, block_expert,
                                                        sm_count, raster_along_n, max_swizzle),
                               a, pdl);
}

}  // namespace epmoe
