// Block-scaled 1-byte GEMMs with 1x128 activation scales and 128x128 weight scales on Hopper
// (sm_90a), over epmoe's contiguous expert layout with segments aligned to 128 rows: FP8 e4m3
// (fp8_block_contiguous_gemm.cu) and INT8 (int8_block_contiguous_gemm.cu).
//
//   out[offsets[e]:offsets[e+1]] = (A * SFA)[rows] @ (B[e] * SFB[e])^T      (bf16 out, fp32 accum)
//
// A      [M, K]   float8_e4m3fn or int8 row-major; offsets[e] and every segment length are
//                 multiples of 128
// SFA    [M, K/128] fp32 row-major: one multiplier per 1x128 group of A
// B      [E, N, K] of A's dtype, contiguous (each expert's weight is N x K, K-major)
// SFB    [E, N/128, K/128] fp32 contiguous: one multiplier per 128x128 block of B
// out    [M, N]   bf16 row-major; rows outside offsets[0]:offsets[E] are not written
//
// The whole layout is ONE CUTLASS problem (M, N, K, L = E) for the Hopper TMA warp-specialized
// cooperative kernel (CUTLASS's FP8 block-scaled collective, Sm90BlockwiseScaleConfig). A and out
// have a static zero stride in L, so one TMA descriptor serves every expert's rows; B and SFB move
// with L. The tile scheduler (contiguous_gemm_common.cuh) gives each 128-row block of A the batch
// index of its expert, from a table built on the GPU from the offsets (no host synchronisation).
//
// The mainloop is CUTLASS's with both halves replaced (Sm90BlockScaledMainloop):
//  * tiles are 128 x 192 (two 64 x 192 warpgroup MMAs): per FLOP less shared-memory traffic than
//    128 x 128. A tile then meets two 128-column weight blocks, read as three 64-column groups
//    (the weight scales repeated along N);
//  * the promotion multiplies each accumulator element by one per-thread factor
//    SFA[row] * SFB[group] (2 x 3 registers), where CUTLASS builds accumulator-shaped scale tensors
//    once a tile has more than one scale group;
//  * SFA is read MN-major ([K/128, M]) with one TMA per stage, as DeepGEMM reads it, instead of a
//    cp.async gather of one float per row;
//  * the pipeline stage is released as soon as its MMAs retire, before the promotion;
//  * clusters pair two M blocks and multicast their B tile when both belong to one expert (a
//    second descriptor without multicast serves pairs that straddle two experts).
// For short k loops the epilogue is replaced too (Sm90WholeTileEpilogue, DeepGEMM's), except in
// the INT8 variants that keep CUTLASS's subtiled one for its extra mainloop stage
// (kSubtiledEpilogue). INT8 GEMM1 on a few variants also comes with the activation in the epilogue
// (Sm90SiluQuantEpilogue, silu_quant_epilogue.cuh: int8 codes and 1x128 scales of
// silu(gate) * up out); its mainloop loads a tile's B as w13's 128 gate rows and the same up rows,
// two boxes, and their weight scales likewise (GateUpHalves).
// INT8: the same kernel with int8 x int8 -> int32 warpgroup MMAs. The sum of one 128-wide K block
// is exact in int32 (|sum| <= 128 * 128 * 128 = 2^21) and is promoted once per K block, as FP8's
// partial sums are: accum += float(partial) * SFA[row] * SFB[group] (see S32InF32Registers).
// The INT8 kernel comes in variants (kInt8BlockVariants, one source file each, picked at run
// time), built from the consumer warpgroups' schedule (BlockScaledSchedule: how a K block's MMAs
// overlap the promotion), where each K block's sums start (kZeroStart), how a sum becomes a float
// (kNativeConvert), the epilogue, the runs of K blocks and the tile's width (128, 192 or 256; 128
// and 256 divide the DeepSeek-V3 N of 4096 and 7168 and read one weight scale per 128 columns).
// The package builds the three fastest on the H200, all 256 wide; the other combinations this
// file can express were measured slower there (README, "The CUTLASS INT8 block kernel's
// variants") and are not built: one line in kInt8BlockVariants and a source file build one again.
// Why not CUTLASS's ptr-array grouped kernel: it rewrites and fences the TMA descriptors of A, B
// and D in global memory whenever a CTA moves to another group, which with many experts is every
// tile. docs/fp8.md has the measurements (H200, sessions 10 and 11).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cuda_bf16.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "contiguous_gemm_common.cuh"
#include "silu_quant_epilogue.cuh"

namespace epmoe {

using namespace cute;

// An int8 x int8 -> int32 GMMA whose accumulator registers are typed float, so that the
// block-scaled collective, the kernel and the epilogue (all written for fp32 accumulators) take
// it unchanged; the mainloop alone reads the registers (promote_partial). The MMA starts each K
// block from kInt32InFloatBias, the bits of 1.5 * 2^23, and adds the int32 sum x to those bits:
// for |x| < 2^22 they are the bits of the float 1.5 * 2^23 + x (one unit per ulp at that
// exponent), so x = value - 1.5 * 2^23 exactly, with one FADD. An I2F conversion instead runs at
// a quarter of the FMA rate on SM90 and would outlast the MMAs; sm_90a compiles __int2float_rn to
// I2FP.F32.S32 instead, whose rate is not documented: the kNativeConvert variants measure it.
template <class Op>
struct S32InF32Registers : Op {};
constexpr float kInt32InFloatBias = 12582912.0f;  // 1.5 * 2^23: bits 0x4B400000
constexpr int32_t kInt32InFloatBiasBits = 0x4B400000;

}  // namespace epmoe

namespace cute {
template <class Op>
struct MMA_Traits<epmoe::S32InF32Registers<Op>> : MMA_Traits<Op> {
  using ValTypeD = float;
  using ValTypeC = float;
};
}  // namespace cute

