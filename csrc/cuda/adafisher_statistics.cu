// CUDA kernels of the curvature statistics. Each kernel reads the optional step tensor itself and
// does nothing off-interval, so a captured graph replays the same launches every step, and a step
// that is not due costs one tiny launch per channel statistic (two for the Conv2d input). The
// input is read where it is, in any layout, never copied. Given the caller's workspace, a call
// allocates nothing (without one, a channel statistic allocates and zeroes its own, and the Conv2d
// input side allocates its X2, 1/B of the input). The Conv2d input side never unfolds.
// Reductions run in a fixed order (per-thread sums in index order, then fixed shuffle and
// shared-memory trees, then the partial sums in index order). The only atomics count arrivals;
// no value is added atomically, so results are bit-identical from run to run and the ops are
// deterministic under torch.use_deterministic_algorithms(True). Sums run in float32 (double for
// float64 inputs).
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

int grid_for(int64_t items, int64_t per_block) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxGrid, (items + per_block - 1) / per_block)));
}

// ------------------------------------------------------------------------------------ channel sums
//
// One launch per call. Each block (column sums) or warp (runs, walks) writes partial sums into the
// caller's workspace (csrc/checks.h: statistics_workspace_numel), then counts its arrival for its
// channels; the last to arrive adds that channel's partials in index order and finishes it. For
// the norm input, the last channel finished also adds the channels' sums into the 3-vector. The
// last arrival sets its counter back to zero, so the workspace is ready for the next call on the
// stream. Deterministic: every sum runs in a fixed order, whichever block arrives last.

enum class Kind { kSumsq, kNormGrad, kNormInput };

// Where a call's partial sums go and how its channels finish.
template <typename acc_t>
struct Out {
  acc_t* partial;       // [items, width]
  acc_t* sums;          // [channels], the norm input's channel sums
  unsigned* arrivals;   // one per tile (column sums) or channel (runs, walks)
  unsigned* finished;   // the norm input's channels (or tiles) finished
  acc_t* stat;
  int64_t channels, items;
  acc_t divisor;        // kSumsq: the rows; kNormGrad: the batch
  bool append_one;
  acc_t rest_sq, batch_sq;  // kNormInput
};

template <Kind kKind, typename acc_t>
__device__ __forceinline__ void finish_channel(const Out<acc_t>& out, int64_t c, acc_t s) {
  if (kKind == Kind::kSumsq) {
    out.stat[c] += s / out.divisor;
  } else if (kKind == Kind::kNormGrad) {
    out.stat[c] += s * s / out.divisor;
  } else {
    out.sums[c] = s;
  }
}

// The entries after the channels: the bias input's one and the count (sumsq, norm grad).
template <Kind kKind, typename acc_t>
__device__ __forceinline__ void finish_counts(const Out<acc_t>& out) {
  if (kKind == Kind::kNormInput) return;
  if (out.append_one) out.stat[out.channels] += acc_t(1);
  out.stat[out.channels + (out.append_one ? 1 : 0)] += acc_t(1);
}

// A whole warp: stat[:3] += [sum_t (sums[t] / rest^2)^2 / B^2, T / B^2, 1].
template <typename acc_t>
__device__ void finish_norm_input(const Out<acc_t>& out, int lane) {
  acc_t acc = 0;
  for (int64_t c = lane; c < out.channels; c += 32) {
    const acc_t u = __ldcg(out.sums + c) / out.rest_sq;
    acc += u * u;
  }
  acc = warp_sum(acc);
  if (lane == 0) {
    out.stat[0] += acc / out.batch_sq;
    out.stat[1] += static_cast<acc_t>(out.channels) / out.batch_sq;
    out.stat[2] += acc_t(1);
  }
}

// Lane 0 has written what this warp owes to the counter `*counter`, of `expected` arrivals: true
// in every lane of the warp that arrives last (the counter is then zero again).
__device__ __forceinline__ bool arrive_last(unsigned* counter, int64_t expected, int lane) {
  bool last = false;
  if (lane == 0) {
    __threadfence();  // this warp's partial sum is visible before its arrival counts
    last = atomicAdd(counter, 1u) == static_cast<unsigned>(expected - 1);
    if (last) {
      *counter = 0u;
      __threadfence();  // and the others' partial sums before the last arrival reads them
    }
  }
  return __shfl_sync(0xffffffffu, last, 0);
}

