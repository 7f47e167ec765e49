// CPU kernels of the curvature statistics. Every input is read once, through its strides (a
// contiguous or channels_last input is never copied). Squares are taken in the op-math type, as the
// reference does; short partial sums stay in that type (16 terms at most, so float32 partials lose
// nothing the 1e-5 comparisons see) and are folded into double, which keeps the vector loops at
// the memory's speed. Work is split over threads in a number of chunks fixed by the sizes and the
// thread count, never by scheduling, so a result does not change from run to run.
// The Conv2d input side never unfolds: see conv2d_input_stats_cpu.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "adafisher_math.h"
#include "checks.h"
#include "cpu/vectorize.h"
#include "adafisher_statistics_math.h"

namespace cafin {
namespace {

// Terms a partial sum in the op-math type takes before it is folded into double.
constexpr int64_t kPartialTerms = 16;

// Positions whose partial and double sums one thread keeps in its L2 while it reads the batch.
constexpr int64_t kTilePositions = 32768;

template <bool kSquare, typename acc_t, typename scalar_t>
C10_ALWAYS_INLINE acc_t term(scalar_t v) {
  const auto x = static_cast<acc_t>(v);
  return kSquare ? x * x : x;
}

// acc[k] += term(x[k]): one row into per-element partial sums.
template <bool kSquare, typename acc_t, typename scalar_t>
CAFIN_CPU_CLONES void add_row(acc_t* __restrict acc, const scalar_t* __restrict x, int64_t n) {
  for (int64_t k = 0; k < n; ++k) acc[k] += term<kSquare, acc_t>(x[k]);
}

// total[k] += part[k]; part[k] = 0.
template <typename acc_t>
CAFIN_CPU_CLONES void fold(double* __restrict total, acc_t* __restrict part, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    total[k] += static_cast<double>(part[k]);
    part[k] = acc_t(0);
  }
}

// part[p] += sum over r < rows of term(x[r * stride + p]), p < n: a block of rows (batch entries)
// at once, the partial sums of 64 positions held in registers across the block, so the partial
// sums are loaded and stored once per block instead of once per row.
template <bool kSquare, typename acc_t, typename scalar_t>
CAFIN_CPU_CLONES void add_rows(acc_t* __restrict part, const scalar_t* __restrict x, int64_t stride,
                               int64_t rows, int64_t n) {
  constexpr int64_t kWidth = 256 / sizeof(acc_t);
  int64_t p = 0;
  for (; p + kWidth <= n; p += kWidth) {
    acc_t acc[kWidth];
    for (int64_t j = 0; j < kWidth; ++j) acc[j] = part[p + j];
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* row = x + r * stride + p;
      for (int64_t j = 0; j < kWidth; ++j) acc[j] += term<kSquare, acc_t>(row[j]);
    }
    for (int64_t j = 0; j < kWidth; ++j) part[p + j] = acc[j];
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t q = p; q < n; ++q) part[q] += term<kSquare, acc_t>(x[r * stride + q]);
  }
}

// x2[p] += sum over the batch of term(x[b * stride + p]): partial sums of kPartialTerms entries
// (in blocks of eight, the streams the prefetcher follows at once), folded into double.
template <bool kSquare, typename acc_t, typename scalar_t>
void add_batch(double* x2, acc_t* part, const scalar_t* x, int64_t stride, int64_t batch, int64_t n) {
  constexpr int64_t kBlock = 8;
  for (int64_t b = 0; b < batch; b += kBlock) {
    add_rows<kSquare>(part, x + b * stride, stride, std::min(kBlock, batch - b), n);
    if ((b + kBlock) % kPartialTerms == 0 || b + kBlock >= batch) fold(x2, part, n);
  }
}

// Lanes of one 512-bit vector of the op-math type.
template <typename acc_t>
constexpr int64_t kVectorLanes = 64 / static_cast<int64_t>(sizeof(acc_t));