namespace epmoe {

// CUTLASS's SM90 FP8 block-scaled collective (Base) with its producer (A, B, SFA by TMA; the weight
// scales stay with the base's cp.async warp) and consumer halves replaced; see the file comment.
// Accumulator fragment of a 64 x N GMMA per thread: (2 columns, 2 row halves, N/8 column blocks) at
// rows lane/4 + 16 warp (+8) and columns 2 (lane % 4) (+1) + 8 block (CuTe's SM90 CLayout_64xN).
// How the consumer warpgroups order their MMAs and the per-K-block promotion (run-time choice of
// the INT8 kernel, one instantiation each; FP8 builds kLockstep):
//  * kLockstep: both warpgroups wait for a stage, issue their MMAs together, wait for them and
//    promote together: the tensor cores idle while the two promote.
//  * kStaggered: the warpgroups take turns to issue (two named barriers, FlashAttention-3's
//    warp-scheduler barriers at K-block granularity), so one promotes while the other's MMAs run.
//  * kSplitN: each warpgroup issues its 64 x N MMAs as two 64 x N/2 chunks into two partial
//    accumulators and promotes one chunk while the other (or the next K block's first) runs:
//    the overlap inside one warpgroup, with as many registers as kLockstep.
//  * kSplitN4: the same with four 64 x N/4 chunks rotating through two partials (half of
//    kSplitN's partial registers: what lets a 256-wide tile hold its fp32 accumulator too).
//  * kSerialHalves: two 64 x N/2 chunks through ONE partial, each waited for and promoted before
//    the next is issued: no overlap inside a warpgroup (the other warpgroup's MMAs fill the
//    tensor cores meanwhile), a quarter of the accumulator's registers for the partial.
enum BlockScaledSchedule : int { kLockstep = 0, kStaggered = 1, kSplitN = 2, kSplitN4 = 3, kSerialHalves = 4 };
// Added to an INT8 schedule: each K block's MMAs start from zero (the first MMA's ScaleOut::Zero,
// as FP8's) instead of from registers set to the bias, and the promotion adds the bias bits to
// the int32 sum (an IADD) before the FADD takes the bias off. Nothing runs between two MMA issues
// then (the bias moves, one per register, are gone), and a partial's registers are read by the
// next MMA into them, so ptxas keeps one set of registers per partial where with moves it gave
// each chunk a set of its own (the moves start a new value) and spilled at 256-wide tiles.
constexpr int kZeroStart = 8;
constexpr int schedule_kind(int schedule) { return schedule & (kZeroStart - 1); }
// Added to a kZeroStart schedule: the promotion converts each zero-started int32 sum with
// __int2float_rn (exact: |sum| <= 2^21) and multiplies it into the accumulator, two instructions
// an element where the bias takes three (IADD, FADD, FFMA); the same floats, bit for bit.
constexpr int kNativeConvert = 16;
// Added to a schedule: CUTLASS's subtiled epilogue at every K (LongKConfig), where the whole-tile
// epilogue would otherwise run (K <= kWholeTileEpilogueMaxK). Its smaller buffer leaves room for
// one more mainloop stage: a 128 x 256 tile's short-K GEMM gets four stages instead of three.
// The mainloop ignores the bit.
constexpr int kSubtiledEpilogue = 32;
// Added to a kNativeConvert chunked schedule: the chunks' MMAs read A from registers (wgmma's RS
// form), loaded from shared memory once per K block with ldmatrix, instead of from shared memory
// (SS). A 64 x N/kChunks x 32 SS MMA reads its 64 x 32 A slice from shared memory again for each
// chunk: with four 64-column chunks a K block reads A four times, and a 64 x 64 x 32 MMA's 4 KB
// of operands take as many cycles at 128 B per cycle as its MACs take on the tensor cores. From
// registers, each chunk reads only its B slice. Costs 16 registers per thread (a 64 x 128 int8
// slice per warpgroup). On the H200 it was slower than its SS twin at every size (docs/fp8.md):
// shared-memory bandwidth is not what holds the quarters back, and the ldmatrix sits between a K
// block's stage wait and its first MMA.
constexpr int kRegisterA = 64;
// Added to a chunked two-partial schedule: K blocks in runs of two (kUnroll2) or four
// (kUnroll4), the MMAs drained once per run instead of once per K block (see mma_chunked):
// both warpgroups drain at the same time, leaving the tensor cores idle until one issues again.
constexpr int kUnroll2 = 128;
constexpr int kUnroll4 = 256;

// The N chunks a warpgroup's MMAs are issued in and the partial accumulators they rotate through.
template <int Schedule>
struct ChunksOf {
  static constexpr int kKind = schedule_kind(Schedule);
  static constexpr int kChunks = kKind == kSplitN4 ? 4 : 2;
  static constexpr int kBuffers = kKind == kSerialHalves ? 1 : 2;
  static constexpr bool kChunked = kKind == kSplitN || kKind == kSplitN4 || kKind == kSerialHalves;
};

// f(Int<0>{}), ..., f(Int<N - 1>{}), inlined: cute::for_each calls f from a lambda of its own
// that is not inlined by force, and once a K block's code is large enough ptxas gets a function
// call with MMAs in flight, serializes them (C7510) and puts the accumulators on the stack.
template <int... I, class F>
CUTLASS_DEVICE void unrolled(std::integer_sequence<int, I...>, F&& f) {
  ((void)f(Int<I>{}), ...);
}
template <int N, class F>
CUTLASS_DEVICE void unrolled(F&& f) {
  unrolled(std::make_integer_sequence<int, N>{}, f);
}

// GateUpHalves: B is w13 as stored ([E, N, K], gate rows then up rows) and a 256-wide tile n is
// gate rows [128 n, 128 n + 128) and the same up rows, [N/2 + 128 n, ...): the producer loads it as
// two 128-row boxes and the weight scales likewise (load_auxiliary), so the fused epilogue meets
// a gate block and its up block in one tile (Sm90SiluQuantEpilogue) without a copy of the weights.
template <class Base, int Schedule = kLockstep, bool GateUpHalves = false>
struct Sm90BlockScaledMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;
  using ClusterShape = typename Base::DispatchPolicy::ClusterShape;
  static constexpr int kTileN = size<1>(TileShape{});
  static constexpr int kGroupN = Base::ScaleGranularityN;
  static constexpr int kGroups = Base::ScaleNsPerTile;
  static_assert(Base::ScaleGranularityM == 1 && Base::ScaleMsPerTile == size<0>(TileShape{}));
  static_assert(kGroupN % 8 == 0, "a block of 8 accumulator columns must lie in one scale group");
  static_assert(Base::IsTmaLoadSFA && !Base::IsTmaLoadSFB,
                "activation scales by TMA (MN-major), weight scales by the base's cp.async warp");
  // INT8 MMAs (S32InF32Registers): partial sums are int32 in float registers, biased.
  static constexpr bool kIntegerMma = cute::is_same_v<typename Base::ElementA, int8_t>;
  static_assert(!kIntegerMma || size<2>(TileShape{}) == 128,
                "a K tile is one 128-wide scale block: its int32 sum stays below 2^22");

  // Clusters of two M blocks multicast the B tile when both blocks have the same expert; a pair
  // that straddles two experts loads B per CTA with a second descriptor without multicast (same
  // bytes per stage). Both CTAs decide from the block table, so they agree.
  static constexpr bool kPairs = size<0>(ClusterShape{}) == 2;
  static_assert(size<0>(ClusterShape{}) <= 2 && (!kPairs || size<1>(ClusterShape{}) == 1));
  using TmaBSolo = decltype(make_tma_copy_B_sm90(
      SM90_TMA_LOAD{},
      make_tensor(static_cast<typename Base::ElementB const*>(nullptr),
                  repeat_like(typename Base::StrideB{}, int32_t(0)), typename Base::StrideB{}),
      SmemLayoutB{}(_, _, _0{}), TileShape{}, Shape<_1, _1, _1>{}));
  static constexpr bool kHalves = GateUpHalves;
  static_assert(!kHalves || (size<1>(TileShape{}) == 256 && Base::ScaleGranularityN == 128),
                "a gate/up tile is two 128-row weight blocks");
  // One half of a stage's B tile (its rows lie first in the K-major layout: K is one swizzle atom
  // wide) and the TMA copies of such a box, multicast to the cluster pair or not.
  static constexpr int kHalfM = size<0>(TileShape{});
  static constexpr int kHalfN = size<1>(TileShape{}) / 2;
  static constexpr int kHalfK = size<2>(TileShape{});
  using HalfTileShape = Shape<Int<kHalfM>, Int<kHalfN>, Int<kHalfK>>;
  using SmemLayoutBHalf = decltype(tile_to_shape(typename Base::SmemLayoutAtomB{},
                                                 make_shape(Int<kHalfN>{}, Int<kHalfK>{})));
  template <class CopyOp, class Cluster>
  using TmaBHalf = decltype(make_tma_copy_B_sm90(
      CopyOp{},
      make_tensor(static_cast<typename Base::ElementB const*>(nullptr),
                  repeat_like(typename Base::StrideB{}, int32_t(0)), typename Base::StrideB{}),
      SmemLayoutBHalf{}, HalfTileShape{}, Cluster{}));
  // Not built without kHalves (the solo copy's type stands in, never constructed).
  using TmaBHalfPair = cute::conditional_t<kHalves, TmaBHalf<typename Base::GmemTiledCopyB, ClusterShape>, TmaBSolo>;
  using TmaBHalfSolo = cute::conditional_t<kHalves, TmaBHalf<SM90_TMA_LOAD, Shape<_1, _1, _1>>, TmaBSolo>;
  struct Arguments : Base::Arguments {
    const int32_t* block_expert = nullptr;  // [num_m_blocks], as the tile scheduler's
    int32_t num_m_blocks = 0;
  };
  struct Params : Base::Params {
    TmaBSolo tma_load_b_solo;
    TmaBHalfPair tma_load_b_half;
    TmaBHalfSolo tma_load_b_half_solo;
    const int32_t* block_expert = nullptr;
    int32_t num_m_blocks = 0;
    int32_t n = 0, k = 0, l = 0;  // B's extents (kHalves: where the up rows start)
  };