// Column sums. Rows of contiguous columns, row r at (r / inner) * outer_stride + (r % inner) *
// inner_stride (channels innermost: Linear inputs, channels_last maps; or one [channels,
// per_channel] block per outer index, inner == 1). A tile (blockIdx.x) holds the columns of
// `per_tile` whole channels (<= 32 columns); blockIdx.y is the item taking rows lo..hi of it. A
// thread (x, y) of the 32 x 8 block sums column x of every 8th of those rows; the 8 sums add in
// order. The tile's last block adds its items' partials and finishes its channels.
template <Kind kKind, typename scalar_t, typename acc_t>
__global__ void column_stats_kernel(const scalar_t* x, int64_t rows, int64_t inner, int64_t outer_stride,
                                    int64_t inner_stride, int64_t width, int64_t per_channel,
                                    int64_t per_tile, Out<acc_t> out, Gate gate) {
  if (!is_due(gate)) return;
  constexpr bool kSquare = kKind == Kind::kSumsq;
  __shared__ acc_t lanes[8][33];
  __shared__ bool last;
  const int64_t tile = blockIdx.x, item = blockIdx.y, items = gridDim.y;
  const int64_t tile_channels = std::min<int64_t>(per_tile, out.channels - tile * per_tile);
  const int64_t column = tile * per_tile * per_channel + threadIdx.x;
  const bool active = threadIdx.x < tile_channels * per_channel;
  const int64_t lo = rows * item / items, hi = rows * (item + 1) / items;
  acc_t acc = 0;
  if (active) {
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
  if (threadIdx.y == 0 && active) {
    acc_t total = 0;
    for (int k = 0; k < 8; ++k) total += lanes[k][threadIdx.x];
    out.partial[item * width + column] = total;
    __threadfence();  // visible before the block's arrival counts
  }
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    last = atomicAdd(out.arrivals + tile, 1u) == static_cast<unsigned>(items - 1);
    if (last) {
      out.arrivals[tile] = 0u;
      __threadfence();
    }
  }
  __syncthreads();
  if (!last) return;  // the whole block
  acc = 0;
  if (active) {
    for (int64_t k = threadIdx.y; k < items; k += 8) acc += __ldcg(out.partial + k * width + column);
  }
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0) {
    acc_t total = 0;
    for (int k = 0; k < 8; ++k) total += lanes[k][threadIdx.x];
    lanes[0][threadIdx.x] = total;  // each thread its own column
  }
  __syncthreads();
  if (threadIdx.y == 0 && threadIdx.x < tile_channels) {
    acc_t s = 0;
    for (int64_t k = 0; k < per_channel; ++k) s += lanes[0][threadIdx.x * per_channel + k];
    finish_channel<kKind>(out, tile * per_tile + threadIdx.x, s);
    if (kKind == Kind::kNormInput) __threadfence();
  }
  if (tile == 0 && threadIdx.x == 0 && threadIdx.y == 0) finish_counts<kKind>(out);
  if (kKind == Kind::kNormInput) {
    __syncthreads();
    if (threadIdx.y == 0 && arrive_last(out.finished, gridDim.x, threadIdx.x)) finish_norm_input(out, threadIdx.x);
  }
}

// A warp's part of channel c done (its partial sum `acc` valid in lane 0, for item `item`): write
// it; the channel's last arrival adds the items' partials in order and finishes the channel.
template <Kind kKind, typename acc_t>
__device__ void warp_arrive(const Out<acc_t>& out, int64_t c, int64_t item, acc_t acc, int lane) {
  if (lane == 0) out.partial[item * out.channels + c] = acc;
  if (!arrive_last(out.arrivals + c, out.items, lane)) return;
  acc_t s = 0;
  for (int64_t k = lane; k < out.items; k += 32) s += __ldcg(out.partial + k * out.channels + c);
  s = warp_sum(s);
  if (lane == 0) {
    finish_channel<kKind>(out, c, s);
    if (c == 0) finish_counts<kKind>(out);
  }
  if (kKind == Kind::kNormInput && arrive_last(out.finished, out.channels, lane)) finish_norm_input(out, lane);
}

// Contiguous runs (o, c) of `inner` elements at o * outer_stride + c * channel_stride, cut into
// segments of kSegment: a warp per (item, channel), summing segments item, item + items, ... of the
// channel's outer * segments in order.
template <Kind kKind, typename scalar_t, typename acc_t>
__global__ void run_stats_kernel(const scalar_t* x, int64_t outer, int64_t inner, int64_t outer_stride,
                                 int64_t channel_stride, Out<acc_t> out, Gate gate) {
  if (!is_due(gate)) return;
  constexpr bool kSquare = kKind == Kind::kSumsq;
  const int64_t segments = (inner + kSegment - 1) / kSegment;
  const int64_t work = out.items * out.channels;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < work; w += warps) {
    const int64_t c = w % out.channels, item = w / out.channels;
    acc_t acc = 0;
    for (int64_t r = item; r < outer * segments; r += out.items) {
      const int64_t o = r / segments, lo = r % segments * kSegment, hi = std::min(inner, lo + kSegment);
      const scalar_t* data = x + o * outer_stride + c * channel_stride;
#pragma unroll 4
      for (int64_t k = lo + lane; k < hi; k += 32) acc += term<kSquare, acc_t>(data[k]);
    }
    warp_arrive<kKind>(out, c, item, warp_sum(acc), lane);
  }
}

