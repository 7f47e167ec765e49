// CUDA kernels of the curvature statistics. Each kernel reads the optional step tensor itself and
// does nothing off-interval, so a captured graph replays the same launches every step. Sums run in
// float32 (double for float64 inputs) with atomics; the Conv2d input side never unfolds.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "adafisher_math.h"
#include "checks.h"

namespace cafin {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSegment = 8192;    // elements of one run a warp sums before one atomic
constexpr int64_t kMaxGrid = 4096;    // enough blocks to fill any GPU; longer loops beyond

struct Gate {
  const float* step;  // nullptr: always due
  int64_t interval;
};

__device__ __forceinline__ bool is_due(const Gate& gate) {
  return gate.step == nullptr || statistics_due(*gate.step, gate.interval);
}

Gate make_gate(const std::optional<at::Tensor>& step, int64_t interval) {
  return {step.has_value() ? step->const_data_ptr<float>() : nullptr, interval};
}

template <bool kSquare, typename acc_t, typename scalar_t>
__device__ __forceinline__ acc_t term(scalar_t v) {
  const acc_t x = static_cast<acc_t>(v);
  return kSquare ? x * x : x;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// Block-wide sum, valid in thread 0.
template <typename acc_t>
__device__ acc_t block_sum(acc_t v) {
  __shared__ acc_t partial[kWarps];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  acc_t total = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) total += partial[w];
  }
  return total;
}

int grid_for(int64_t items, int64_t per_block) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxGrid, (items + per_block - 1) / per_block)));
}

// ------------------------------------------------------------------------------------ channel sums

// x viewed [outer, channels] (inner == 1): thread per channel, blockIdx.y splits the rows.
template <bool kSquare, typename scalar_t, typename acc_t>
__global__ void column_sums_kernel(const scalar_t* x, int64_t outer, int64_t channels, acc_t* sums,
                                   Gate gate) {
  if (!is_due(gate)) return;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= channels) return;
  acc_t acc = 0;
  for (int64_t r = blockIdx.y; r < outer; r += gridDim.y) acc += term<kSquare, acc_t>(x[r * channels + c]);
  atomicAdd(sums + c, acc);
}

// x viewed [outer, channels, inner] (inner > 1): a warp per segment of one contiguous run.
template <bool kSquare, typename scalar_t, typename acc_t>
__global__ void run_sums_kernel(const scalar_t* x, int64_t runs, int64_t channels, int64_t inner,
                                acc_t* sums, Gate gate) {
  if (!is_due(gate)) return;
  const int64_t segments = (inner + kSegment - 1) / kSegment;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < runs * segments;
       item += warps) {
    const int64_t run = item / segments;
    const int64_t lo = (item % segments) * kSegment;
    const int64_t hi = std::min(inner, lo + kSegment);
    const scalar_t* data = x + run * inner;
    acc_t acc = 0;
    for (int64_t k = lo + lane; k < hi; k += 32) acc += term<kSquare, acc_t>(data[k]);
    acc = warp_sum(acc);
    if (lane == 0) atomicAdd(sums + run % channels, acc);
  }
}

// Per-channel sums of x (or x^2) over x viewed [outer, channels, inner].
template <bool kSquare, typename scalar_t, typename acc_t>
at::Tensor channel_sums(const at::Tensor& x, const ChannelView& v, const Gate& gate, cudaStream_t stream) {
  const at::Tensor sums = at::zeros({v.channels}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  acc_t* out = sums.mutable_data_ptr<acc_t>();
  if (v.inner == 1) {
    const int64_t columns = (v.channels + kThreads - 1) / kThreads;
    const dim3 grid(static_cast<unsigned>(columns),
                    static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(v.outer, std::min<int64_t>(65535, kMaxGrid * 4 / columns)))));
    column_sums_kernel<kSquare><<<grid, kThreads, 0, stream>>>(data, v.outer, v.channels, out, gate);
  } else {
    const int64_t runs = v.outer * v.channels;
    const int64_t segments = (v.inner + kSegment - 1) / kSegment;
    run_sums_kernel<kSquare><<<grid_for(runs * segments, kWarps), kThreads, 0, stream>>>(
        data, runs, v.channels, v.inner, out, gate);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return sums;
}