  // kHalves: the 128-row block of B holding tile n's gate rows (n) or up rows (N/256 + n).
  CUTLASS_DEVICE static int gate_up_block(Params const& p, int n, int half) {
    return half == 0 ? n : p.n / (2 * kHalfN) + n;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape, args, workspace);
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Tensor b = make_tensor(reinterpret_cast<typename Base::ElementB const*>(args.ptr_B),
                           make_layout(make_shape(N, K, L), args.dB));
    p.tma_load_b_solo = make_tma_copy_B_sm90(SM90_TMA_LOAD{}, b, SmemLayoutB{}(_, _, _0{}),
                                             TileShape{}, Shape<_1, _1, _1>{});
    if constexpr (kHalves) {
      p.tma_load_b_half = make_tma_copy_B_sm90(typename Base::GmemTiledCopyB{}, b, SmemLayoutBHalf{},
                                               HalfTileShape{}, ClusterShape{});
      p.tma_load_b_half_solo = make_tma_copy_B_sm90(SM90_TMA_LOAD{}, b, SmemLayoutBHalf{},
                                                    HalfTileShape{}, Shape<_1, _1, _1>{});
    }
    p.block_expert = args.block_expert;
    p.num_m_blocks = args.num_m_blocks;
    p.n = N;
    p.k = K;
    p.l = L;
    return p;
  }

  // Whether the pair holding block m (a scheduler index, parked or not) shares its B tile.
  CUTLASS_DEVICE static bool pair_shares_b(Params const& p, int m) {
    if (m >= parked_block_offset(p.num_m_blocks)) m -= parked_block_offset(p.num_m_blocks);
    return paired_expert_of_block(p.block_expert, p.num_m_blocks, m & ~1) ==
           paired_expert_of_block(p.block_expert, p.num_m_blocks, m | 1);
  }

  // Producer: one elected thread issues the TMA loads of A, B and SFA for each k tile. SFA has a
  // single batch (every expert's rows are in it), so it is read at batch 0.
  template <class TensorA, class TensorB, class TensorScaleA, class TensorScaleB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorScaleA, TensorScaleB> const& inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int /*thread_idx*/, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    const int lane_predicate = cute::elect_one_sync();
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    Tensor sSFA =
        make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), filter_zeros(SmemLayoutSFA{}));
    constexpr uint32_t cluster_x = get<0>(ClusterShape());
    const uint2 cluster_id = {block_rank_in_cluster % cluster_x, block_rank_in_cluster / cluster_x};
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto tma_a = params.tma_load_a.get_slice(cluster_id.y);
    auto tma_b = params.tma_load_b.get_slice(cluster_id.x);
    auto tma_sfa = params.tma_load_sfa.get_slice(cluster_id.y);
    Tensor tAgA = tma_a.partition_S(get<0>(inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = tma_a.partition_D(sA);
    Tensor tBgB = tma_b.partition_S(get<1>(inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = tma_b.partition_D(sB);
    auto tma_b_solo = params.tma_load_b_solo.get_slice(0);
    Tensor tBgB_solo = tma_b_solo.partition_S(get<1>(inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB_solo = tma_b_solo.partition_D(sB);
    bool multicast_b = true;
    if constexpr (kPairs) multicast_b = pair_shares_b(params, int(m_coord));
    Tensor tAgSFA = tma_sfa.partition_S(local_tile(
        get<2>(inputs), make_tile(Int<Base::ScaleMsPerTile>{}, Int<1>{}), make_coord(m_coord, _, 0)));
    Tensor tAsSFA = tma_sfa.partition_D(sSFA);

    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> block id
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n) {
        mcast_mask_a |= uint16_t(1) << block_layout(cluster_id.x, n, Int<0>{});
      }
    }
    if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m) {
        mcast_mask_b |= uint16_t(1) << block_layout(m, cluster_id.y, Int<0>{});
      }
    }
    // kHalves: B in 128-row blocks (gate_up_block) and where a block lands in a stage's tile
    // (the gate rows first).
    auto gB_blocks = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      if constexpr (kHalves) {
        return local_tile(params.tma_load_b_half.get_tma_tensor(make_shape(params.n, params.k, params.l)),
                          Shape<Int<kHalfN>, Int<kHalfK>>{}, make_coord(_, _, _));
      } else {
        return 0;
      }
    }();
    auto half_dst = [&](int stage, int half) CUTLASS_LAMBDA_FUNC_INLINE {
      return make_tensor(make_smem_ptr(shared_tensors.smem_B.data() + (stage * 2 + half) * cosize(SmemLayoutBHalf{})),
                         SmemLayoutBHalf{});
    };
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      if (lane_predicate) {
        copy(params.tma_load_a.with(*barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter),
             tAsA(_, _, _, stage));
        if constexpr (kHalves) {
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            Tensor src = gB_blocks(_, _, gate_up_block(params, int(n_coord), half), *k_tile_iter, l_coord);
            if (multicast_b) {
              auto tma = params.tma_load_b_half.get_slice(cluster_id.x);
              copy(params.tma_load_b_half.with(*barrier, mcast_mask_b), tma.partition_S(src),
                   tma.partition_D(half_dst(stage, half)));
            } else {
              auto tma = params.tma_load_b_half_solo.get_slice(0);
              copy(params.tma_load_b_half_solo.with(*barrier), tma.partition_S(src),
                   tma.partition_D(half_dst(stage, half)));
            }
          }
        } else if (multicast_b) {
          copy(params.tma_load_b.with(*barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter),
               tBsB(_, _, _, stage));
        } else {
          copy(params.tma_load_b_solo.with(*barrier), tBgB_solo(_, _, _, *k_tile_iter),
               tBsB_solo(_, _, _, stage));
        }
        copy(params.tma_load_sfa.with(*barrier, uint16_t(0)), tAgSFA(_, _, _, *k_tile_iter),
             tAsSFA(_, _, _, stage));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // The weight scales of each k tile by cp.async from this warp (the base's, except with kHalves:
  // the gate block's and the up block's, lanes 0 and 1).
  template <class TensorA, class TensorB, class TensorScaleA, class TensorScaleB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline,
                                     PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorScaleA, TensorScaleB> const& inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int thread_idx, uint32_t block_rank_in_cluster,
                                     TensorStorage& shared_tensors) {
    if constexpr (!kHalves) {
      Base::load_auxiliary(params, pipeline, smem_pipe_write, inputs, blk_coord, k_tile_iter, k_tile_count,
                           thread_idx, block_rank_in_cluster, shared_tensors);
    } else {
      Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), filter_zeros(SmemLayoutSFB{}));
      Tensor mSFB = get<3>(inputs);  // ((128, N/128), (128, K/128), L)
      auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
      const int block = gate_up_block(params, int(n_coord), thread_idx);
      CUTLASS_PRAGMA_NO_UNROLL
      for (; k_tile_count > 0; --k_tile_count) {
        pipeline.producer_acquire(smem_pipe_write);
        if (thread_idx < 2) {
          SM80_CP_ASYNC_CACHEALWAYS<float>::copy(
              mSFB(make_coord(0, block), make_coord(0, *k_tile_iter), l_coord),
              sSFB(thread_idx, 0, smem_pipe_write.index()));
        }
        pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
        ++k_tile_iter;
        ++smem_pipe_write;
      }
    }
  }

  // Consumer: per k tile, the warpgroup's MMAs into a partial accumulator (zeroed; INT8: the bias),
  // the stage released as soon as they retire, then accum += partial * SFA[row] * SFB[group] with
  // one FMA per element (INT8: and the FADD that takes the bias off). Schedule says how the MMAs
  // of one warpgroup and K block overlap the promotion of another (see BlockScaledSchedule).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*params*/) {
    static_assert(size<1>(FrgTensorC{}) == 1 && size<2>(FrgTensorC{}) == 1,
                  "one 64 x N GMMA atom per warpgroup");
    static_assert(size(FrgTensorC{}) == kTileN / 2, "64 x N accumulator: N/2 values per thread");
    clear(accum);
    if (k_tile_count <= 0) return;
    if constexpr (ChunksOf<Schedule>::kChunked) {
      mma_chunked(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors);
    } else {
      mma_whole(pipeline, smem_pipe_read, accum, k_tile_count, thread_idx, shared_tensors);
    }
  }

  static constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  static constexpr int kMathThreads = size(TiledMma{});
  static_assert(schedule_kind(Schedule) != kStaggered || kWarpGroups == 2, "two warpgroups take turns");
  static constexpr bool kZero = (Schedule & kZeroStart) != 0;
  static_assert(!kZero || (kIntegerMma && ChunksOf<Schedule>::kChunked),
                "zero-started partials: the INT8 chunked schedules (int32 fragments)");
  static constexpr bool kNative = (Schedule & kNativeConvert) != 0;
  static_assert(!kNative || kZero, "the native conversion reads zero-started int32 sums (kZeroStart)");
  static constexpr bool kRegA = (Schedule & kRegisterA) != 0;
  static_assert(!((Schedule & kUnroll2) && (Schedule & kUnroll4)), "one run length");
  static constexpr int kRun = (Schedule & kUnroll4) ? 4 : (Schedule & kUnroll2) ? 2 : 1;
  static_assert(kRun == 1 || (ChunksOf<Schedule>::kChunked && ChunksOf<Schedule>::kBuffers == 2 && !kRegA),
                "runs of K blocks: the two-partial chunked schedules, A from shared memory (the next "
                "K block's A would overwrite registers an MMA in flight reads)");
  static_assert(!kRegA || kNative, "register A: the native-conversion chunked schedules");
  // kStaggered's named barriers (user ids, above CUTLASS's reserved ones): warpgroup w waits on
  // kTurnBarrier + w before it issues a K block's MMAs and arrives on the other's after.
  static constexpr uint32_t kTurnBarrier = 0;

  // This warpgroup's index (uniform in the warp) and the first of the two rows (row, row + 8) of
  // its accumulator values in the tile (CuTe's SM90 CLayout_64xN).
  CUTLASS_DEVICE static int warp_group_of(int thread_idx) {
    return __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  }
  CUTLASS_DEVICE static int first_row(int warp_group, int thread_idx) {
    const int t = thread_idx % cutlass::NumThreadsPerWarpGroup;
    return warp_group * 64 + (t / 32) * 16 + (t % 32) / 4;
  }

  // The consumers' views of shared memory: A, B, SFA and SFB tiles (with the stage mode).
  CUTLASS_DEVICE static auto consumer_smem(TensorStorage& shared_tensors) {
    return cute::make_tuple(
        make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{}),
        make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{}),
        make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), filter_zeros(SmemLayoutSFA{})),
        make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), filter_zeros(SmemLayoutSFB{})));
  }

  // The scales one thread applies to a K block: its two rows' SFA, the tile's SFB groups.
  struct KBlockScales {
    float sfa0, sfa1;
    float sfb[kGroups];
  };
  template <class TensorSFA, class TensorSFB>
  CUTLASS_DEVICE static KBlockScales read_scales(TensorSFA const& sSFA, TensorSFB const& sSFB,
                                                 int row, int stage) {
    KBlockScales s;
    s.sfa0 = sSFA(row, 0, stage);
    s.sfa1 = sSFA(row + 8, 0, stage);
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) s.sfb[g] = sSFB(g, 0, stage);
    return s;
  }

  // accum's 8-column blocks [kFirstBlock, kFirstBlock + kBlocks) += the partial sums of partial
  // (whose block b is accum's kFirstBlock + b) times SFA[row] * SFB[group].
  template <int kFirstBlock, int kBlocks, class Accum, class Partial>
  CUTLASS_DEVICE static void promote(Accum& accum, Partial const& partial, KBlockScales const& s) {
    float f0[kGroups], f1[kGroups];
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      f0[g] = s.sfa0 * s.sfb[g];
      f1[g] = s.sfa1 * s.sfb[g];
    }
    cute::warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < kBlocks; ++b) {
      const int blk = kFirstBlock + b;
      const int g = blk * 8 / kGroupN;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) {
        accum(c + 4 * blk) += promote_partial(partial(c + 4 * b)) * f0[g];
        accum(c + 2 + 4 * blk) += promote_partial(partial(c + 2 + 4 * b)) * f1[g];
      }
    }
    cute::warpgroup_fence_operand(accum);
  }

  // Where the MMAs start a K block: INT8 sums land on the bias bits (unless kZeroStart); FP8's
  // first MMA zeroes.
  template <class Mma, class Partial>
  CUTLASS_DEVICE static void start_partial(Mma& tiled_mma, Partial& partial) {
    if constexpr (kIntegerMma && !kZero) {
      using Value = typename std::remove_reference_t<Partial>::value_type;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(partial); ++i) {
        if constexpr (cute::is_same_v<Value, float>) {
          partial(i) = kInt32InFloatBias;
        } else {
          // One move per register, not a copy of one constant register: the compiler otherwise
          // keeps the bias in a register of the other half's partial (in flight) and reads it.
          asm volatile("mov.b32 %0, %1;" : "=r"(partial(i)) : "n"(kInt32InFloatBiasBits));
        }
      }
      tiled_mma.accumulate_ = cute::GMMA::ScaleOut::One;
    } else {
      tiled_mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
    }
  }

  // One K block's MMAs of this warpgroup (all of its K steps) into partial, committed as one
  // group, not waited for.
  // tCrA: shared-memory descriptors with a stage mode (SS MMAs), or this K block's registers
  // (kRegA: no stage mode).
  template <class Mma, class FragA, class FragB, class Partial>
  CUTLASS_DEVICE static void issue_k_block(Mma& tiled_mma, FragA const& tCrA, FragB const& tCrB,
                                           Partial& partial, int stage) {
    start_partial(tiled_mma, partial);
    cute::warpgroup_fence_operand(partial);
    cute::warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      if constexpr (decltype(rank(tCrA))::value == 4) {
        cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), partial);
      } else {
        cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k, stage), partial);
      }
      tiled_mma.accumulate_ = cute::GMMA::ScaleOut::One;
    }
    cute::warpgroup_commit_batch();
  }

  // kLockstep and kStaggered: one 64 x N partial per warpgroup, waited for before its promotion.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma_whole(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                                FrgTensorC& accum, int k_tile_count, int thread_idx,
                                TensorStorage& shared_tensors) {
    constexpr bool kTurns = schedule_kind(Schedule) == kStaggered;
    auto smem = consumer_smem(shared_tensors);  // not bound: C++17 lambdas cannot capture bindings
    auto sA = get<0>(smem);
    auto sB = get<1>(smem);
    auto sSFA = get<2>(smem);
    auto sSFB = get<3>(smem);
    const int warp_group = warp_group_of(thread_idx);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(
        make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
    const int row = first_row(warp_group, thread_idx);

    Tensor partial = make_fragment_like(accum);
    // Warpgroup 0 issues first: warpgroup 1 lets it go once.
    if constexpr (kTurns) {
      if (warp_group == 1) cutlass::arch::NamedBarrier::arrive(kMathThreads, kTurnBarrier);
    }
    auto token = pipeline.consumer_try_wait(smem_pipe_read);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.consumer_wait(smem_pipe_read, token);
      const int stage = smem_pipe_read.index();
      const KBlockScales scales = read_scales(sSFA, sSFB, row, stage);  // before the release
      if constexpr (kTurns) {
        cutlass::arch::NamedBarrier::sync(kMathThreads, kTurnBarrier + warp_group);
      }
      issue_k_block(tiled_mma, tCrA, tCrB, partial, stage);
      if constexpr (kTurns) {
        cutlass::arch::NamedBarrier::arrive(kMathThreads, kTurnBarrier + (warp_group ^ 1));
      }
      cute::warpgroup_wait<0>();
      cute::warpgroup_fence_operand(partial);
      pipeline.consumer_release(smem_pipe_read);
      ++smem_pipe_read;
      if (k_tile_count > 1) token = pipeline.consumer_try_wait(smem_pipe_read);
      promote<0, kTileN / 8>(accum, partial, scales);
    }
    // Warpgroup 1's last arrival on warpgroup 0's barrier is taken here, so every mainloop
    // leaves both barriers as it found them.
    if constexpr (kTurns) {
      if (warp_group == 0) cutlass::arch::NamedBarrier::sync(kMathThreads, kTurnBarrier);
    }
  }

  // The chunked schedules (ChunksOf): the warpgroup's MMAs in kChunks N chunks, each into a
  // 64 x N/kChunks partial; with two partials, while one chunk's partial is promoted the next
  // chunk's MMAs (or the next K block's first) run. Needs k_tile_count >= 1.
  static constexpr int kTileM = size<0>(TileShape{});
  static constexpr int kTileK = size<2>(TileShape{});
  static constexpr int kChunks = ChunksOf<Schedule>::kChunks;
  static constexpr int kBuffers = ChunksOf<Schedule>::kBuffers;
  static constexpr int kChunkN = kTileN / kChunks;
  static constexpr int kChunkBlocks = kChunkN / 8;
  static_assert(kTileN % kChunks == 0 && kChunkN % 8 == 0, "each chunk is whole 8-column blocks");
  static_assert(kBuffers == 1 || kChunks % 2 == 0, "two partials alternate over an even chunk count");
  // Its partials are int32 fragments (the MMA's own register type), not S32InF32Registers'
  // floats: reinterpreting the registers of an MMA in flight moves them through float registers
  // right after the issue, which ptxas answers by waiting for the MMA there (C7514), serializing
  // the chunks. The bits are read as the biased float after the wait (promote_partial).
  using ChunkShape = Shape<Int<kTileM>, Int<kChunkN>, Int<kTileK>>;
  using ChunkOp = cute::conditional_t<
      kRegA,
      decltype(cute::GMMA::rs_op_selector<int8_t, int8_t, int32_t, ChunkShape, cute::GMMA::Major::K,
                                          cute::GMMA::Major::K>()),
      decltype(cute::GMMA::ss_op_selector<int8_t, int8_t, int32_t, ChunkShape, cute::GMMA::Major::K,
                                          cute::GMMA::Major::K>())>;
  using ChunkMma = decltype(make_tiled_mma(ChunkOp{}, Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
  // kRegA: A's K block from shared memory into the RS MMAs' fragment, four 8 x 16-byte matrices
  // per ldmatrix (the int8 K-major fragment of an m16n8k32 MMA, which the RS form reads).
  using SmemCopyA = Copy_Atom<SM75_U32x4_LDSM_N, int8_t>;

  // Chunk C's partial (a compile-time choice: the registers are named, never indexed at run time).
  template <int C, class Partial>
  CUTLASS_DEVICE static Partial& chunk_partial(Partial& p0, Partial& p1) {
    if constexpr (kBuffers == 1 || C % 2 == 0) {
      return p0;
    } else {
      return p1;
    }
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma_chunked(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                                  FrgTensorC& accum, int k_tile_count, int thread_idx,
                                  TensorStorage& shared_tensors) {
    static_assert(kIntegerMma, "the chunked schedules are built for the INT8 MMAs");
    auto smem = consumer_smem(shared_tensors);  // not bound: C++17 lambdas cannot capture bindings
    auto sA = get<0>(smem);
    auto sB = get<1>(smem);
    auto sSFA = get<2>(smem);
    auto sSFB = get<3>(smem);
    // (N/kChunks, kChunks) x K x stages: chunk c of every stage's B tile.
    Tensor sB_chunks = logical_divide(sB, Shape<Int<kChunkN>>{});
    const int warp_group = warp_group_of(thread_idx);
    ChunkMma chunk_mma;
    auto thread_mma = chunk_mma.get_slice(
        make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
    // SS: A's descriptors for every stage. kRegA: one K block's registers (tCrA) and the
    // ldmatrix copy that fills them from a stage (load_a).
    auto a_operand = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      if constexpr (kRegA) {
        return chunk_mma.get_thread_slice(thread_idx).partition_fragment_A(sA(_, _, Int<0>{}));
      } else {
        return thread_mma.make_fragment_A(thread_mma.partition_A(sA));
      }
    };
    Tensor tCrA = a_operand();
    auto load_a = [&](int stage) CUTLASS_LAMBDA_FUNC_INLINE {
      if constexpr (kRegA) {
        auto copy_a = make_tiled_copy_A(SmemCopyA{}, chunk_mma);
        auto thread_copy_a = copy_a.get_thread_slice(thread_idx);
        Tensor tArA = thread_copy_a.retile_D(tCrA);
        copy(copy_a, thread_copy_a.partition_S(sA)(_, _, _, stage), tArA);
      }
    };
    auto fragment_b = [&](auto c) CUTLASS_LAMBDA_FUNC_INLINE {
      return thread_mma.make_fragment_B(thread_mma.partition_B(sB_chunks(make_coord(_, c), _, _)));
    };
    Tensor p0 = partition_fragment_C(chunk_mma, Shape<Int<kTileM>, Int<kChunkN>>{});
    Tensor p1 = make_fragment_like(p0);
    static_assert(size(decltype(p0){}) * kChunks == size(FrgTensorC{}), "the chunks make the accumulator");
    auto partial = [&](auto c) CUTLASS_LAMBDA_FUNC_INLINE -> decltype(p0)& {
      return chunk_partial<decltype(c)::value>(p0, p1); };
    const int row = first_row(warp_group, thread_idx);

    if constexpr (kBuffers == 1) {
      // Each chunk issued, waited for and promoted before the next is issued into the partial.
      CUTLASS_PRAGMA_NO_UNROLL
      for (; k_tile_count > 0; --k_tile_count) {
        pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
        const int stage = smem_pipe_read.index();
        const KBlockScales scales = read_scales(sSFA, sSFB, row, stage);
        load_a(stage);
        unrolled<kChunks>([&](auto c) CUTLASS_LAMBDA_FUNC_INLINE {
          issue_k_block(chunk_mma, tCrA, fragment_b(c), p0, stage);
          cute::warpgroup_wait<0>();
          cute::warpgroup_fence_operand(p0);
          if constexpr (decltype(c)::value == kChunks - 1) {
            pipeline.consumer_release(smem_pipe_read);
            ++smem_pipe_read;
          }
          promote<decltype(c)::value * kChunkBlocks, kChunkBlocks>(accum, p0, scales);
        });
      }
      return;
    } else {
      // K blocks go in runs of kRun (kUnroll2, kUnroll4; else 1). Inside a run, a K block's last
      // chunk stays in flight while the next K block's first chunk is issued; where a run ends
      // every MMA has retired (ptxas serializes the MMAs when the registers of one in flight are
      // carried around a loop), and both warpgroups, in step, leave the tensor cores idle until
      // the next run's first MMAs. Each chunk's MMAs run while the chunk before is promoted; the
      // last chunk of a K block is promoted while the next K block's first runs.
      // first: the mainloop's first K block (nothing to promote before it); after_in_flight: the
      // K block before left its last chunk in flight (its stage is released here, once that
      // chunk retires); drain: this K block ends its run.
      PipelineState smem_pipe_release = smem_pipe_read;
      auto release = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      };
      // Every lambda here is inlined by force (see unrolled): a K block is called from up to
      // six places.
      auto k_block = [&](auto first, auto after_in_flight, auto drain,
                         KBlockScales const& previous) CUTLASS_LAMBDA_FUNC_INLINE {
        pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
        const int stage = smem_pipe_read.index();
        ++smem_pipe_read;
        const KBlockScales scales = read_scales(sSFA, sSFB, row, stage);
        load_a(stage);  // the previous K block's MMAs, readers of these registers, have retired
        unrolled<kChunks>([&](auto c) CUTLASS_LAMBDA_FUNC_INLINE {
          constexpr int kC = decltype(c)::value;
          issue_k_block(chunk_mma, tCrA, fragment_b(c), partial(c), stage);
          if constexpr (kC == 0) {
            if constexpr (decltype(after_in_flight)::value) {
              cute::warpgroup_wait<1>();
              cute::warpgroup_fence_operand(partial(Int<kChunks - 1>{}));
              release();
            }
            if constexpr (!decltype(first)::value) {
              promote<(kChunks - 1) * kChunkBlocks, kChunkBlocks>(accum, partial(Int<kChunks - 1>{}),
                                                                  previous);
            }
          } else {
            cute::warpgroup_wait<1>();
            cute::warpgroup_fence_operand(partial(Int<kC - 1>{}));
            promote<(kC - 1) * kChunkBlocks, kChunkBlocks>(accum, partial(Int<kC - 1>{}), scales);
          }
        });
        if constexpr (decltype(drain)::value) {
          cute::warpgroup_wait<0>();
          cute::warpgroup_fence_operand(partial(Int<kChunks - 1>{}));
          release();
        }
        return scales;
      };
      // The first K block on its own (no branch on whether a block is the first: ptxas
      // serializes the MMAs over a divergent path, C7520), then single K blocks until the rest
      // is whole runs.
      using cute::false_type;
      using cute::true_type;
      KBlockScales previous = k_block(true_type{}, false_type{}, true_type{}, KBlockScales{});
      const int lead = (k_tile_count - 1) % kRun;
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 0; i < lead; ++i) previous = k_block(false_type{}, false_type{}, true_type{}, previous);
      CUTLASS_PRAGMA_NO_UNROLL
      for (k_tile_count -= 1 + lead; k_tile_count > 0; k_tile_count -= kRun) {
        unrolled<kRun>([&](auto j) CUTLASS_LAMBDA_FUNC_INLINE {
          constexpr int kJ = decltype(j)::value;
          previous = k_block(false_type{}, cute::bool_constant<(kJ > 0)>{},
                             cute::bool_constant<kJ == kRun - 1>{}, previous);
        });
      }
      promote<(kChunks - 1) * kChunkBlocks, kChunkBlocks>(accum, partial(Int<kChunks - 1>{}), previous);
    }
  }

  // A partial sum as a float: FP8's is one; INT8's is the exact int32 sum (S32InF32Registers).
  CUTLASS_DEVICE static float promote_partial(float v) {
    if constexpr (kIntegerMma) {
      return v - kInt32InFloatBias;
    } else {
      return v;
    }
  }
  // The same from an int32 fragment (the chunked schedules' partials): its bits are the biased
  // float, or with kZeroStart the sum itself, which the bias bits turn into that float (or,
  // with kNativeConvert, a conversion instruction).
  CUTLASS_DEVICE static float promote_partial(int32_t v) {
    if constexpr (kNative) {
      return __int2float_rn(v);
    } else {
      if constexpr (kZero) v += kInt32InFloatBiasBits;
      return __int_as_float(v) - kInt32InFloatBias;
    }
  }

  // mma released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

// The epilogue as DeepGEMM writes it, in place of CUTLASS's subtiled one: the consumer warps put
// the whole bf16 tile into shared memory with stmatrix (128-byte swizzle, one 128 x 64 atom per 64
// columns), meet at one barrier, and three threads issue one TMA store per atom. Nothing waits for
// those stores until the next tile's epilogue needs the buffer again, so they overlap the next
// mainloop. CUTLASS's epilogue (Base, built for 128 x 64 subtiles) supplies the arguments, the
// parameters and the TMA store descriptor of one atom. Its own store syncs twice per 128 x 32
// subtile: on GEMM2 (K = 2048) its instructions held about 10 % of Nsight Compute's warp samples,
// DeepGEMM's epilogue about 6 % (docs/fp8.md, session 11). The 48 KB buffer costs one mainloop
// stage. alpha / beta must be 1 / 0 (can_implement refuses others): the GEMM writes A @ B^T.
template <class Base, class TileShape>
struct Sm90WholeTileEpilogue : EpilogueWithoutSource<Base> {
  static constexpr int kTileM = size<0>(TileShape{});
  static constexpr int kTileN = size<1>(TileShape{});
  static constexpr int kAtomN = 64;  // bf16 columns in one 128-byte swizzle row
  static constexpr int kAtoms = kTileN / kAtomN;
  static_assert(kTileN % kAtomN == 0 && kTileM == 128);

  using Interface = EpilogueWithoutSource<Base>;
  using typename Interface::LoadPipeline;
  using typename Interface::LoadPipelineState;
  using typename Interface::PipelineStorage;
  using typename Interface::StorePipeline;
  using typename Interface::StorePipelineState;
  using typename Interface::StrideD;
  using ElementC = typename Base::ElementC;
  using ElementD = typename Base::ElementD;
  using Arguments = typename Base::Arguments;
  using Params = typename Base::Params;
  static_assert(cute::is_void_v<ElementC> && cute::is_same_v<ElementD, cutlass::bfloat16_t>);

  using EpilogueTile = Shape<Int<kTileM>, Int<kAtomN>>;
  using SmemLayoutD = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<ElementD>{},
                                             make_shape(Int<kTileM>{}, Int<kAtomN>{}, Int<kAtoms>{}),
                                             Step<_1, _2, _3>{}));
  // Base's store descriptor must be the one for an atom of this layout.
  static_assert(cute::is_same_v<typename Params::TMA_D,
                                decltype(make_tma_copy(
                                    SM90_TMA_STORE{},
                                    make_tensor(make_gmem_ptr<ElementD>(nullptr),
                                                repeat_like(StrideD{}, int32_t(0)), StrideD{}),
                                    take<0, 2>(SmemLayoutD{}), EpilogueTile{}, _1{}))>);

  struct TensorStorage {
    alignas(1024) cute::ArrayEngine<ElementD, cosize_v<SmemLayoutD>> smem_D;
  };
  struct SharedStorage {
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace) {
    return Base::to_underlying_arguments(problem_shape, args, workspace);
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const& problem_shape, Arguments const& args) {
    return Base::get_workspace_size(problem_shape, args);
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const& problem_shape,
                                              Arguments const& args, void* workspace,
                                              cudaStream_t stream,
                                              cutlass::CudaHostAdapter* adapter = nullptr) {
    return Base::initialize_workspace(problem_shape, args, workspace, stream, adapter);
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    // This epilogue writes the accumulators as they are: refuse a scaling it would drop.
    return args.thread.alpha == 1.0f && args.thread.beta == 0.0f &&
           args.thread.alpha_ptr == nullptr && args.thread.beta_ptr == nullptr &&
           Base::can_implement(problem_shape, args);
  }
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_store_d.get_tma_descriptor());
  }

  CUTLASS_HOST_DEVICE Sm90WholeTileEpilogue(Params const& params, TensorStorage&) : params_(params) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine,
            class AccLayout, class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                            StorePipelineState store_state, ProblemShapeMNKL problem_shape_mnkl,
                            TileShapeMNK, TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma,
                            int thread_idx, TensorStorage& shared_tensors, int = -1) {
    static_assert(size(TiledMma{}) == 256, "two consumer warpgroups, 64 rows each");
    static_assert(size(decltype(accumulators){}) == kTileN / 2, "one 64 x N GMMA accumulator");
    constexpr int kThreads = size(TiledMma{});
    auto [M, N, K, L] = problem_shape_mnkl;
    auto [m_coord, n_coord, k_coord, l_coord] = tile_coord_mnkl;

    // The previous tile's TMA stores must have read the buffer before it is written again.
    if (thread_idx < kAtoms) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);

    // stmatrix .x4: four 8 x 8 matrices, (rows 0-7 | 8-15 of this warp's 16) x (8-column blocks
    // i | i+1, i even); lane l addresses row l % 8 (+8 for matrix 1, 3) of matrix l / 8. In the
    // 128-byte swizzle a row's 16-byte chunk c sits at c ^ (row % 8).
    const int warp = thread_idx / 32, lane = thread_idx % 32;
    const int row = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
    uint8_t* smem = reinterpret_cast<uint8_t*>(shared_tensors.smem_D.begin());
    uint8_t* row_base = smem + row * 128;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kTileN / 8; i += 2) {
      const int atom = i / 8, chunk = (i % 8) + lane / 16;
      uint8_t* dst = row_base + atom * (kTileM * 128) + ((chunk ^ (lane % 8)) * 16);
      auto pack = [&](int v) {
        __nv_bfloat162 h = __floats2bfloat162_rn(accumulators(v), accumulators(v + 1));
        return reinterpret_cast<uint32_t const&>(h);
      };
      SM90_U32x4_STSM_N::copy(pack(4 * i), pack(4 * i + 2), pack(4 * i + 4), pack(4 * i + 6),
                              *reinterpret_cast<uint128_t*>(dst));
    }
    tma_store_fence();
    cutlass::arch::NamedBarrier::sync(kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);

    if (thread_idx < kAtoms) {
      Tensor mD = coalesce(params_.tma_store_d.get_tma_tensor(make_shape(M, N, L)),
                           take<0, 2>(TileShape{}));
      Tensor gD = local_tile(mD, take<0, 2>(TileShape{}), make_coord(m_coord, n_coord, l_coord));
      Tensor gD_atoms = flat_divide(gD, EpilogueTile{});  // (128, 64, 1, kAtoms)
      Tensor sD_atoms = cute::as_position_independent_swizzle_tensor(
          make_tensor(make_smem_ptr(shared_tensors.smem_D.begin()), SmemLayoutD{}));  // (128, 64, kAtoms)
      ThrCopy s2g = params_.tma_store_d.get_slice(Int<0>{});
      Tensor bSG_sD = s2g.partition_S(sD_atoms);
      Tensor bSG_gD = s2g.partition_D(gD_atoms);
      copy(params_.tma_store_d, bSG_sD(_, _, _, thread_idx), bSG_gD(_, _, _, 0, thread_idx));
      tma_store_arrive();
    }
    return cute::make_tuple(load_state, store_state);
  }

  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    tma_store_wait<0>();  // the smem buffer must outlive the last stores' reads
    return cute::make_tuple(load_state, store_state);
  }

 private:
  Params const& params_;
};

