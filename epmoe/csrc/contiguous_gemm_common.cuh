// What epmoe's CUTLASS GEMMs over the contiguous expert layout share (Hopper, sm_90a): the layout
// is ONE CUTLASS problem (M, N, K, L = experts) whose A and D have a static zero stride in L, so one
// TMA descriptor serves every expert's rows while B (and its scales) move with L. The tile
// scheduler below gives each 128-row block of A the batch index of its expert, from a table
// built on the GPU from the offsets (block_expert_kernel; no host synchronisation). Every
// segment is therefore padded to 128 rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cute/tensor.hpp"
#include "cutlass/arch/grid_dependency_control.h"

// A GEMM launched as a programmatic dependent (run_gemm's pdl) is safe only with CUTLASS's grid
// dependency control compiled in: without it CUTLASS still sets the launch attribute, but its
// kernels (and the scheduler's wait below) no longer wait for the kernel before.
#if !defined(CUTLASS_ENABLE_GDC_FOR_SM90)
#error "epmoe's CUTLASS GEMMs need -DCUTLASS_ENABLE_GDC_FOR_SM90 (NVCC_FLAGS in epmoe/experts/cutlass_backend.py)"
#endif
// ... and a device pass for sm_90a: for plain sm_90 CUTLASS leaves the control out as well.
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_GDC_ENABLED)
#error "epmoe's CUTLASS GEMMs are built for sm_90a (-gencode=arch=compute_90a,code=sm_90a)"
#endif
#include "cutlass/cutlass.h"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace epmoe {

using namespace cute;

constexpr int kRowBlock = 128;  // segment alignment = the tile's M

#define EPMOE_CHECK_CUTLASS(status, what)                                                          \
  TORCH_CHECK((status) == cutlass::Status::kSuccess, "epmoe CUTLASS contiguous GEMM: ", what,      \
              " failed: ", cutlassGetStatusString(status))

// Dense: the schedule of one weight over every row (a dense GEMM), reading no block table at all
// (every block in range is expert 0's, whatever the arguments hold). The pingpong kernel's second
// consumer advances before it asks for its first tile, i.e. before initial_work_tile_info's PDL
// wait, and stepping over skipped blocks reads the table: only this scheduler may serve it.
template <bool Dense>
struct BlockSchedulerTag {};
using ExpertBlockSchedulerTag = BlockSchedulerTag<false>;
using DenseBlockSchedulerTag = BlockSchedulerTag<true>;

// The expert of 128-row block m (block_expert[m]), or -1 past the last segment. Without a table
// (nullptr: a dense GEMM, one weight over every row) every block is expert 0's.
CUTLASS_DEVICE int32_t expert_of_block(const int32_t* block_expert, int num_blocks, int m) {
  return m < num_blocks ? (block_expert != nullptr ? block_expert[m] : 0) : -1;
}

// With clusters of two M blocks (2 x 1), a block of no expert whose partner has one still runs, so
// the pair stays in step: with the partner's expert, at the block index plus this offset, where all
// its rows lie past M (TMA zero-fills its loads and drops its stores).
CUTLASS_HOST_DEVICE int parked_block_offset(int num_blocks) { return num_blocks + (num_blocks & 1); }

// The expert block m runs with in a cluster of two M blocks: its own, else its partner's (m ^ 1),
// else -1 (the pair has no work).
CUTLASS_DEVICE int32_t paired_expert_of_block(const int32_t* block_expert, int num_blocks, int m) {
  const int32_t e = expert_of_block(block_expert, num_blocks, m);
  return e >= 0 ? e : expert_of_block(block_expert, num_blocks, m ^ 1);
}