// lanes[c * L + j] += the terms of channel c's run that fall in lane j, for one outer index: each
// run (`inner` contiguous elements, channel c at x + c * channel_stride) is summed in one vector of
// partial sums, kPartialTerms rounds at a time, folded into the channel's double lanes. For runs
// longer than kPartialTerms vectors, where the fold is amortised over the run.
template <bool kSquare, typename scalar_t>
CAFIN_CPU_CLONES void add_long_runs(double* __restrict lanes, const scalar_t* __restrict x, int64_t channels,
                                    int64_t channel_stride, int64_t inner) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kLanes = kVectorLanes<acc_t>;
  for (int64_t c = 0; c < channels; ++c) {
    const scalar_t* run = x + c * channel_stride;
    double* out = lanes + c * kLanes;
    int64_t i = 0;
    while (inner - i >= kLanes) {
      acc_t acc[kLanes] = {};
      const int64_t rounds = std::min<int64_t>(kPartialTerms, (inner - i) / kLanes);
      for (int64_t r = 0; r < rounds; ++r, i += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) acc[j] += term<kSquare, acc_t>(run[i + j]);
      }
      for (int64_t j = 0; j < kLanes; ++j) out[j] += static_cast<double>(acc[j]);
    }
    for (int64_t j = 0; i < inner; ++i, ++j) out[j] += static_cast<double>(term<kSquare, acc_t>(run[i]));
  }
}

// part[c * L + j] += the terms of channel c's run that fall in lane j (ceil(inner / L) per lane),
// for runs of at most kPartialTerms vectors: the caller folds part into double every few rows.
template <bool kSquare, typename acc_t, typename scalar_t>
CAFIN_CPU_CLONES void add_short_runs(acc_t* __restrict part, const scalar_t* __restrict x, int64_t channels,
                                     int64_t channel_stride, int64_t inner) {
  constexpr int64_t kLanes = kVectorLanes<acc_t>;
  for (int64_t c = 0; c < channels; ++c) {
    const scalar_t* run = x + c * channel_stride;
    acc_t* out = part + c * kLanes;
    acc_t acc[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) acc[j] = out[j];
    int64_t i = 0;
    for (; i + kLanes <= inner; i += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) acc[j] += term<kSquare, acc_t>(run[i + j]);
    }
    for (int64_t j = 0; j < kLanes; ++j) out[j] = acc[j];
    // The tail apart, so that acc stays a register.
    for (int64_t j = 0; i < inner; ++i, ++j) out[j] += term<kSquare, acc_t>(run[i]);
  }
}

int64_t chunk_count(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work / kGrainSize));
}

// Rows of `width` contiguous elements, row r at x + row_offset(r): per-element sums over rows,
// each chunk of rows into its own double accumulator, added in chunk order.
template <bool kSquare, typename scalar_t, typename Offset>
std::vector<double> row_sums(const scalar_t* x, int64_t rows, int64_t width, const Offset& row_offset) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunks = std::min(rows, chunk_count(rows * width));
  std::vector<double> partial(chunks * width, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    std::vector<acc_t> part(width, acc_t(0));
    for (int64_t k = first; k < last; ++k) {
      double* total = partial.data() + k * width;
      const int64_t lo = rows * k / chunks, hi = rows * (k + 1) / chunks;
      for (int64_t r = lo; r < hi; ++r) {
        add_row<kSquare>(part.data(), x + row_offset(r), width);
        if ((r - lo) % kPartialTerms == kPartialTerms - 1 || r == hi - 1) fold(total, part.data(), width);
      }
    }
  });
  for (int64_t k = 1; k < chunks; ++k) {
    for (int64_t i = 0; i < width; ++i) partial[i] += partial[k * width + i];
  }
  partial.resize(width);
  return partial;
}

// Per-position sums of term(x) over `outer` blocks of `block` contiguous elements, block o at
// x + o * stride. Small blocks: chunks of blocks per thread, each into its own accumulator, added
// in chunk order; large blocks: tiles of positions per thread over every block.
template <bool kSquare, typename scalar_t>
std::vector<double> block_sums(const scalar_t* x, int64_t outer, int64_t stride, int64_t block) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t threads = chunk_count(outer * block);
  if (block > kTilePositions && threads > 1) {
    std::vector<double> total(block, 0.0);
    const int64_t tile = std::min(kTilePositions, (block + threads - 1) / threads);
    const int64_t tiles = (block + tile - 1) / tile;
    at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
      std::vector<acc_t> part(tile, acc_t(0));
      for (int64_t t = first; t < last; ++t) {
        const int64_t lo = t * tile, n = std::min(tile, block - lo);
        add_batch<kSquare>(total.data() + lo, part.data(), x + lo, stride, outer, n);
      }
    });
    return total;
  }
  const int64_t chunks = std::min(outer, threads);
  std::vector<double> partial(chunks * block, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    std::vector<acc_t> part(block, acc_t(0));
    for (int64_t k = first; k < last; ++k) {
      const int64_t lo = outer * k / chunks, hi = outer * (k + 1) / chunks;
      add_batch<kSquare>(partial.data() + k * block, part.data(), x + lo * stride, stride, hi - lo, block);
    }
  });
  for (int64_t k = 1; k < chunks; ++k) {
    for (int64_t i = 0; i < block; ++i) partial[i] += partial[k * block + i];
  }
  partial.resize(block);
  return partial;
}