// CUTLASS's collective builder makes the block-scaled collective for FP8 inputs only; the collective
// itself moves 1-byte K-major operands of any type. The INT8 one is the FP8 one (same shared-memory
// layouts, stages and copies: both are one byte) with int8 elements and S32InF32Registers MMAs.
template <class Collective, class Element, class TileShape>
struct WithElement {
  using type = Collective;  // FP8: as built
};
template <class Policy, class Tile, class EA, class SA, class EB, class SB, class Mma, class... Rest,
          class TileShape>
struct WithElement<cutlass::gemm::collective::CollectiveMma<Policy, Tile, EA, SA, EB, SB, Mma, Rest...>,
                   int8_t, TileShape> {
  using Op = decltype(cute::GMMA::ss_op_selector<int8_t, int8_t, int32_t, TileShape,
                                                 cute::GMMA::Major::K, cute::GMMA::Major::K>());
  using TiledMma =
      decltype(make_tiled_mma(S32InF32Registers<Op>{}, Layout<Shape<_2, _1, _1>>{}));
  static_assert(size(TiledMma{}) == size(Mma{}) &&
                cute::is_same_v<typename TiledMma::AtomShape_MNK, typename Mma::AtomShape_MNK>);
  using type = cutlass::gemm::collective::CollectiveMma<Policy, Tile, int8_t, SA, int8_t, SB, TiledMma,
                                                        Rest...>;
};

