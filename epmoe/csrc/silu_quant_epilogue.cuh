// GEMM1's epilogue of an INT8 block-scaled experts pass with the activation fused in: from each
// 128 x 256 tile of fp32 sums it writes silu(gate) * up quantized to 1x128 int8, the operand of
// GEMM2, instead of the 128 x 256 bf16 tile that a separate kernel would read back to do the
// same (4 bytes per gate/up pair, written and read: 16 KB a row of DeepSeek-V3's I = 2048).
//
// The mainloop loads each 256-wide tile n as w13's gate rows [128 n, 128 n + 128) and the same up
// rows (Sm90BlockScaledMainloop's GateUpHalves: two 128-row boxes, the weights as stored), so a
// tile is one gate block and its up block, and each thread holds the gate and up sums of the same
// columns in the same registers of the two tile halves (CuTe's SM90 64 x N accumulator: value
// c + 2 h + 4 b is row lane / 4 + 16 warp + 8 h, column 2 (lane % 4) + c + 8 b). A row's 128
// products are spread over the 4 threads of a quad, so its amax takes two shuffles.
//
//   q[row, 128 n + c]  = RN(h / scale), h = silu(gate) * up, c < 128 (int8, ld q_ld)
//   q_scale[row, n]    = max(amax(h over c), 1e-10) / 127 (fp32, strides (scale_row, scale_group))
//
// with the scale rule of the Triton quantizers (epmoe/kernels/quantize.py: divided in IEEE), each
// code h * RN(1 / scale) rounded to nearest even (within 2^-16 of a step of the correctly rounded
// quotient, which the Triton quantizer's two extra corrections reach: four more instructions an
// element here, on the tensor cores' time), no clamp needed; a row with a NaN gets a NaN scale and
// an Inf an Inf one, and codes 0. silu uses the fast exponential and reciprocal (a few ulp, far
// below an int8 step).
// Each warpgroup puts its 64 x 128 codes in shared memory (rows padded to 144 bytes: the 8 rows a
// warp writes at once fall in distinct banks) and stores them as 16-byte rows' chunks, where
// straight from registers each thread would store 2 bytes per 8-column block.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

#include "contiguous_gemm_common.cuh"

namespace epmoe {

using namespace cute;

template <class Base, class TileShape>
struct Sm90SiluQuantEpilogue : EpilogueWithoutSource<Base> {
  static constexpr int kTileM = size<0>(TileShape{});
  static constexpr int kTileN = size<1>(TileShape{});
  static constexpr int kHalfBlocks = kTileN / 16;  // 8-column blocks in one half (gate or up)
  static_assert(kTileM == 128 && kTileN == 256, "a 128-row block x (128 gate + 128 up) columns");

  using Interface = EpilogueWithoutSource<Base>;
  using typename Interface::LoadPipeline;
  using typename Interface::LoadPipelineState;
  using typename Interface::PipelineStorage;
  using typename Interface::StorePipeline;
  using typename Interface::StorePipelineState;
  // D is this epilogue's own: int8 codes and their scales.
  using ElementC = void;
  using ElementD = int8_t;

  struct Arguments {
    int8_t* q = nullptr;        // [M, N / 2]
    float* q_scale = nullptr;   // one per row and 128 output columns
    int64_t q_ld = 0;           // elements between rows of q
    int64_t scale_row = 0;      // elements between rows' scales
    int64_t scale_group = 0;    // elements between a row's consecutive scales
  };
  struct Params : Arguments {
    uint32_t tma_transaction_bytes = 0;  // of the source loads, which this epilogue has none of
  };
  static constexpr int kRowBytes = 144;  // a 128-code row, padded
  struct TensorStorage {
    alignas(128) uint8_t codes[2][64 * kRowBytes];  // one 64-row block per consumer warpgroup
  };
  // Named barriers of one warpgroup's 128 threads (user ids above the mainloop's two).
  static constexpr uint32_t kBufferBarrier = 2;
  struct SharedStorage {
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    Params p;
    static_cast<Arguments&>(p) = args;
    return p;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    // 16-byte chunk stores: q's rows start on 16 bytes.
    return N % kTileN == 0 && args.q != nullptr && args.q_scale != nullptr && args.q_ld >= N / 2 &&
           args.q_ld % 16 == 0 && reinterpret_cast<uintptr_t>(args.q) % 16 == 0;
  }
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const&) {}