// ------------------------------------------------------------------------------------ finishing

// stat[c] += sums[c] / rows (sumsq) or sums[c]^2 / rows (norm grad); appended entries and count.
template <bool kSquareSum, typename stat_t, typename acc_t>
__global__ void finish_channels_kernel(stat_t* stat, const acc_t* sums, int64_t channels, acc_t rows,
                                       bool append_one, Gate gate) {
  if (!is_due(gate)) return;
  for (int64_t c = threadIdx.x; c < channels; c += kThreads) {
    const acc_t s = sums[c];
    stat[c] += static_cast<stat_t>((kSquareSum ? s * s : s) / rows);
  }
  if (threadIdx.x == 0) {
    if (append_one) stat[channels] += stat_t(1);
    stat[channels + (append_one ? 1 : 0)] += stat_t(1);
  }
}

// stat[:3] += [sum_t (u[t] / rest^2)^2 / B^2, T / B^2, 1].
template <typename stat_t, typename acc_t>
__global__ void finish_norm_input_kernel(stat_t* stat, const acc_t* sums, int64_t channels, acc_t rest_sq,
                                         acc_t batch_sq, Gate gate) {
  if (!is_due(gate)) return;
  acc_t acc = 0;
  for (int64_t t = threadIdx.x; t < channels; t += kThreads) {
    const acc_t u = sums[t] / rest_sq;
    acc += u * u;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) {
    stat[0] += static_cast<stat_t>(acc / batch_sq);
    stat[1] += static_cast<stat_t>(static_cast<acc_t>(channels) / batch_sq);
    stat[2] += stat_t(1);
  }
}

#define CAFIN_DISPATCH_INPUT(TYPE, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, "cafin_statistics", __VA_ARGS__)