// The epilogue of a configuration: CUTLASS's subtiled one (bf16 out; its smaller buffer leaves
// room for one more mainloop stage than the whole-tile one), Sm90WholeTileEpilogue (bf16 out), or
// Sm90SiluQuantEpilogue (INT8 GEMM1 with the activation fused: 1x128 int8 codes and scales out).
enum EpilogueKind : int { kSubtiledBf16 = 0, kWholeTileBf16 = 1, kSiluQuantInt8 = 2 };

// One kernel configuration: operand type (cutlass::float_e4m3_t or int8_t), tile and cluster shape
// (the tile's M must be kRowBlock), the
// weight-scale group along N (128 / kGroupN copies of each 128x128 block scale are read) and the
// epilogue (EpilogueKind); Schedule: the consumer warpgroups' (BlockScaledSchedule).
template <class Element_, class TileShape_, class ClusterShape_, int GroupN, int Epilogue,
          int Schedule = kLockstep>  // Epilogue kSiluQuantInt8: B's gate and up halves (GateUpHalves)
struct BlockScaledContiguousGemmConfig : ContiguousStrides {
  static_assert(size<0>(TileShape_{}) == kRowBlock, "a tile's rows are one aligned block");
  static_assert(size<0>(ClusterShape_{}) == 1 || size<1>(ClusterShape_{}) == 1,
                "clusters pair M blocks (2 x 1) or N blocks (1 x n), not both");
  static_assert(128 % GroupN == 0 && size<1>(TileShape_{}) % GroupN == 0);
  static constexpr int kGroupN = GroupN;
  using ProblemShape = Shape<int, int, int, int>;  // (M, N, K, L = experts)
  static_assert(cute::is_same_v<Element_, cutlass::float_e4m3_t> || cute::is_same_v<Element_, int8_t>);
  using ElementA = Element_;
  using ElementB = Element_;
  using ElementC = void;  // no source operand: D = A @ B^T
  using ElementD = cutlass::bfloat16_t;
  using ElementAccumulator = float;
  using ElementCompute = float;
  // StrideA, StrideB, StrideD: ContiguousStrides (the expert selects B and SFB only).

