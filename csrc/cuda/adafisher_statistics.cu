// CUDA kernels of the curvature statistics. Each kernel reads the optional step tensor itself and
// does nothing off-interval, so a captured graph replays the same launches every step; the host
// side of a call reads strides and allocates only a small scratch (never a copy of the input, in
// any layout: the kernels read it through its strides), so a step that is not due costs two tiny
// launches per op.
// Reductions run in a fixed order (per-thread sums in index order, then fixed shuffle and
// shared-memory trees, then one block per channel over the partial sums in index order): no
// atomics, so results are bit-identical from run to run and the ops are deterministic under
// torch.use_deterministic_algorithms(True). Sums run in float32 (double for float64 inputs).
// The Conv2d input side never unfolds.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "adafisher_math.h"
#include "checks.h"
#include "adafisher_statistics_math.h"

namespace cafin {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kSegment = 8192;   // elements of one run a warp sums into one partial
constexpr int64_t kMaxGrid = 4096;   // enough blocks to fill any GPU; longer loops beyond
constexpr int64_t kColumnBlocks = 1024;  // blocks the column sums aim for (rows split to reach it)
constexpr int kBatchSlices = 8;           // threads that share one position's batch (conv2d input)

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

// Block-wide sum in a fixed order, valid in thread 0.
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
//
// Partial sums land in partial[item * width + column], every entry written by exactly one thread;
// channel c owns columns c * per_channel ... (c + 1) * per_channel - 1 of every item.

// Rows of `width` contiguous elements, row r at (r / inner) * outer_stride + (r % inner) * inner_stride
// (channels innermost: Linear inputs, channels_last maps; or one [channels, inner] block per outer
// index, inner == 1). blockIdx.y takes the rows lo..hi of item blockIdx.y; a thread (x, y) of the
// 32 x 8 block sums column x of every 8th of them, the 8 sums then add in order.
template <bool kSquare, typename scalar_t, typename acc_t>
__global__ void column_partials_kernel(const scalar_t* x, int64_t rows, int64_t inner, int64_t outer_stride,
                                       int64_t inner_stride, int64_t width, int64_t items, acc_t* partial,
                                       Gate gate) {
  if (!is_due(gate)) return;
  __shared__ acc_t lanes[8][33];
  const int64_t column = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  for (int64_t item = blockIdx.y; item < items; item += gridDim.y) {
    const int64_t lo = rows * item / items, hi = rows * (item + 1) / items;
    acc_t acc = 0;
    if (column < width) {
      // (o, i) of row r, stepped without a 64-bit division per element.
      const int64_t first = lo + threadIdx.y;
      int64_t o = first / inner, i = first % inner;
      for (int64_t r = first; r < hi; r += 8) {
        acc += term<kSquare, acc_t>(x[o * outer_stride + i * inner_stride + column]);
        i += 8;
        while (i >= inner) {
          i -= inner;
          ++o;
        }
      }
    }
    lanes[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && column < width) {
      acc_t total = 0;
      for (int k = 0; k < 8; ++k) total += lanes[k][threadIdx.x];
      partial[item * width + column] = total;
    }
    __syncthreads();
  }
}

// Contiguous runs (o, c) of `inner` elements at o * outer_stride + c * channel_stride: a warp per
// segment of one run; item = o * segments + segment.
template <bool kSquare, typename scalar_t, typename acc_t>
__global__ void run_partials_kernel(const scalar_t* x, int64_t outer, int64_t channels, int64_t inner,
                                    int64_t outer_stride, int64_t channel_stride, acc_t* partial, Gate gate) {
  if (!is_due(gate)) return;
  const int64_t segments = (inner + kSegment - 1) / kSegment;
  const int64_t work = outer * channels * segments;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < work; w += warps) {
    const int64_t segment = w % segments, c = w / segments % channels, o = w / (segments * channels);
    const int64_t lo = segment * kSegment, hi = std::min(inner, lo + kSegment);
    const scalar_t* data = x + o * outer_stride + c * channel_stride;
    acc_t acc = 0;
#pragma unroll 4
    for (int64_t k = lo + lane; k < hi; k += 32) acc += term<kSquare, acc_t>(data[k]);
    acc = warp_sum(acc);
    if (lane == 0) partial[(o * segments + segment) * channels + c] = acc;
  }
}