// Per-channel sums of term(x) over x viewed [outer, channels, inner] through its strides. Returns
// false (and nothing) for a layout it does not read directly.
template <bool kSquare, typename scalar_t>
bool channel_sums(const scalar_t* x, const StridedView& v, std::vector<double>& sums) {
  const int64_t channels = v.channels, inner = v.inner, block = channels * inner;
  if (!v.ok) return false;
  // One outer index's [channels, inner] (NCHW, Linear rows) or [inner, channels] (channels_last)
  // is one contiguous block.
  const bool channels_major = v.inner_stride == 1 && (v.channel_stride == inner || channels == 1);
  const bool channels_minor = v.channel_stride == 1 && (v.inner_stride == channels || inner == 1);
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t kLanes = kVectorLanes<acc_t>;
  constexpr int64_t kMinRun = 64;
  if (v.inner_stride == 1 && inner >= kMinRun) {
    // Runs of 64 or more (feature maps, NCHW): each thread reads a contiguous range of outer
    // indices in memory order (shorter runs, 4x4 maps, read faster as blocks of positions). Reading tiles of positions across the batch instead (eight row
    // streams per thread) held two threads to the speed of one.
    const int64_t chunks = std::min(v.outer, chunk_count(v.outer * block));
    std::vector<double> partial(chunks * channels * kLanes);
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      for (int64_t k = first; k < last; ++k) {
        double* lanes = partial.data() + k * channels * kLanes;
        std::fill_n(lanes, channels * kLanes, 0.0);
        const int64_t lo = v.outer * k / chunks, hi = v.outer * (k + 1) / chunks;
        if (inner > kPartialTerms * kLanes) {
          for (int64_t o = lo; o < hi; ++o) {
            add_long_runs<kSquare>(lanes, x + o * v.outer_stride, channels, v.channel_stride, inner);
          }
          continue;
        }
        // Short runs: float partials over as many rows as keep them at kPartialTerms terms.
        const int64_t rows_per_fold = std::max<int64_t>(1, kPartialTerms / ((inner + kLanes - 1) / kLanes));
        std::vector<acc_t> part(channels * kLanes, acc_t(0));
        for (int64_t o = lo; o < hi; ++o) {
          add_short_runs<kSquare>(part.data(), x + o * v.outer_stride, channels, v.channel_stride, inner);
          if ((o - lo) % rows_per_fold == rows_per_fold - 1 || o == hi - 1) fold(lanes, part.data(), channels * kLanes);
        }
      }
    });
    sums.assign(channels, 0.0);
    for (int64_t k = 0; k < chunks; ++k) {
      for (int64_t c = 0; c < channels; ++c) {
        const double* lanes = partial.data() + (k * channels + c) * kLanes;
        for (int64_t j = 0; j < kLanes; ++j) sums[c] += lanes[j];
      }
    }
    return true;
  }
  if (channels_major || channels_minor) {
    const std::vector<double> acc = block_sums<kSquare>(x, v.outer, v.outer_stride, block);
    sums.assign(channels, 0.0);
    for (int64_t c = 0; c < channels; ++c) {
      for (int64_t i = 0; i < inner; ++i) sums[c] += acc[channels_major ? c * inner + i : i * channels + c];
    }
    return true;
  }
  if (v.channel_stride == 1) {
    // Channels innermost but inner positions apart: a row of channels per (outer, inner).
    sums = row_sums<kSquare>(x, v.outer * inner, channels, [&](int64_t r) {
      return (r / inner) * v.outer_stride + (r % inner) * v.inner_stride;
    });
    return true;
  }
  return false;
}

// The sums over a view the kernels read directly, or over a contiguous copy of x otherwise.
template <bool kSquare, typename scalar_t>
std::vector<double> channel_sums(const at::Tensor& x, int64_t start_dim, int64_t end_dim) {
  std::vector<double> sums;
  if (channel_sums<kSquare>(x.const_data_ptr<scalar_t>(), strided_view(x, start_dim, end_dim), sums)) {
    return sums;
  }
  const at::Tensor dense = x.contiguous();
  channel_sums<kSquare>(dense.const_data_ptr<scalar_t>(), strided_view(dense, start_dim, end_dim), sums);
  return sums;
}