// CUTLASS's static persistent schedule over the (M blocks x N blocks) of one batch, with the batch
// index of a tile read from block_expert[M block]. A block of no expert (-1: rows past the last
// segment) is skipped, or parked (see parked_block_offset) when its cluster partner has an expert.
// The CTAs of a cluster make the same decisions, so they stay in step. Dense: see
// BlockSchedulerTag.
template <int ClusterM, bool Dense = false>
class ExpertBlockTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  static_assert(ClusterM == 1 || ClusterM == 2);
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  static constexpr bool kDense = Dense;
  using WorkTileInfo = typename Base::WorkTileInfo;
  struct Arguments : Base::Arguments {
    const int32_t* block_expert = nullptr;  // [num_m_blocks] expert of each 128-row block, or -1
    int32_t num_m_blocks = 0;
    bool pdl = false;  // launched as a programmatic dependent: trigger the next launch early
  };
  struct Params : Base::Params {
    const int32_t* block_expert = nullptr;
    int32_t num_m_blocks = 0;
    bool pdl = false;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(
        one_batch(problem_shape_mnkl), tile_shape, cluster_shape, hw_info, arguments, workspace,
        epilogue_subtile, ktile_start_alignment_count);
    p.block_expert = arguments.block_expert;
    p.num_m_blocks = arguments.num_m_blocks;
    p.pdl = arguments.pdl;
    return p;
  }

  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL problem_shape_mnkl,
                             BlockShape cta_shape, ClusterShape cluster_shape,
                             cutlass::KernelHardwareInfo hw_info, Arguments arguments,
                             bool truncate_by_problem_size = true) {
    return Base::get_grid_shape(params, one_batch(problem_shape_mnkl), cta_shape, cluster_shape,
                                hw_info, arguments, truncate_by_problem_size);
  }

  CUTLASS_HOST_DEVICE ExpertBlockTileScheduler() {}

  CUTLASS_DEVICE explicit ExpertBlockTileScheduler(Params const& params) : params_(params) {
#if defined(__CUDA_ARCH__)
    if (params.raster_order_ == RasterOrder::AlongN) {
      linear_idx_ = uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * uint64_t(gridDim.x);
    } else {
      linear_idx_ = uint64_t(blockIdx.x) * uint64_t(gridDim.y) + uint64_t(blockIdx.y);
    }
    grid_size_ = uint64_t(gridDim.x) * uint64_t(gridDim.y) * uint64_t(gridDim.z);
#endif
  }

  // Every warp of the kernel asks for its first tile before it touches global memory, and this
  // is its first read of the block table. Launched as a programmatic dependent (run_gemm with
  // pdl), the kernel starts while the kernels before it may still be writing the table, the
  // operands or the scales, so every warp waits for them here. CUTLASS's own waits come after
  // this read and only in some warps: its mainloop and epilogue producers wait, but the
  // auxiliary producer warp (which fetches the block-scaled kernels' weight scales) and the
  // consumer warps (the table, the epilogue's scale vectors) have no wait of their own, so this
  // one is theirs. What runs before it in every warp (the epilogue's constructors, TMA descriptor
  // prefetches from the kernel parameters, shared-memory barriers) reads no global memory: the
  // epilogues take scalars by value and their broadcasts have static strides; an alpha pointer or
  // a runtime zero-stride broadcast would be read there, before this wait. Without PDL the wait
  // returns at once.
  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    cutlass::arch::wait_on_dependent_grids();
    return get_current_work();
  }

  CUTLASS_DEVICE WorkTileInfo get_current_work() {
    linear_idx_ = next_expert_tile(linear_idx_);
    return work_at(linear_idx_);
  }

  // Past advance_count tiles of this CTA's walk (tiles that get_current_work returns), not past
  // advance_count grid strides: CUTLASS's pingpong kernel has its producer step by one tile and
  // its two consumers start one tile apart and step by two (advance_count 2), and a consumer's
  // n-th tile must be the producer's (2n + its index)-th. A stride of two grids would make a
  // consumer and the producer disagree wherever a skipped tile lies between (a block of no
  // expert; in the dense GEMM the M blocks the swizzle rounds the grid up to).
  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) {
    linear_idx_ = tiles_ahead(linear_idx_, advance_count);
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(get_current_work(), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work);
  }

  // CUTLASS calls this after each tile's MMAs only to let the next kernel launch once this CTA
  // is on its last tile (the cooperative and pingpong kernels with grid dependency control).
  // Without a programmatic dependent launch it answers no: EPMOE_PDL=0 then means that no kernel
  // of the package triggers its dependents early, and no tile pays for the look-ahead.
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    // next_expert_tile stops at a tile with an expert or past the problem: only the latter is last.
    return params_.pdl && next_expert_tile(tiles_ahead(linear_idx_, advance_count)) >= params_.blocks_per_problem_;
  }

 private:
  template <class ProblemShapeMNKL>
  static auto one_batch(ProblemShapeMNKL s) {
    return make_shape(get<0>(s), get<1>(s), get<2>(s), 1);
  }

  // This CTA's first linear index at or after idx whose M block has an expert (or one past the
  // problem, which work_at reports as invalid).
  CUTLASS_DEVICE uint64_t next_expert_tile(uint64_t idx) const {
    for (;; idx += grid_size_) {
      WorkTileInfo w = work_at(idx);
      if (!w.is_valid() || w.L_idx >= 0) return idx;
    }
  }

  // One grid stride past each of count tiles of the walk from idx (each settled on first by
  // next_expert_tile, a no-op where idx already is one): where get_current_work then finds the
  // tile count tiles on.
  CUTLASS_DEVICE uint64_t tiles_ahead(uint64_t idx, uint32_t count) const {
    for (uint32_t i = 0; i < count; ++i) idx = next_expert_tile(idx) + grid_size_;
    return idx;
  }

  // The base class's mapping of a linear index to (m, n) over one batch; L_idx = the expert of
  // the M block, or -1.
  CUTLASS_DEVICE WorkTileInfo work_at(uint64_t idx) const {
    if (idx >= params_.blocks_per_problem_) return WorkTileInfo::invalid_work_tile();
    uint64_t blk = params_.divmod_cluster_shape_minor_.divide(idx);
    auto [m, n] = Base::get_work_idx_m_and_n(
        blk, params_.divmod_cluster_shape_major_, params_.divmod_cluster_shape_minor_,
        params_.divmod_cluster_blk_major_, params_.log_swizzle_size_, params_.raster_order_);
    const int32_t* table = Dense ? nullptr : params_.block_expert;
    const int32_t e = expert_of_block(table, params_.num_m_blocks, m);
    if constexpr (ClusterM == 2) {
      const int32_t paired = paired_expert_of_block(table, params_.num_m_blocks, m);
      if (e < 0 && paired >= 0) return {m + parked_block_offset(params_.num_m_blocks), n, paired, true};
    }
    return {m, n, e, true};
  }

  Params params_;
  uint64_t linear_idx_ = 0;
  uint64_t grid_size_ = 1;
};

}  // namespace epmoe