  static constexpr int AlignmentA = 128 / cutlass::sizeof_bits<ElementA>::value;
  static constexpr int AlignmentB = 128 / cutlass::sizeof_bits<ElementB>::value;
  static constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  // SFA MN-major ([K/128, M], read by TMA), SFB K-major ([E, N/GroupN, K/128]).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, GroupN, 128, cute::GMMA::Major::MN,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CutlassEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cute::conditional_t<Epilogue == kWholeTileBf16, Shape<_128, _64>,
                          cutlass::epilogue::collective::EpilogueTileAuto>,
      ElementAccumulator, ElementCompute, ElementC, StrideD, AlignmentD,
      ElementD, StrideD, AlignmentD, cutlass::epilogue::TmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC,
                                                   ElementCompute>>::CollectiveOp;
  // The fused epilogue takes the subtiled one's typedefs (pipelines) and nothing else from it.
  using CollectiveEpilogue = cute::conditional_t<
      Epilogue == kWholeTileBf16, Sm90WholeTileEpilogue<CutlassEpilogue, TileShape>,
      cute::conditional_t<Epilogue == kSiluQuantInt8, Sm90SiluQuantEpilogue<CutlassEpilogue, TileShape>,
                          CutlassEpilogue>>;
  static_assert(Epilogue != kSiluQuantInt8 || cute::is_same_v<Element_, int8_t>, "the fused epilogue is INT8's");