  CUTLASS_HOST_DEVICE Sm90SiluQuantEpilogue(Params const& params, TensorStorage&) : params_(params) {}

  // silu(g) * u in fp32.
  CUTLASS_DEVICE static float silu_mul(float g, float u) {
    return __fdividef(g, 1.0f + __expf(-g)) * u;
  }

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine,
            class AccLayout, class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                            StorePipelineState store_state, ProblemShapeMNKL problem_shape_mnkl,
                            TileShapeMNK, TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma,
                            int thread_idx, TensorStorage& shared_tensors, int = -1) {
    static_assert(size(TiledMma{}) == 256, "two consumer warpgroups, 64 rows each");
    static_assert(size(decltype(accumulators){}) == kTileN / 2, "one 64 x N GMMA accumulator");
    const int M = get<0>(problem_shape_mnkl);
    const int m_block = get<0>(tile_coord_mnkl), n_block = get<1>(tile_coord_mnkl);
    const int warp = thread_idx / 32, lane = thread_idx % 32, group = thread_idx / 128;
    const int first_row = m_block * kTileM + warp * 16 + lane / 4;
    uint8_t* buffer = shared_tensors.codes[group];
    // This warpgroup's reads of the previous tile's codes are done before they are overwritten.
    cutlass::arch::NamedBarrier::sync(128, kBufferBarrier + group);
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int row = first_row + 8 * h;
      float v[2 * kHalfBlocks];
      int amax_bits = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kHalfBlocks; ++b) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          const int i = c + 2 * h + 4 * b;
          const float x = silu_mul(accumulators(i), accumulators(i + 4 * kHalfBlocks));
          v[2 * b + c] = x;
          // The integer max of the sign-cleared bits orders NaN above Inf above every finite
          // value (a float max drops NaNs).
          amax_bits = max(amax_bits, __float_as_int(x) & 0x7FFFFFFF);
        }
      }
      amax_bits = max(amax_bits, __shfl_xor_sync(0xFFFFFFFF, amax_bits, 1));
      amax_bits = max(amax_bits, __shfl_xor_sync(0xFFFFFFFF, amax_bits, 2));
      const float amax = __int_as_float(amax_bits);
      const float scale = amax == amax ? __fdiv_rn(fmaxf(amax, 1e-10f), 127.0f) : amax;
      const bool finite = scale < __int_as_float(0x7F800000);
      const float rcp = finite ? __frcp_rn(scale) : 0.0f;
      if (!finite) {  // a row with a NaN or an Inf: codes 0
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 2 * kHalfBlocks; ++i) v[i] = 0.0f;
      }
      uint8_t* row_codes = buffer + ((warp % 4) * 16 + lane / 4 + 8 * h) * kRowBytes + 2 * (lane % 4);
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kHalfBlocks; ++b) {
        // y + 1.5 * 2^23 rounds y (|y| <= 127) to an integer, ties to even, in the low bits.
        const uint32_t c0 = __float_as_uint(v[2 * b] * rcp + 12582912.0f);
        const uint32_t c1 = __float_as_uint(v[2 * b + 1] * rcp + 12582912.0f);
        *reinterpret_cast<uint16_t*>(row_codes + 8 * b) = uint16_t(__byte_perm(c0, c1, 0x0040));
      }
      if (lane % 4 == 0 && row < M) {  // rows past M: a parked block's (see parked_block_offset)
        params_.q_scale[int64_t(row) * params_.scale_row + int64_t(n_block) * params_.scale_group] = scale;
      }
    }
    cutlass::arch::NamedBarrier::sync(128, kBufferBarrier + group);
    // The warpgroup's 64 rows x 128 codes as 16-byte chunks, eight to a row.
    const int t = thread_idx % 128;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 64 * 8 / 128; ++i) {
      const int chunk = t + 128 * i, r = chunk / 8, c = chunk % 8;
      const int row = m_block * kTileM + group * 64 + r;
      if (row < M) {
        *reinterpret_cast<uint4*>(params_.q + int64_t(row) * params_.q_ld + int64_t(n_block) * (kTileN / 2) + 16 * c) =
            *reinterpret_cast<const uint4*>(buffer + r * kRowBytes + 16 * c);
      }
    }
    return cute::make_tuple(load_state, store_state);
  }

  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(load_state, store_state);
  }

 private:
  Params const& params_;
};

}  // namespace epmoe