namespace cutlass::gemm::kernel::detail {
template <bool Dense, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<epmoe::BlockSchedulerTag<Dense>, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = epmoe::ExpertBlockTileScheduler<int(cute::size<0>(ClusterShape{})), Dense>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace epmoe {

// The first statement of a kernel that launch_table launches, with the launch's pdl: as a
// programmatic dependent, let the GEMM after it launch now (its CTAs set up and then wait in the
// scheduler), then wait for the kernel before, which may have written the offsets. On a plain
// launch nothing: the next kernel is not let in early.
CUTLASS_DEVICE void dependent_start(bool pdl) {
  if (pdl) {
    cutlass::arch::launch_dependent_grids();
    cutlass::arch::wait_on_dependent_grids();
  }
}

// block_expert[b] = the e with offsets[e] <= 128 b < offsets[e + 1], else -1 (one thread a block).
// Threads 0..E also check the offsets (non-decreasing multiples of 128, at least 0, at most rows):
// a bad batch stops with a device-side assert before the GEMM runs, without a host sync; the
// offending index and values are printed first.
static __global__ void block_expert_kernel(int num_blocks, int num_experts, int64_t rows,
                                           const int32_t* __restrict__ offsets,
                                           int32_t* block_expert, bool pdl) {
  dependent_start(pdl);
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t <= num_experts) {
    const int32_t o = offsets[t], previous = t == 0 ? 0 : offsets[t - 1];
    const bool ok = o % kRowBlock == 0 && o >= previous && (t < num_experts || o <= rows);
    if (!ok) {
      printf("epmoe: expert_offsets[%d] = %d (the one before: %d; rows of a: %lld)\n", t, o,
             previous, static_cast<long long>(rows));
    }
    CUDA_KERNEL_ASSERT_MSG(ok, "expert_offsets must be non-decreasing multiples of 128, at least 0 "
                               "and at most the rows of a");
  }
  if (t >= num_blocks) return;
  const int64_t row = int64_t(t) * kRowBlock;
  int lo = 0, hi = num_experts;  // the first e with offsets[e + 1] > row
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid + 1] > row) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  block_expert[t] = (lo < num_experts && offsets[lo] <= row) ? lo : -1;
}