  using CutlassMainloop = typename WithElement<
      typename cutlass::gemm::collective::CollectiveBuilder<
          cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::float_e4m3_t,
          cute::tuple<StrideA, LayoutSFA>, AlignmentA, cutlass::float_e4m3_t,
          cute::tuple<StrideB, LayoutSFB>, AlignmentB, ElementAccumulator, TileShape, ClusterShape,
          cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
              sizeof(typename CollectiveEpilogue::SharedStorage))>,
          cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum>::CollectiveOp,
      ElementA, TileShape>::type;
  using CollectiveMainloop = Sm90BlockScaledMainloop<CutlassMainloop, Schedule, Epilogue == kSiluQuantInt8>;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                          CollectiveEpilogue,
                                                          ExpertBlockSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};


// Whether a_scale [M, K/128] is the first M columns of an MN-major [K/128, M4] buffer, seen
// transposed (M4 = M rounded up to 4).
inline bool a_scale_is_mn_major(const at::Tensor& a_scale) {
  const int64_t m4 = (a_scale.size(0) + 3) / 4 * 4;
  return a_scale.dim() == 2 && a_scale.stride(0) == 1 && a_scale.stride(1) == m4;
}

// The scales in the kernel's layouts: SFA MN-major [K/128, M4] (M4 = M rounded up to 4, as TMA
// wants 16-byte row strides; the extra columns are never applied to a stored row) and SFB with
// each 128x128 block scale repeated for the 128 / kGroupN column groups, [E, N/kGroupN, K/128].
// Both are small next to the GEMM (M * K/128 and E * N/kGroupN * K/128 floats). A b_scale given
// in SFB's layout already (the Python backend repeats the weights' scales once, when it prepares
// them) is used as it is: repeating it here costs a copy kernel per GEMM call, which a
// CUDA-graphed decode step pays in full. So is an a_scale that is SFA already, seen transposed
// (strides (1, M4): the quantizers and the scatter can write it so).
template <class Cfg>
std::pair<at::Tensor, at::Tensor> kernel_scales(const at::Tensor& a_scale, const at::Tensor& b_scale,
                                                int64_t n) {
  const int64_t m = a_scale.size(0), m4 = (m + 3) / 4 * 4;
  at::Tensor sfa;
  if (a_scale_is_mn_major(a_scale)) {
    sfa = a_scale.as_strided({a_scale.size(1), m4}, {m4, 1});
  } else {
    sfa = at::empty({a_scale.size(1), m4}, a_scale.options());
    sfa.narrow(1, 0, m).copy_(a_scale.t());
  }
  const bool repeated = b_scale.size(1) * Cfg::kGroupN == n;
  TORCH_CHECK(repeated || b_scale.size(1) * 128 == n, "b_scale has ", b_scale.size(1),
              " scales along N=", n, "; expected N/128 or N/", Cfg::kGroupN);
  return {sfa, repeated ? b_scale : b_scale.repeat_interleave(128 / Cfg::kGroupN, 1)};
}

// The bf16 epilogues' arguments: D = A @ B^T into out [M, N].
template <class Cfg>
typename Cfg::CollectiveEpilogue::Arguments bf16_epilogue_arguments(at::Tensor& out, int64_t n, int64_t k) {
  auto stride_d = std::get<2>(contiguous_strides<Cfg>(n, k));
  typename Cfg::CollectiveEpilogue::Arguments epilogue{
      {}, nullptr, stride_d, reinterpret_cast<typename Cfg::ElementD*>(out.data_ptr()), stride_d};
  epilogue.thread.alpha = 1.0f;
  epilogue.thread.beta = 0.0f;
  return epilogue;
}

// Arguments over the kernel_scales of the operands, with the epilogue's.
template <class Cfg>
typename Cfg::Gemm::Arguments make_arguments(typename Cfg::CollectiveEpilogue::Arguments epilogue,
                                             const at::Tensor& a, const at::Tensor& sfa,
                                             const at::Tensor& b, const at::Tensor& sfb,
                                             const int32_t* block_expert, int sm_count,
                                             int64_t raster_along_n, int64_t max_swizzle) {
  const int num_experts = static_cast<int>(b.size(0));
  const int n = static_cast<int>(b.size(1));
  const int k = static_cast<int>(b.size(2));
  const int m = static_cast<int>(a.size(0));
  auto [stride_a, stride_b, stride_d] = contiguous_strides<Cfg>(n, k);
  // SFA holds every expert's rows in one batch (the mainloop reads it at batch 0).
  auto layout_sfa =
      Cfg::ScaleConfig::tile_atom_to_shape_SFA(make_shape(static_cast<int>(sfa.size(1)), n, k, 1));
  auto layout_sfb = Cfg::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, num_experts));

  typename Cfg::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, num_experts},
      {reinterpret_cast<const typename Cfg::ElementA*>(a.data_ptr()), stride_a,
       reinterpret_cast<const typename Cfg::ElementB*>(b.data_ptr()), stride_b,
       sfa.data_ptr<float>(), layout_sfa, sfb.data_ptr<float>(), layout_sfb},
      epilogue,
      hardware_info(a, sm_count)};
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = raster_along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = static_cast<int>(max_swizzle);
  set_block_table(args.scheduler, block_expert, m);
  args.mainloop.block_expert = block_expert;
  args.mainloop.num_m_blocks = args.scheduler.num_m_blocks;
  return args;
}

// Runs the GEMM for configuration Cfg over the [ceil(M / 128)] table of each row block's expert
// (expert_block_table). Shapes were checked by the caller; M > 0.
template <class Cfg>
void run_block_scaled_gemm(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                           const at::Tensor& b, const at::Tensor& b_scale,
                           const at::Tensor& block_expert, int64_t raster_along_n,
                           int64_t max_swizzle, bool pdl) {
  const int sm_count = at::cuda::getDeviceProperties(a.get_device())->multiProcessorCount;
  auto [sfa, sfb] = kernel_scales<Cfg>(a_scale, b_scale, b.size(1));
  auto args = make_arguments<Cfg>(bf16_epilogue_arguments<Cfg>(out, b.size(1), b.size(2)), a, sfa, b, sfb,
                                  block_expert.data_ptr<int32_t>(), sm_count, raster_along_n, max_swizzle);
  run_gemm<typename Cfg::Gemm>(args, a, pdl);
}