// Any layout (dims that merge into no [outer, channels, inner] view): element (c, r) of channel c
// and rest index r (the outer then the inner dims, row-major) at channels.offset(c) +
// rest.offset(r); a warp per segment of one channel's rest, item = segment.
template <bool kSquare, typename scalar_t, typename acc_t>
__global__ void walk_partials_kernel(const scalar_t* x, DimWalk channels, DimWalk rest, acc_t* partial,
                                     Gate gate) {
  if (!is_due(gate)) return;
  const int64_t segments = (rest.count + kSegment - 1) / kSegment;
  const int64_t work = channels.count * segments;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < work; w += warps) {
    const int64_t segment = w % segments, c = w / segments;
    const int64_t lo = segment * kSegment, hi = std::min(rest.count, lo + kSegment);
    const scalar_t* data = x + channels.offset(c);
    acc_t acc = 0;
    for (int64_t k = lo + lane; k < hi; k += 32) acc += term<kSquare, acc_t>(data[rest.offset(k)]);
    acc = warp_sum(acc);
    if (lane == 0) partial[segment * channels.count + c] = acc;
  }
}

enum class Finish { kMean, kSquaredSum, kRaw };

// Block c: s = the sum of channel c's partials (fixed order), then stat[c] += s / divisor (kMean),
// s^2 / divisor (kSquaredSum), or sums[c] = s (kRaw). Block 0 also adds the appended one and the count.
template <Finish kFinish, typename stat_t, typename acc_t>
__global__ void finish_channels_kernel(const acc_t* partial, int64_t items, int64_t width, int64_t per_channel,
                                       int64_t channels, acc_t divisor, stat_t* stat, acc_t* sums,
                                       bool append_one, Gate gate) {
  if (!is_due(gate)) return;
  const int64_t terms = items * per_channel;
  for (int64_t c = blockIdx.x; c < channels; c += gridDim.x) {
    acc_t acc = 0;
    for (int64_t t = threadIdx.x; t < terms; t += kThreads) {
      acc += partial[(t / per_channel) * width + c * per_channel + t % per_channel];
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) {
      if (kFinish == Finish::kRaw) {
        sums[c] = acc;
      } else {
        stat[c] += static_cast<stat_t>((kFinish == Finish::kSquaredSum ? acc * acc : acc) / divisor);
      }
    }
    __syncthreads();  // block_sum's shared memory is reused by the next channel
  }
  if (kFinish != Finish::kRaw && blockIdx.x == 0 && threadIdx.x == 0) {
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

// The partial sums of x viewed [outer, channels, inner], launched on `stream`; returns the scratch
// they are written to and how to read it. The input is read where it is, whatever its layout.
struct Partials {
  at::Tensor data;
  int64_t items, width, per_channel;
};

template <bool kSquare, typename scalar_t, typename acc_t>
Partials walk_partials(const at::Tensor& x, const DimWalk& channels, const DimWalk& rest, const Gate& gate,
                       cudaStream_t stream) {
  const auto acc_type = c10::CppTypeToScalarType<acc_t>::value;
  const int64_t segments = (rest.count + kSegment - 1) / kSegment;
  Partials p;
  p.width = channels.count;
  p.per_channel = 1;
  p.items = segments;
  p.data = at::empty({p.items * p.width}, x.options().dtype(acc_type));
  walk_partials_kernel<kSquare><<<grid_for(channels.count * segments, kWarps), kThreads, 0, stream>>>(
      x.const_data_ptr<scalar_t>(), channels, rest, p.data.mutable_data_ptr<acc_t>(), gate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return p;
}

template <bool kSquare, typename scalar_t, typename acc_t>
Partials channel_partials(const at::Tensor& x, int64_t start_dim, int64_t end_dim, const Gate& gate,
                          cudaStream_t stream) {
  const StridedView v = strided_view(x, start_dim, end_dim);
  const bool columns = v.channel_stride == 1 || v.channels == 1;
  const bool block = v.inner_stride == 1 && v.channel_stride == v.inner && v.inner < 32;
  if (!v.ok || !(columns || block || v.inner_stride == 1)) {
    // No view the kernels below read: walk the dims through their strides.
    DimWalk channels, rest;
    if (walk_dims(channels, x, start_dim, end_dim) && walk_dims(rest, x, 0, start_dim) &&
        walk_dims(rest, x, end_dim, x.dim())) {
      return walk_partials<kSquare, scalar_t, acc_t>(x, channels, rest, gate, stream);
    }
    // More unmergeable dims than a walk holds (beyond what torch's own kernels index): a
    // contiguous copy, freed at return (the caching allocator reuses it only after this
    // stream's queued work).
    return channel_partials<kSquare, scalar_t, acc_t>(x.contiguous(), start_dim, end_dim, gate, stream);
  }
  const auto acc_type = c10::CppTypeToScalarType<acc_t>::value;
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  Partials p;
  if ((v.channel_stride == 1 || v.channels == 1) && !(v.inner_stride == 1 && v.inner >= 32)) {
    // Channels innermost: columns are channels, rows are (outer, inner).
    const int64_t rows = v.outer * v.inner, tiles = (v.channels + 31) / 32;
    p.width = v.channels;
    p.per_channel = 1;
    p.items = std::max<int64_t>(1, std::min<int64_t>((rows + 7) / 8, (kColumnBlocks + tiles - 1) / tiles));
    p.data = at::empty({p.items * p.width}, x.options().dtype(acc_type));
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(std::min<int64_t>(p.items, 65535)));
    column_partials_kernel<kSquare><<<grid, dim3(32, 8), 0, stream>>>(
        data, rows, v.inner, v.outer_stride, v.inner_stride, p.width, p.items, p.data.mutable_data_ptr<acc_t>(), gate);
  } else if (v.inner_stride == 1 && v.channel_stride == v.inner && v.inner < 32) {
    // Short runs of a contiguous [channels, inner] block per outer index: columns are its elements.
    const int64_t rows = v.outer, tiles = (v.channels * v.inner + 31) / 32;
    p.width = v.channels * v.inner;
    p.per_channel = v.inner;
    p.items = std::max<int64_t>(1, std::min<int64_t>((rows + 7) / 8, (kColumnBlocks + tiles - 1) / tiles));
    p.data = at::empty({p.items * p.width}, x.options().dtype(acc_type));
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(std::min<int64_t>(p.items, 65535)));
    column_partials_kernel<kSquare><<<grid, dim3(32, 8), 0, stream>>>(
        data, rows, 1, v.outer_stride, 0, p.width, p.items, p.data.mutable_data_ptr<acc_t>(), gate);
  } else {
    // Runs along the innermost dims.
    const int64_t segments = (v.inner + kSegment - 1) / kSegment;
    p.width = v.channels;
    p.per_channel = 1;
    p.items = v.outer * segments;
    p.data = at::empty({p.items * p.width}, x.options().dtype(acc_type));
    run_partials_kernel<kSquare><<<grid_for(v.outer * v.channels * segments, kWarps), kThreads, 0, stream>>>(
        data, v.outer, v.channels, v.inner, v.outer_stride, v.channel_stride, p.data.mutable_data_ptr<acc_t>(), gate);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return p;
}

// The two per-channel statistics: kSquares sums x^2 then divides by the rows (sumsq_stats_);
// otherwise it sums x, then squares and divides by the batch (norm_grad_stats_).
template <bool kSquares>
void channel_statistic(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                       const ChannelView& v, const std::optional<at::Tensor>& step, int64_t interval,
                       bool append_one) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Gate gate = make_gate(step, interval);
  const int64_t divisor = kSquares ? v.outer * v.inner : x.size(0);
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Partials p = channel_partials<kSquares, scalar_t, acc_t>(x, start_dim, end_dim, gate, stream);
    constexpr Finish kFinish = kSquares ? Finish::kMean : Finish::kSquaredSum;
    finish_channels_kernel<kFinish><<<grid_for(v.channels, 1), kThreads, 0, stream>>>(
        p.data.const_data_ptr<acc_t>(), p.items, p.width, p.per_channel, v.channels,
        static_cast<acc_t>(divisor), stat.mutable_data_ptr<acc_t>(), static_cast<acc_t*>(nullptr), append_one,
        gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void sumsq_stats_cuda(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                      bool append_one, const std::optional<at::Tensor>& step, int64_t interval) {
  const ChannelView v = check_sumsq_stats(stat, x, start_dim, end_dim, append_one, step, interval);
  channel_statistic<true>(stat, x, start_dim, end_dim, v, step, interval, append_one);
}

void norm_grad_stats_cuda(const at::Tensor& stat, const at::Tensor& g, int64_t start_dim, int64_t end_dim,
                          const std::optional<at::Tensor>& step, int64_t interval) {
  const ChannelView v = check_norm_grad_stats(stat, g, start_dim, end_dim, step, interval);
  channel_statistic<false>(stat, g, start_dim, end_dim, v, step, interval, false);
}

void norm_input_stats_cuda(const at::Tensor& stat, const at::Tensor& x, const std::optional<at::Tensor>& step,
                           int64_t interval) {
  const ChannelView v = check_norm_input_stats(stat, x, step, interval);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Gate gate = make_gate(step, interval);
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Partials p = channel_partials<false, scalar_t, acc_t>(x, 1, 2, gate, stream);
    const at::Tensor sums = at::empty({v.channels}, p.data.options());
    finish_channels_kernel<Finish::kRaw><<<grid_for(v.channels, 1), kThreads, 0, stream>>>(
        p.data.const_data_ptr<acc_t>(), p.items, p.width, p.per_channel, v.channels, acc_t(1),
        static_cast<acc_t*>(nullptr), sums.mutable_data_ptr<acc_t>(), false, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const acc_t rest = static_cast<acc_t>(v.inner);
    const acc_t batch = static_cast<acc_t>(v.outer);
    finish_norm_input_kernel<<<1, kThreads, 0, stream>>>(stat.mutable_data_ptr<acc_t>(),
                                                         sums.const_data_ptr<acc_t>(), v.channels,
                                                         rest * rest, batch * batch, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ------------------------------------------------------------------------------------ conv2d

// The (C, H, W) dims of the input, slowest-varying in memory first, so consecutive threads read
// consecutive addresses whatever the layout (NCHW, channels_last, slices); `to` is each dim's
// stride in X2, which is [C, H, W] contiguous.
struct Walk {
  int64_t size[3], from[3], to[3];
};

Walk walk_for(const at::Tensor& x) {
  const int64_t to[3] = {x.size(2) * x.size(3), x.size(3), 1};
  int order[3] = {0, 1, 2};
  std::stable_sort(order, order + 3, [&](int a, int b) { return x.stride(a + 1) > x.stride(b + 1); });
  Walk w;
  for (int k = 0; k < 3; ++k) {
    w.size[k] = x.size(order[k] + 1);
    w.from[k] = x.stride(order[k] + 1);
    w.to[k] = to[order[k]];
  }
  return w;
}

// X2[c, y, x] = sum over the batch of x[b, c, y, x]^2: one pass over the input. A 32 x 8 block
// takes 32 consecutive positions; thread (x, y) sums samples y, y + 8, ... of position x (so a
// large batch over small planes, as in a network's last stage, still fills the GPU), then the 8
// sums of a position add in order.
template <typename scalar_t, typename acc_t>
__global__ void batch_squares_kernel(const scalar_t* x, int64_t batch, int64_t batch_stride, Walk w,
                                     acc_t* x2, Gate gate) {
  if (!is_due(gate)) return;
  __shared__ acc_t lanes[kBatchSlices][33];
  const int64_t positions = w.size[0] * w.size[1] * w.size[2];
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * 32; first < positions;
       first += static_cast<int64_t>(gridDim.x) * 32) {
    const int64_t t = first + threadIdx.x;
    int64_t i0 = 0, i1 = 0, i2 = 0;
    acc_t acc = 0;
    if (t < positions) {
      i2 = t % w.size[2];
      i1 = t / w.size[2] % w.size[1];
      i0 = t / (w.size[2] * w.size[1]);
      const scalar_t* data = x + i0 * w.from[0] + i1 * w.from[1] + i2 * w.from[2];
#pragma unroll 4
      for (int64_t b = threadIdx.y; b < batch; b += kBatchSlices) acc += term<true, acc_t>(data[b * batch_stride]);
    }
    lanes[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && t < positions) {
      acc_t total = 0;
      for (int k = 0; k < kBatchSlices; ++k) total += lanes[k][threadIdx.x];
      x2[i0 * w.to[0] + i1 * w.to[1] + i2 * w.to[2]] = total;
    }
    __syncthreads();
  }
}

// A warp per patch entry k = (c, i, j): the in-range taps of X2 over groups and output positions,
// in a fixed order (lane n sums columns n, n + 32, ... of every window row; then the shuffle tree).
// X2 is 1/B of the input and stays in L2: these reads cost kh*kw/B of the input's, from cache.
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
    const TapWindow wy = tap_window(g.out_h, g.sh, i * g.dh - g.top, g.height);
    const TapWindow wx = tap_window(g.out_w, g.sw, j * g.dw - g.left, g.width);
    acc_t acc = 0;
    for (int64_t q = 0; q < g.groups; ++q) {
      const acc_t* plane = x2 + (q * g.group_channels() + c) * g.height * g.width;
      for (int64_t m = 0; m < wy.count; ++m) {
        const acc_t* row = plane + (wy.first + m * g.sh) * g.width + wx.first;
        for (int64_t n = lane; n < wx.count; n += 32) acc += row[n * g.sw];
      }
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
  const Walk w = walk_for(x);  // any strides: the input is never copied
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t positions = g.channels * g.height * g.width;
    // X2 is the op's only scratch: 1/B of the input.
    const at::Tensor x2 = at::empty({positions}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    batch_squares_kernel<<<grid_for(positions, 32), dim3(32, kBatchSlices), 0, stream>>>(
        x.const_data_ptr<scalar_t>(), g.batch, x.stride(0), w, x2.mutable_data_ptr<acc_t>(), gate);
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