// The two per-channel statistics: kSquares sums x^2 then divides by the rows (sumsq_stats_);
// otherwise it sums x, then squares and divides by the batch (norm_grad_stats_).
template <bool kSquares>
void channel_statistic(const at::Tensor& stat, const at::Tensor& x, const ChannelView& v,
                       const std::optional<at::Tensor>& step, int64_t interval, bool append_one) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Gate gate = make_gate(step, interval);
  const at::Tensor input = x.contiguous();
  const int64_t divisor = kSquares ? v.outer * v.inner : x.size(0);
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor sums = channel_sums<kSquares, scalar_t, acc_t>(input, v, gate, stream);
    finish_channels_kernel<!kSquares><<<1, kThreads, 0, stream>>>(
        stat.mutable_data_ptr<acc_t>(), sums.const_data_ptr<acc_t>(), v.channels,
        static_cast<acc_t>(divisor), append_one, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void sumsq_stats_cuda(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                      bool append_one, const std::optional<at::Tensor>& step, int64_t interval) {
  const ChannelView v = check_sumsq_stats(stat, x, start_dim, end_dim, append_one, step, interval);
  channel_statistic<true>(stat, x, v, step, interval, append_one);
}

void norm_grad_stats_cuda(const at::Tensor& stat, const at::Tensor& g, int64_t start_dim, int64_t end_dim,
                          const std::optional<at::Tensor>& step, int64_t interval) {
  const ChannelView v = check_norm_grad_stats(stat, g, start_dim, end_dim, step, interval);
  channel_statistic<false>(stat, g, v, step, interval, false);
}

void norm_input_stats_cuda(const at::Tensor& stat, const at::Tensor& x, const std::optional<at::Tensor>& step,
                           int64_t interval) {
  const ChannelView v = check_norm_input_stats(stat, x, step, interval);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Gate gate = make_gate(step, interval);
  const at::Tensor input = x.contiguous();
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor sums = channel_sums<false, scalar_t, acc_t>(input, v, gate, stream);
    const acc_t rest = static_cast<acc_t>(v.inner);
    const acc_t batch = static_cast<acc_t>(v.outer);
    finish_norm_input_kernel<<<1, kThreads, 0, stream>>>(stat.mutable_data_ptr<acc_t>(),
                                                         sums.const_data_ptr<acc_t>(), v.channels,
                                                         rest * rest, batch * batch, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ------------------------------------------------------------------------------------ conv2d

// X2[pos] = sum over the batch of x[b, pos]^2, pos over [C, H, W]: one pass over the input.
template <typename scalar_t, typename acc_t>
__global__ void batch_squares_kernel(const scalar_t* x, int64_t batch, int64_t positions, acc_t* x2,
                                     Gate gate) {
  if (!is_due(gate)) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t pos = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; pos < positions;
       pos += stride) {
    acc_t acc = 0;
    for (int64_t b = 0; b < batch; ++b) acc += term<true, acc_t>(x[b * positions + pos]);
    x2[pos] = acc;
  }
}

// The output positions o in [0, out) whose tap o * stride + offset lands inside [0, size).
__device__ __forceinline__ void tap_range(int64_t out, int64_t stride, int64_t offset, int64_t size,
                                          int64_t& first, int64_t& count) {
  first = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  const int64_t top = size - 1 - offset;
  const int64_t last = top < 0 ? -1 : min(out - 1, top / stride);
  count = max(last - first + 1, int64_t(0));
}

// A warp per patch entry k = (c, i, j): the in-range taps of X2 over groups and output positions.
template <typename stat_t, typename acc_t>
__global__ void patch_sums_kernel(const acc_t* x2, ConvGeometry g, stat_t* stat, acc_t divisor,
                                  bool append_one, Gate gate) {
  if (!is_due(gate)) return;
  const int64_t patch = g.patch();
  const int lane = threadIdx.x % 32;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (append_one) stat[patch] += static_cast<stat_t>(static_cast<double>(g.groups) / patch);
    stat[patch + (append_one ? 1 : 0)] += stat_t(1);
  }
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; k < patch; k += warps) {
    const int64_t c = k / (g.kh * g.kw);
    const int64_t i = k / g.kw % g.kh;
    const int64_t j = k % g.kw;
    int64_t p0, np, r0, nr;
    tap_range(g.out_h, g.sh, i * g.dh - g.top, g.height, p0, np);
    tap_range(g.out_w, g.sw, j * g.dw - g.left, g.width, r0, nr);
    const int64_t taps = g.groups * np * nr;
    acc_t acc = 0;
    for (int64_t t = lane; t < taps; t += 32) {
      const int64_t q = t / (np * nr);
      const int64_t p = p0 + t / nr % np;
      const int64_t r = r0 + t % nr;
      const int64_t y = p * g.sh + i * g.dh - g.top;
      const int64_t x = r * g.sw + j * g.dw - g.left;
      acc += x2[((q * g.group_channels() + c) * g.height + y) * g.width + x];
    }
    acc = warp_sum(acc);
    if (lane == 0) stat[k] += static_cast<stat_t>(acc / divisor);
  }
}

void conv2d_input_stats_cuda(const at::Tensor& stat, const at::Tensor& x, at::IntArrayRef kernel_size,
                             at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                             int64_t groups, bool append_one, const std::optional<at::Tensor>& step,
                             int64_t interval) {
  const ConvGeometry g = check_conv2d_input_stats(stat, x, kernel_size, stride, padding, dilation,
                                                  groups, append_one, step, interval);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Gate gate = make_gate(step, interval);
  const at::Tensor input = x.contiguous();
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t positions = g.channels * g.height * g.width;
    const at::Tensor x2 = at::empty({positions}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    batch_squares_kernel<<<grid_for(positions, kThreads), kThreads, 0, stream>>>(
        input.const_data_ptr<scalar_t>(), g.batch, positions, x2.mutable_data_ptr<acc_t>(), gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // The published divisor holds D = (C/G) kh kw.
    const acc_t divisor = static_cast<acc_t>(g.batch * g.out_h * g.out_w * g.patch());
    patch_sums_kernel<<<grid_for(g.patch(), kWarps), kThreads, 0, stream>>>(
        x2.const_data_ptr<acc_t>(), g, stat.mutable_data_ptr<acc_t>(), divisor, append_one, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("sumsq_stats_", &cuda::sumsq_stats_cuda);
  m.impl("conv2d_input_stats_", &cuda::conv2d_input_stats_cuda);
  m.impl("norm_input_stats_", &cuda::norm_input_stats_cuda);
  m.impl("norm_grad_stats_", &cuda::norm_grad_stats_cuda);
}

}  // namespace cafin