// Any layout (dims that merge into no [outer, channels, inner] view): element (c, r) of channel c
// and rest index r (the outer then the inner dims, row-major) at channels.offset(c) +
// rest.offset(r); a warp per (item, channel), summing segments item, item + items, ... of the rest.
template <Kind kKind, typename scalar_t, typename acc_t>
__global__ void walk_stats_kernel(const scalar_t* x, DimWalk channels, DimWalk rest, Out<acc_t> out, Gate gate) {
  if (!is_due(gate)) return;
  constexpr bool kSquare = kKind == Kind::kSumsq;
  const int64_t segments = (rest.count + kSegment - 1) / kSegment;
  const int64_t work = out.items * out.channels;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; w < work; w += warps) {
    const int64_t c = w % out.channels, item = w / out.channels;
    const scalar_t* data = x + channels.offset(c);
    acc_t acc = 0;
    for (int64_t segment = item; segment < segments; segment += out.items) {
      const int64_t lo = segment * kSegment, hi = std::min(rest.count, lo + kSegment);
      for (int64_t k = lo + lane; k < hi; k += 32) acc += term<kSquare, acc_t>(data[rest.offset(k)]);
    }
    warp_arrive<kKind>(out, c, item, warp_sum(acc), lane);
  }
}

#define CAFIN_DISPATCH_INPUT(TYPE, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, "cafin_statistics", __VA_ARGS__)

// The call's workspace: the caller's, or a fresh one of zeros (an allocation and a memset more).
at::Tensor workspace_for(const std::optional<at::Tensor>& workspace, const at::Tensor& stat, int64_t channels) {
  if (workspace.has_value()) return *workspace;
  return at::zeros({statistics_workspace_numel(channels)}, stat.options());
}