// The masked layout ([E, max_m, K] seen as E * max_m rows, max_m a multiple of 128):
// block_expert[b] = e = 128 b / max_m when the block starts below e * max_m + masked_m[e], else -1,
// so blocks holding no valid row get no tiles. Threads 0..E-1 also check masked_m (0 to max_m):
// a bad batch stops with a device-side assert before the GEMM runs, without a host sync.
static __global__ void masked_block_expert_kernel(int num_blocks, int num_experts, int max_m,
                                                  const int32_t* __restrict__ masked_m,
                                                  int32_t* block_expert, bool pdl) {
  dependent_start(pdl);
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < num_experts) {
    const int32_t v = masked_m[t];
    const bool ok = v >= 0 && v <= max_m;
    if (!ok) printf("epmoe: masked_m[%d] = %d (rows per expert in the layout: %d)\n", t, v, max_m);
    CUDA_KERNEL_ASSERT_MSG(ok, "masked_m must lie between 0 and the layout's rows per expert");
  }
  if (t >= num_blocks) return;
  const int64_t row = int64_t(t) * kRowBlock;
  const int e = static_cast<int>(row / max_m);
  block_expert[t] = (e < num_experts && row - int64_t(e) * max_m < masked_m[e]) ? e : -1;
}

// The configurations' stride types (they derive from this): A [M, K] and D [M, N] one tensor each,
// a static zero stride in L (every expert's rows in one TMA descriptor); B [E, N, K] moves with L.
struct ContiguousStrides {
  using StrideA = cute::Stride<int64_t, cute::_1, cute::_0>;
  using StrideB = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = cute::Stride<int64_t, cute::_1, cute::_0>;
};

// The strides of A [M, K] and D [M, N] (a static zero in L: one tensor serves every expert) and
// of B [E, N, K] (moves with L).
template <class Cfg>
auto contiguous_strides(int64_t n, int64_t k) {
  return std::make_tuple(typename Cfg::StrideA{k, cute::_1{}, cute::_0{}},
                         typename Cfg::StrideB{k, cute::_1{}, n * k},
                         typename Cfg::StrideD{n, cute::_1{}, cute::_0{}});
}

inline cutlass::KernelHardwareInfo hardware_info(const at::Tensor& a, int sm_count) {
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = a.get_device();
  hw_info.sm_count = sm_count;
  return hw_info;
}

// The scheduler's block table (block_expert_table) over the ceil(m / 128) blocks of A.
template <class SchedulerArguments>
void set_block_table(SchedulerArguments& scheduler, const int32_t* block_expert, int m) {
  scheduler.block_expert = block_expert;
  scheduler.num_m_blocks = (m + kRowBlock - 1) / kRowBlock;
}

// What the kernel asks of an epilogue that reads no source operand (D written from the
// accumulators alone: Sm90WholeTileEpilogue, Sm90SiluQuantEpilogue): CUTLASS's epilogue Base
// supplies the copy and pipeline types the kernel allocates, the producer's load is a no-op and
// each tile is one store.
template <class Base>
struct EpilogueWithoutSource {
  using StrideC = typename Base::StrideC;
  using StrideD = typename Base::StrideD;
  using GmemTiledCopyC = typename Base::GmemTiledCopyC;
  using GmemTiledCopyD = typename Base::GmemTiledCopyD;
  using ThreadEpilogueOp = typename Base::ThreadEpilogueOp;
  using LoadPipeline = typename Base::LoadPipeline;
  using LoadPipelineState = typename Base::LoadPipelineState;
  using StorePipeline = typename Base::StorePipeline;
  using StorePipelineState = typename Base::StorePipelineState;
  using PipelineStorage = typename Base::PipelineStorage;
  static constexpr bool RequiresTransactionBytes = Base::RequiresTransactionBytes;

  template <class TileShapeMNK>
  CUTLASS_HOST_DEVICE static constexpr int get_load_pipe_increment(TileShapeMNK) {
    return 1;
  }
  template <class TileShapeMNK>
  CUTLASS_HOST_DEVICE static constexpr int get_store_pipe_increment(TileShapeMNK) {
    return 1;
  }
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  // No source operand: the kernel never calls load (is_producer_load_needed is false).
  template <class... Ts>
  CUTLASS_DEVICE auto load(LoadPipeline, LoadPipelineState state, Ts&&...) {
    return state;
  }
  CUTLASS_DEVICE auto load_tail(LoadPipeline, LoadPipelineState state) { return state; }
};