// stat[:-1] += z and stat[-1] += 1 (the contribution count).
template <typename stat_t>
void accumulate(const at::Tensor& stat, const std::vector<double>& z) {
  stat_t* out = stat.mutable_data_ptr<stat_t>();
  const size_t n = z.size();
  for (size_t k = 0; k < n; ++k) out[k] += static_cast<stat_t>(z[k]);
  out[n] += stat_t(1);
}

// Checked before anything is read or allocated: a call on a step that is not due costs the
// argument checks and one read of the step.
bool due(const std::optional<at::Tensor>& step, int64_t interval) {
  return !step.has_value() || statistics_due(*step->const_data_ptr<float>(), interval);
}

#define CAFIN_DISPATCH_INPUT(TYPE, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, "cafin_statistics", __VA_ARGS__)

// ------------------------------------------------------------------------------------ sumsq

void sumsq_stats_cpu(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                     bool append_one, const std::optional<at::Tensor>& step, int64_t interval,
                     const std::optional<at::Tensor>& workspace) {
  const ChannelView v = check_sumsq_stats(stat, x, start_dim, end_dim, append_one, step, interval, workspace);
  if (!due(step, interval)) return;
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    std::vector<double> z = channel_sums<true, scalar_t>(x, start_dim, end_dim);
    const double rows = static_cast<double>(v.outer * v.inner);
    for (double& value : z) value /= rows;
    if (append_one) z.push_back(1.0);  // the constant bias input: the mean of N ones
    accumulate<at::opmath_type<scalar_t>>(stat, z);
  });
}

// ------------------------------------------------------------------------------------ norm layers

void norm_grad_stats_cpu(const at::Tensor& stat, const at::Tensor& g, int64_t start_dim, int64_t end_dim,
                         const std::optional<at::Tensor>& step, int64_t interval,
                         const std::optional<at::Tensor>& workspace) {
  check_norm_grad_stats(stat, g, start_dim, end_dim, step, interval, workspace);
  if (!due(step, interval)) return;
  CAFIN_DISPATCH_INPUT(g.scalar_type(), [&] {
    std::vector<double> z = channel_sums<false, scalar_t>(g, start_dim, end_dim);
    const double batch = static_cast<double>(g.size(0));
    for (double& value : z) value = value * value / batch;
    accumulate<at::opmath_type<scalar_t>>(stat, z);
  });
}

void norm_input_stats_cpu(const at::Tensor& stat, const at::Tensor& x,
                          const std::optional<at::Tensor>& step, int64_t interval,
                          const std::optional<at::Tensor>& workspace) {
  const ChannelView v = check_norm_input_stats(stat, x, step, interval, workspace);
  if (!due(step, interval)) return;
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    const std::vector<double> u = channel_sums<false, scalar_t>(x, 1, 2);
    const double rest_sq = static_cast<double>(v.inner) * static_cast<double>(v.inner);
    double sum_sq = 0.0;
    for (const double value : u) sum_sq += (value / rest_sq) * (value / rest_sq);
    const double batch_sq = static_cast<double>(v.outer) * static_cast<double>(v.outer);
    accumulate<at::opmath_type<scalar_t>>(stat, {sum_sq / batch_sq, v.channels / batch_sq});
  });
}

// ------------------------------------------------------------------------------------ conv2d
//
// h[(c, i, j)] sums x^2 over the batch, the groups and the input positions tap (i, j) reads, which
// over all output positions form a lattice window: rows first, first + sh, ..., last, and likewise
// columns (`tap_window`, the same for every channel of a call). So: X2 = the sum over the batch of
// x^2, one plane per channel (the single pass over the input), then per plane and kernel column j
// each row's sum over j's column window, and per tap the sum of those over its row window: only
// additions, so an overflowed square stays +inf (or the NaN it holds), as in the reference, and no
// unfold. The planes are taken kTapLanes channels at a time, interleaved ([H, W, lane]), so that
// every addition is one vector over the channels: per plane alone they are short dependent chains.
constexpr int64_t kTapLanes = 8;

// The row and column windows of every kernel row i and column j.
struct TapPlan {
  std::vector<TapWindow> rows, cols;
  explicit TapPlan(const ConvGeometry& g) {
    for (int64_t i = 0; i < g.kh; ++i) rows.push_back(tap_window(g.out_h, g.sh, i * g.dh - g.top, g.height));
    for (int64_t j = 0; j < g.kw; ++j) cols.push_back(tap_window(g.out_w, g.sw, j * g.dw - g.left, g.width));
  }
};