// The same with the fused activation (Sm90SiluQuantEpilogue): q [M, N/2] int8 and q_scale
// [M, N/256] fp32 (any strides: MN-major for the contiguous GEMM2, row-major for the masked one).
template <class Cfg>
void run_silu_quant_gemm(at::Tensor& q, at::Tensor& q_scale, const at::Tensor& a,
                         const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
                         const at::Tensor& block_expert, int64_t raster_along_n, int64_t max_swizzle,
                         bool pdl) {
  const int sm_count = at::cuda::getDeviceProperties(a.get_device())->multiProcessorCount;
  auto [sfa, sfb] = kernel_scales<Cfg>(a_scale, b_scale, b.size(1));
  typename Cfg::CollectiveEpilogue::Arguments epilogue{
      q.data_ptr<int8_t>(), q_scale.data_ptr<float>(), q.stride(0), q_scale.stride(0), q_scale.stride(1)};
  auto args = make_arguments<Cfg>(epilogue, a, sfa, b, sfb, block_expert.data_ptr<int32_t>(), sm_count,
                                  raster_along_n, max_swizzle);
  run_gemm<typename Cfg::Gemm>(args, a, pdl);
}

// Bytes of workspace GemmKernel::get_workspace_size asks for on this problem (no launch).
template <class Cfg>
int64_t workspace_size_for(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                           const at::Tensor& b, const at::Tensor& b_scale, int64_t sm_count) {
  auto [sfa, sfb] = kernel_scales<Cfg>(a_scale, b_scale, b.size(1));
  auto args = make_arguments<Cfg>(bf16_epilogue_arguments<Cfg>(out, b.size(1), b.size(2)), a, sfa, b, sfb,
                                  nullptr, static_cast<int>(sm_count), 1, 1);
  return static_cast<int64_t>(Cfg::Gemm::get_workspace_size(args));
}

// The configurations built: cooperative 128 x TileN x 128 tiles (two consumer warpgroups share a
// 128-row block), 2x1 clusters (the B tile multicast to two M blocks of one expert). TileN 192 is
// DeepGEMM's choice for these shapes (FP8) and the default; its tiles meet two 128-column weight
// blocks, so the weight scales are read in 64-column groups. INT8 also builds 128 and 256 (both
// divide N = 4096 and 7168, where 192 leaves a part-empty last tile column), whose tiles each
// lie on whole 128-column weight blocks: one weight scale per 128 columns, as stored.
template <int TileN>
using BlockScaledTile = Shape<_128, Int<TileN>, _128>;
using BlockScaledCluster = Shape<_2, _1, _1>;
template <int TileN>
constexpr int kWeightScaleGroupN = TileN % 128 == 0 ? 128 : 64;
// Whole-tile epilogue, four mainloop stages at TileN 192: the epilogue's fixed cost per tile
// weighs most when a tile has few k blocks. CUTLASS's subtiled epilogue, five mainloop stages: a
// deeper pipeline for long k loops.
template <class Element, int Schedule, int TileN = 192>
using ShortKConfig = BlockScaledContiguousGemmConfig<Element, BlockScaledTile<TileN>, BlockScaledCluster,
                                                     kWeightScaleGroupN<TileN>, kWholeTileBf16, Schedule>;
template <class Element, int Schedule, int TileN = 192>
using LongKConfig = BlockScaledContiguousGemmConfig<Element, BlockScaledTile<TileN>, BlockScaledCluster,
                                                    kWeightScaleGroupN<TileN>, kSubtiledBf16, Schedule>;
// GEMM1 of an INT8 block pass with the activation fused (Sm90SiluQuantEpilogue): 128 x 256 tiles.
template <int Schedule>
using SiluQuantConfig = BlockScaledContiguousGemmConfig<int8_t, BlockScaledTile<256>, BlockScaledCluster, 128,
                                                        kSiluQuantInt8, Schedule>;
// On the H200 (session 11, docs/fp8.md) the whole-tile epilogue took FP8 GEMM2 (K = 2048) from
// 1.13 to 1.08-1.10x DeepGEMM's time, and was 0-5 % slower on GEMM1 (K = 7168). The boundary
// between the two measured K is a choice.
constexpr int64_t kWholeTileEpilogueMaxK = 4096;

// The GEMM for operands of type Element, in the configuration for b's K, the consumer
// warpgroups' Schedule and the tile's width TileN. Shapes were checked by the caller; M > 0.
template <class Element, int Schedule = kLockstep, int TileN = 192>
void run_block_scaled_by_k(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                           const at::Tensor& b, const at::Tensor& b_scale,
                           const at::Tensor& block_expert, int64_t raster_along_n,
                           int64_t max_swizzle, bool pdl) {
  // A kSubtiledEpilogue variant never runs the whole-tile configuration: not built for it.
  if constexpr ((Schedule & kSubtiledEpilogue) == 0) {
    if (b.size(2) <= kWholeTileEpilogueMaxK) {
      run_block_scaled_gemm<ShortKConfig<Element, Schedule, TileN>>(
          out, a, a_scale, b, b_scale, block_expert, raster_along_n, max_swizzle, pdl);
      return;
    }
  }
  run_block_scaled_gemm<LongKConfig<Element, Schedule, TileN>>(
      out, a, a_scale, b, b_scale, block_expert, raster_along_n, max_swizzle, pdl);
}

// The INT8 block kernel's variants, in the order of the op's `schedule` index (named by
// epmoe.experts.cutlass_backend.INT8_BLOCK_SCHEDULES): the consumer warpgroups' schedule and the
// tile's width. int8_block_contiguous_gemm.cu picks one at run time; each is instantiated in its
// own source file (int8_block_*_gemm.cu) so that they compile in parallel.
struct Int8BlockVariant {
  int schedule;
  int tile_n;
};
constexpr Int8BlockVariant kInt8BlockVariants[] = {
    {kSplitN4 + kZeroStart + kNativeConvert + kSubtiledEpilogue, 256},
    {kSplitN4 + kZeroStart + kNativeConvert + kSubtiledEpilogue + kUnroll2, 256},
    {kSplitN4 + kZeroStart + kNativeConvert + kSubtiledEpilogue + kUnroll4, 256},
};
constexpr int kNumInt8BlockVariants = sizeof(kInt8BlockVariants) / sizeof(kInt8BlockVariants[0]);

template <int V>
void int8_block_gemm_variant(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                             const at::Tensor& b, const at::Tensor& b_scale,
                             const at::Tensor& block_expert, int64_t raster_along_n,
                             int64_t max_swizzle, bool pdl) {
  static_assert(V >= 0 && V < kNumInt8BlockVariants);
  run_block_scaled_by_k<int8_t, kInt8BlockVariants[V].schedule, kInt8BlockVariants[V].tile_n>(
      out, a, a_scale, b, b_scale, block_expert, raster_along_n, max_swizzle, pdl);
}

// The variants that also build GEMM1 with the fused activation (int8_block_silu_gemm.cu picks one
// at run time): the fastest 128 x 256 ones. The binding keeps the same list (kSiluQuantVariants).
constexpr int kSiluQuantVariants[] = {1, 2};
constexpr int kNumSiluQuantVariants = sizeof(kSiluQuantVariants) / sizeof(kSiluQuantVariants[0]);

template <int V>
void int8_block_silu_gemm_variant(at::Tensor& q, at::Tensor& q_scale, const at::Tensor& a,
                                  const at::Tensor& a_scale, const at::Tensor& b,
                                  const at::Tensor& b_scale, const at::Tensor& block_expert,
                                  int64_t raster_along_n, int64_t max_swizzle, bool pdl) {
  static_assert(kInt8BlockVariants[V].tile_n == 256, "the fused epilogue takes 128 x 256 tiles");
  run_silu_quant_gemm<SiluQuantConfig<kInt8BlockVariants[V].schedule>>(
      q, q_scale, a, a_scale, b, b_scale, block_expert, raster_along_n, max_swizzle, pdl);
}

template <class Element>
int64_t workspace_size_by_k(at::Tensor& out, const at::Tensor& a, const at::Tensor& a_scale,
                            const at::Tensor& b, const at::Tensor& b_scale, int64_t sm_count) {
  return b.size(2) <= kWholeTileEpilogueMaxK
             ? workspace_size_for<ShortKConfig<Element, kLockstep>>(out, a, a_scale, b, b_scale, sm_count)
             : workspace_size_for<LongKConfig<Element, kLockstep>>(out, a, a_scale, b, b_scale, sm_count);
}

}  // namespace epmoe