// can_implement, a workspace from torch's allocator, initialize and run on a's current stream;
// with pdl as a programmatic dependent launch (the kernel's warps wait in the scheduler's
// initial_work_tile_info before they read anything; its last tiles let the next kernel launch).
template <class Gemm>
void run_gemm(typename Gemm::Arguments args, const at::Tensor& a, bool pdl) {
  auto stream = at::cuda::getCurrentCUDAStream(a.get_device());
  args.scheduler.pdl = pdl;  // whether its last tiles let the next kernel launch (is_last_tile)
  Gemm gemm;
  EPMOE_CHECK_CUTLASS(gemm.can_implement(args), "can_implement");
  const size_t workspace_bytes = Gemm::get_workspace_size(args);
  auto workspace = at::empty({static_cast<int64_t>(workspace_bytes > 0 ? workspace_bytes : 1)},
                             a.options().dtype(at::kByte));
  EPMOE_CHECK_CUTLASS(gemm.initialize(args, workspace.data_ptr(), stream), "initialize");
  EPMOE_CHECK_CUTLASS(gemm.run(stream, /*cuda_adapter=*/nullptr, pdl), "run");
}

// kernel<<<blocks, threads, 0, stream>>>(args...) for a kernel that begins with
// dependent_start(), as a programmatic dependent launch when pdl.
template <class... Params, class... Args>
void launch_table(void (*kernel)(Params...), int blocks, int threads, cudaStream_t stream, bool pdl,
                  Args... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

// block_expert_kernel over the offsets of a's rows: the [ceil(rows / 128)] int32 table, on a's
// device and the current stream.
// Static, like the kernel it launches: each source file that includes this has its own copy.
static at::Tensor block_expert_table(const at::Tensor& a, const at::Tensor& offsets, bool pdl) {
  auto stream = at::cuda::getCurrentCUDAStream(a.get_device());
  const int num_blocks = static_cast<int>((a.size(0) + kRowBlock - 1) / kRowBlock);
  auto block_expert = at::empty({num_blocks}, a.options().dtype(at::kInt));
  const int threads = 128;
  const int num_experts = static_cast<int>(offsets.size(0) - 1);
  const int checks = std::max(num_blocks, num_experts + 1);
  launch_table(block_expert_kernel, (checks + threads - 1) / threads, threads, stream, pdl,
               num_blocks, num_experts, a.size(0), offsets.data_ptr<int32_t>(),
               block_expert.data_ptr<int32_t>(), pdl);
  return block_expert;
}

// masked_block_expert_kernel over the E * max_m rows of a masked batch (a: [E * max_m, K]).
static at::Tensor masked_block_expert_table(const at::Tensor& a, const at::Tensor& masked_m,
                                            int64_t max_m, bool pdl) {
  auto stream = at::cuda::getCurrentCUDAStream(a.get_device());
  const int num_blocks = static_cast<int>((a.size(0) + kRowBlock - 1) / kRowBlock);
  auto block_expert = at::empty({num_blocks}, a.options().dtype(at::kInt));
  const int threads = 128;
  const int num_experts = static_cast<int>(masked_m.size(0));
  const int checks = std::max(num_blocks, num_experts);
  launch_table(masked_block_expert_kernel, (checks + threads - 1) / threads, threads, stream, pdl,
               num_blocks, num_experts, static_cast<int>(max_m), masked_m.data_ptr<int32_t>(),
               block_expert.data_ptr<int32_t>(), pdl);
  return block_expert;
}

// The block table of either layout: segments are the contiguous layout's [E+1] offsets when
// masked_max_m is 0, else the masked layout's [E] masked_m with masked_max_m rows per expert.
static at::Tensor expert_block_table(const at::Tensor& a, const at::Tensor& segments,
                                     int64_t masked_max_m, bool pdl) {
  return masked_max_m > 0 ? masked_block_expert_table(a, segments, masked_max_m, pdl)
                          : block_expert_table(a, segments, pdl);
}

}  // namespace epmoe