// The kh*kw tap sums of `lanes` (<= kTapLanes) planes interleaved in t ([H, W, kTapLanes]) into
// taps + l * kh * kw for lane l; `rows` is scratch.
CAFIN_CPU_CLONES void lane_taps(const double* __restrict t, const ConvGeometry& g, const TapPlan& plan,
                                std::vector<double>& rows, double* taps, int64_t lanes) {
  constexpr int64_t L = kTapLanes;
  const int64_t H = g.height, W = g.width, taps_per = g.kh * g.kw;
  rows.resize(H * L);
  for (int64_t j = 0; j < g.kw; ++j) {
    const TapWindow wx = plan.cols[j];
    for (int64_t y = 0; y < H; ++y) {
      double acc[L] = {};
      const double* row = t + y * W * L;
      for (int64_t n = 0; n < wx.count; ++n) {
        for (int64_t l = 0; l < L; ++l) acc[l] += row[(wx.first + n * g.sw) * L + l];
      }
      for (int64_t l = 0; l < L; ++l) rows[y * L + l] = acc[l];
    }
    for (int64_t i = 0; i < g.kh; ++i) {
      const TapWindow wy = plan.rows[i];
      double acc[L] = {};
      for (int64_t m = 0; m < wy.count; ++m) {
        for (int64_t l = 0; l < L; ++l) acc[l] += rows[(wy.first + m * g.sh) * L + l];
      }
      for (int64_t l = 0; l < lanes; ++l) taps[l * taps_per + i * g.kw + j] = acc[l];
    }
  }
}

// The taps of channels [c0, c0 + nc) of one call, kTapLanes at a time, reading channel c's X2
// entry at position p from at(c, p); `lanes` and `rows` are scratch.
template <typename At>
void channel_block_taps(At at, int64_t c0, int64_t nc, const ConvGeometry& g, const TapPlan& plan,
                        std::vector<double>& lanes, std::vector<double>& rows, double* taps) {
  const int64_t plane = g.height * g.width, taps_per = g.kh * g.kw;
  lanes.resize(plane * kTapLanes);
  for (int64_t c = c0; c < c0 + nc; c += kTapLanes) {
    const int64_t n = std::min(kTapLanes, c0 + nc - c);
    if (n < kTapLanes) std::fill(lanes.begin(), lanes.end(), 0.0);
    for (int64_t p = 0; p < plane; ++p) {
      for (int64_t l = 0; l < n; ++l) lanes[p * kTapLanes + l] = at(c + l, p);
    }
    lane_taps(lanes.data(), g, plan, rows, taps + c * taps_per, n);
  }
}

// Per channel, its kh*kw tap sums, for x with contiguous [H, W] planes (NCHW, any batch and
// channel strides). A thread takes a tile of neighbouring channels and reads it batch entry by
// batch entry, so each read is one long run in memory order (a plane alone is often a single
// page, where the hardware prefetcher would restart at every plane); the tile's X2 stays in cache
// for its taps.
template <typename scalar_t>
void channel_taps_planar(const scalar_t* x, int64_t batch_stride, int64_t channel_stride,
                         const ConvGeometry& g, double* taps) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t plane = g.height * g.width;
  // Tiles of up to 32K positions (their partial and double sums fit in L2), at least one per
  // thread when there is enough work.
  const int64_t threads = chunk_count(g.batch * plane * g.channels);
  const int64_t per_tile = std::max<int64_t>(
      1, std::min<int64_t>(kTilePositions / plane, (g.channels + threads - 1) / threads));
  const int64_t tiles = (g.channels + per_tile - 1) / per_tile;
  const bool adjacent = channel_stride == plane;  // a tile's planes form one run
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, g.batch * plane * per_tile));
  const TapPlan plan(g);
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    std::vector<acc_t> part(per_tile * plane, acc_t(0));
    std::vector<double> x2(per_tile * plane), lanes, rows;
    for (int64_t t = first; t < last; ++t) {
      const int64_t c0 = t * per_tile, nc = std::min(per_tile, g.channels - c0);
      std::fill(x2.begin(), x2.end(), 0.0);
      const scalar_t* base = x + c0 * channel_stride;
      if (adjacent) {
        add_batch<true>(x2.data(), part.data(), base, batch_stride, g.batch, nc * plane);
      } else {
        for (int64_t c = 0; c < nc; ++c) {
          add_batch<true>(x2.data() + c * plane, part.data(), base + c * channel_stride, batch_stride,
                          g.batch, plane);
        }
      }
      channel_block_taps([&](int64_t c, int64_t p) { return x2[(c - c0) * plane + p]; }, c0, nc, g, plan,
                         lanes, rows, taps);
    }
  });
}