// One channel statistic of x viewed [outer, channels, inner] over dims [start_dim, end_dim), in one
// launch on `stream`; the input is read where it is, whatever its layout.
template <Kind kKind, typename scalar_t, typename acc_t>
void channel_stats(const at::Tensor& x, int64_t start_dim, int64_t end_dim, const at::Tensor& workspace,
                   Out<acc_t> out, const Gate& gate, cudaStream_t stream) {
  // The workspace: partial sums first, then the sums, the counters, the call's counter.
  const int64_t capacity = workspace.numel() - 2 * out.channels - 1;
  acc_t* base = workspace.mutable_data_ptr<acc_t>();
  out.partial = base;
  out.sums = base + capacity;
  out.arrivals = reinterpret_cast<unsigned*>(base + capacity + out.channels);
  out.finished = reinterpret_cast<unsigned*>(base + capacity + 2 * out.channels);
  const scalar_t* data = x.const_data_ptr<scalar_t>();
  const StridedView v = strided_view(x, start_dim, end_dim);
  const bool columns = v.channel_stride == 1 || v.channels == 1;
  const bool block = v.inner_stride == 1 && v.channel_stride == v.inner && v.inner < 32;
  if (!v.ok || !(columns || block || v.inner_stride == 1)) {
    // No view the kernels below read: walk the dims through their strides.
    DimWalk channels, rest;
    if (walk_dims(channels, x, start_dim, end_dim) && walk_dims(rest, x, 0, start_dim) &&
        walk_dims(rest, x, end_dim, x.dim())) {
      const int64_t segments = (rest.count + kSegment - 1) / kSegment;
      out.items = std::max<int64_t>(1, std::min(segments, capacity / out.channels));
      walk_stats_kernel<kKind><<<grid_for(out.items * out.channels, kWarps), kThreads, 0, stream>>>(
          data, channels, rest, out, gate);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    // More unmergeable dims than a walk holds (beyond what torch's own kernels index): a
    // contiguous copy, freed at return (the caching allocator reuses it only after this
    // stream's queued work).
    channel_stats<kKind, scalar_t, acc_t>(x.contiguous(), start_dim, end_dim, workspace, out, gate, stream);
    return;
  }
  if ((columns || block) && !(v.inner_stride == 1 && v.inner >= 32)) {
    // Channels innermost (columns are channels, rows are (outer, inner)), or short runs of a
    // contiguous [channels, inner] block per outer index (columns are its elements, rows the outer).
    const bool runs = !columns;
    const int64_t per_channel = runs ? v.inner : 1;
    const int64_t rows = runs ? v.outer : v.outer * v.inner;
    const int64_t width = v.channels * per_channel;
    const int64_t per_tile = 32 / per_channel;
    const int64_t tiles = (v.channels + per_tile - 1) / per_tile;
    out.items = std::max<int64_t>(1, std::min({(rows + 7) / 8, (kColumnBlocks + tiles - 1) / tiles,
                                               capacity / width, int64_t{65535}}));
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(out.items));
    column_stats_kernel<kKind><<<grid, dim3(32, 8), 0, stream>>>(
        data, rows, runs ? 1 : v.inner, v.outer_stride, runs ? 0 : v.inner_stride, width, per_channel,
        per_tile, out, gate);
  } else {
    // Runs along the innermost dims; or, with no inner dims and contiguous outer ones (a
    // transposed [N, C]), each channel one run along the outer dims.
    const bool transposed = v.inner == 1 && v.outer_stride == 1;
    const int64_t outer = transposed ? 1 : v.outer, inner = transposed ? v.outer : v.inner;
    const int64_t segments = (inner + kSegment - 1) / kSegment;
    out.items = std::max<int64_t>(1, std::min(outer * segments, capacity / out.channels));
    run_stats_kernel<kKind><<<grid_for(out.items * out.channels, kWarps), kThreads, 0, stream>>>(
        data, outer, inner, transposed ? 0 : v.outer_stride, v.channel_stride, out, gate);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// `divisor`: sumsq's rows, norm grad's batch; the norm input's [B, T, rest] view is `v`.
template <Kind kKind>
void channel_statistic(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                       const ChannelView& v, int64_t divisor, const std::optional<at::Tensor>& step,
                       int64_t interval, bool append_one, const std::optional<at::Tensor>& workspace) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Gate gate = make_gate(step, interval);
  const at::Tensor scratch = workspace_for(workspace, stat, v.channels);
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Out<acc_t> out{};
    out.stat = stat.mutable_data_ptr<acc_t>();
    out.channels = v.channels;
    out.divisor = static_cast<acc_t>(divisor);
    out.append_one = append_one;
    out.rest_sq = static_cast<acc_t>(v.inner) * static_cast<acc_t>(v.inner);
    out.batch_sq = static_cast<acc_t>(v.outer) * static_cast<acc_t>(v.outer);
    channel_stats<kKind, scalar_t, acc_t>(x, start_dim, end_dim, scratch, out, gate, stream);
  });
}

void sumsq_stats_cuda(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                      bool append_one, const std::optional<at::Tensor>& step, int64_t interval,
                      const std::optional<at::Tensor>& workspace) {
  const ChannelView v = check_sumsq_stats(stat, x, start_dim, end_dim, append_one, step, interval, workspace);
  channel_statistic<Kind::kSumsq>(stat, x, start_dim, end_dim, v, v.outer * v.inner, step, interval, append_one,
                                  workspace);
}

void norm_grad_stats_cuda(const at::Tensor& stat, const at::Tensor& g, int64_t start_dim, int64_t end_dim,
                          const std::optional<at::Tensor>& step, int64_t interval,
                          const std::optional<at::Tensor>& workspace) {
  const ChannelView v = check_norm_grad_stats(stat, g, start_dim, end_dim, step, interval, workspace);
  channel_statistic<Kind::kNormGrad>(stat, g, start_dim, end_dim, v, g.size(0), step, interval, false, workspace);
}

void norm_input_stats_cuda(const at::Tensor& stat, const at::Tensor& x, const std::optional<at::Tensor>& step,
                           int64_t interval, const std::optional<at::Tensor>& workspace) {
  const ChannelView v = check_norm_input_stats(stat, x, step, interval, workspace);
  channel_statistic<Kind::kNormInput>(stat, x, 1, 2, v, 1, step, interval, false, workspace);
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
                             int64_t interval, const std::optional<at::Tensor>& workspace) {
  const ConvGeometry g = check_conv2d_input_stats(stat, x, kernel_size, stride, padding, dilation,
                                                  groups, append_one, step, interval, workspace);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const Gate gate = make_gate(step, interval);
  const Walk w = walk_for(x);  // any strides: the input is never copied
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t positions = g.channels * g.height * g.width;
    // X2 is the op's only scratch, 1/B of the input: the caller's workspace, or allocated here.
    const at::Tensor x2 = workspace.has_value()
                              ? *workspace
                              : at::empty({positions}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
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
