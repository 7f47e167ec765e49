// The CUDA skeleton of AdaFisher's update and SINGD's diagonal step (the CPU one:
// cpu/row_column.h): each parameter viewed as [rows, cols], each element updated from its own
// values and a row factor R[r] times a column factor C[c], or from no factors (row == nullptr);
// one multi-tensor-apply launch per table of the bucket. The per-element maths is the same `Op`
// the CPU kernel instantiates (adafisher_math.h, singd_math.h); the launch adds what the device
// reads (everything through device pointers: no host sync, capturable in a CUDA graph):
//
//   struct PerTensor;  struct Args;
//   __device__ static bool skip(const Args&);                       // the whole launch does nothing
//   __device__ static Coeffs coeffs(const Args&, const PerTensor&);  // one tensor's coefficients
//
// On the GPU the markers' test costs nothing next to the memory traffic: factored<true> always.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <vector>

#include "cuda/multi_tensor.cuh"

namespace cafin {
namespace cuda {

template <typename Op>
struct RowColumnMeta {
  typename Op::scalar_t* theta;
  const typename Op::scalar_t* grad;
  typename Op::state_t* state;       // nullptr when Op::kState is false
  const typename Op::opmath_t* row;  // R, one entry per row; nullptr: no factors
  const typename Op::opmath_t* col;  // C, from the tensor's own offset on
  int64_t cols;
  typename Op::PerTensor extra;
};

constexpr int kMaxRowColumnTensors = 30;

template <typename Op>
using RowColumnTable = TensorTable<RowColumnMeta<Op>, kMaxRowColumnTensors>;

template <typename Op>
__device__ __forceinline__ void row_column_element(const RowColumnMeta<Op>& t, int64_t row, int64_t col,
                                                   typename Op::opmath_t& theta, typename Op::opmath_t& state,
                                                   typename Op::opmath_t g, const typename Op::Coeffs& c) {
  if (t.row == nullptr) {
    Op::plain(theta, state, g, c);
  } else {
    Op::template factored<true>(theta, state, g, __ldg(t.row + row), __ldg(t.col + col), c);
  }
}

template <typename Op>
__global__ void __launch_bounds__(kBlockSize)
    row_column_kernel(const RowColumnTable<Op> table, const typename Op::Args args) {
  using scalar_t = typename Op::scalar_t;
  using opmath_t = typename Op::opmath_t;
  using state_t = typename Op::state_t;
  if (Op::skip(args)) return;
  const int slot = table.block_to_tensor[blockIdx.x];
  const RowColumnMeta<Op>& t = table.meta[slot];
  const int64_t begin = static_cast<int64_t>(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t end = min(table.numel[slot], begin + kChunkSize);
  const typename Op::Coeffs c = Op::coeffs(args, t.extra);

  // Chunks start at multiples of kChunkSize, so only the pointers and the length decide alignment.
  const bool vectorised = (end - begin) % kILP == 0 && is_aligned<kILP>(t.theta) &&
                          is_aligned<kILP>(t.grad) && (!Op::kState || is_aligned<kILP>(t.state));
  if (vectorised) {
    using ParamVec = AlignedVector<scalar_t, kILP>;
    using StateVec = AlignedVector<state_t, kILP>;
    for (int64_t i = begin + threadIdx.x * kILP; i < end; i += kBlockSize * kILP) {
      ParamVec theta = *reinterpret_cast<const ParamVec*>(t.theta + i);
      const ParamVec grad = *reinterpret_cast<const ParamVec*>(t.grad + i);
      StateVec state;
      if (Op::kState) state = *reinterpret_cast<const StateVec*>(t.state + i);
      int64_t row = i / t.cols;
      int64_t col = i - row * t.cols;
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        opmath_t th = static_cast<opmath_t>(theta.val[k]);
        opmath_t st = Op::kState ? static_cast<opmath_t>(state.val[k]) : opmath_t(0);
        row_column_element<Op>(t, row, col, th, st, static_cast<opmath_t>(grad.val[k]), c);
        theta.val[k] = static_cast<scalar_t>(th);
        if (Op::kState) state.val[k] = static_cast<state_t>(st);
        if (++col == t.cols) {
          col = 0;
          ++row;
        }
      }
      *reinterpret_cast<ParamVec*>(t.theta + i) = theta;
      if (Op::kState) *reinterpret_cast<StateVec*>(t.state + i) = state;
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kBlockSize) {
      const int64_t row = i / t.cols;
      opmath_t th = static_cast<opmath_t>(t.theta[i]);
      opmath_t st = Op::kState ? static_cast<opmath_t>(t.state[i]) : opmath_t(0);
      row_column_element<Op>(t, row, i - row * t.cols, th, st, static_cast<opmath_t>(t.grad[i]), c);
      t.theta[i] = static_cast<scalar_t>(th);
      if (Op::kState) t.state[i] = static_cast<state_t>(st);
    }
  }
}

// One launch per table of the bucket, on the current stream.
template <typename Op>
void row_column_launch(const std::vector<RowColumnMeta<Op>>& metas, const std::vector<int64_t>& numels,
                       const typename Op::Args& args, cudaStream_t stream) {
  static_assert(sizeof(RowColumnTable<Op>) + sizeof(typename Op::Args) <= 4000,
                "kernel arguments must stay under 4 KB");
  multi_tensor_apply<RowColumnMeta<Op>, kMaxRowColumnTensors>(
      metas, numels, [&](const RowColumnTable<Op>& table, int blocks) {
        row_column_kernel<Op><<<blocks, kBlockSize, 0, stream>>>(table, args);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

}  // namespace cuda
}  // namespace cafin