// The same for channels_last x (each batch entry one contiguous [H, W, C] block): X2 in that
// layout, tiles of positions per thread, then each channel's plane gathered for its taps.
template <typename scalar_t>
void channel_taps_channels_last(const scalar_t* x, int64_t batch_stride, const ConvGeometry& g,
                                double* taps) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t plane = g.height * g.width, block = plane * g.channels;
  std::vector<double> x2(block, 0.0);
  const int64_t threads = chunk_count(g.batch * block);
  const int64_t kTile = std::min(kTilePositions, (block + threads - 1) / threads);
  const int64_t tiles = (block + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, g.batch * kTile));
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    std::vector<acc_t> part(kTile, acc_t(0));
    for (int64_t t = first; t < last; ++t) {
      const int64_t lo = t * kTile, n = std::min(kTile, block - lo);
      add_batch<true>(x2.data() + lo, part.data(), x + lo, batch_stride, g.batch, n);
    }
  });
  // Here X2 is already channels-inner: each block of kTapLanes channels is one short run per position.
  const TapPlan plan(g);
  const int64_t groups = (g.channels + kTapLanes - 1) / kTapLanes;
  at::parallel_for(0, groups, std::max<int64_t>(1, kGrainSize / (plane * kTapLanes)), [&](int64_t first, int64_t last) {
    std::vector<double> lanes, rows;
    const int64_t c0 = first * kTapLanes, nc = std::min(last * kTapLanes, g.channels) - c0;
    channel_block_taps([&](int64_t c, int64_t p) { return x2[p * g.channels + c]; }, c0, nc, g, plan, lanes,
                       rows, taps);
  });
}

void conv2d_input_stats_cpu(const at::Tensor& stat, const at::Tensor& x, at::IntArrayRef kernel_size,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                            int64_t groups, bool append_one, const std::optional<at::Tensor>& step,
                            int64_t interval, const std::optional<at::Tensor>& workspace) {
  const ConvGeometry g = check_conv2d_input_stats(stat, x, kernel_size, stride, padding, dilation,
                                                  groups, append_one, step, interval, workspace);
  if (!due(step, interval)) return;
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    const int64_t taps_per = g.kh * g.kw;
    std::vector<double> taps(g.channels * taps_per);
    int64_t size, unit;
    // [H, W, C] of one batch entry contiguous: channels_last (or C == 1 / H == W == 1 layouts).
    const at::Tensor hwc = x.permute({0, 2, 3, 1});
    if (merge_dims(hwc, 1, 4, size, unit) && unit == 1) {
      channel_taps_channels_last(x.const_data_ptr<scalar_t>(), x.stride(0), g, taps.data());
    } else {
      const at::Tensor input = merge_dims(x, 2, 4, size, unit) && unit == 1 ? x : x.contiguous();
      channel_taps_planar(input.const_data_ptr<scalar_t>(), input.stride(0), input.stride(1), g,
                          taps.data());
    }
    // Channel q * C/G + c of group q feeds entry (c, i, j): summed over groups in a fixed order.
    const int64_t cg = g.group_channels();
    std::vector<double> z(g.patch(), 0.0);
    for (int64_t q = 0; q < g.groups; ++q) {
      for (int64_t k = 0; k < cg * taps_per; ++k) z[k] += taps[q * cg * taps_per + k];
    }
    // The published divisor holds D = (C/G) kh kw.
    const double divisor = static_cast<double>(g.batch * g.out_h * g.out_w * g.patch());
    for (double& value : z) value /= divisor;
    if (append_one) z.push_back(static_cast<double>(g.groups) / g.patch());
    accumulate<at::opmath_type<scalar_t>>(stat, z);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) {
  m.impl("sumsq_stats_", &sumsq_stats_cpu);
  m.impl("conv2d_input_stats_", &conv2d_input_stats_cpu);
  m.impl("norm_input_stats_", &norm_input_stats_cpu);
  m.impl("norm_grad_stats_", &norm_grad_stats_cpu);
}

}  // namespace cafin
