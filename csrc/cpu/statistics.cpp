// CPU kernels of the curvature statistics. Every input is read once; sums run in double (the
// float32 results are compared with the reference to 1e-5, and bf16/fp16 squares would overflow in
// their own type), split over threads in a fixed number of chunks so results do not depend on
// scheduling. The Conv2d input side never unfolds: patches of X2 = sum over the batch of x^2.
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

namespace cafin {
namespace {

// Squared in the op-math type, as the reference and the CUDA kernels do (a square that overflows
// float32 is +inf, which the factor average maps to 1), then summed in double.
template <bool kSquare, typename scalar_t>
C10_ALWAYS_INLINE double term(scalar_t v) {
  const auto x = static_cast<at::opmath_type<scalar_t>>(v);
  return static_cast<double>(kSquare ? x * x : x);
}

// acc[k] += term(x[k]): the accumulation across rows, vectorised along the row.
template <bool kSquare, typename scalar_t>
CAFIN_CPU_CLONES void add_row(double* __restrict acc, const scalar_t* __restrict x, int64_t n) {
  for (int64_t k = 0; k < n; ++k) acc[k] += term<kSquare>(x[k]);
}

// sum_k term(x[k]) with independent lanes, so the loop vectorises without reassociation flags.
template <bool kSquare, typename scalar_t>
CAFIN_CPU_CLONES double sum_run(const scalar_t* __restrict x, int64_t n) {
  constexpr int kLanes = 16;
  double lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += term<kSquare>(x[k + j]);
  }
  double total = 0.0;
  for (; k < n; ++k) total += term<kSquare>(x[k]);
  for (int j = 0; j < kLanes; ++j) total += lanes[j];
  return total;
}

int64_t chunk_count(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work / kGrainSize));
}

// Per-channel sums of term(x) over x viewed [outer, channels, inner] (contiguous).
template <bool kSquare, typename scalar_t>
std::vector<double> channel_sums(const scalar_t* x, const ChannelView& v) {
  const int64_t channels = v.channels;
  // Short inner runs (Linear rows, small feature maps) are summed whole rows at a time into
  // per-(channel, inner) accumulators, reduced over inner at the end; long runs one at a time.
  const bool by_rows = v.inner < 256;
  const int64_t width = by_rows ? channels * v.inner : channels;
  const int64_t items = by_rows ? v.outer : v.outer * channels;
  const int64_t chunks = std::min(items, chunk_count(v.outer * channels * v.inner));
  std::vector<double> partial(chunks * width, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      double* acc = partial.data() + k * width;
      const int64_t lo = items * k / chunks;
      const int64_t hi = items * (k + 1) / chunks;
      for (int64_t item = lo; item < hi; ++item) {
        if (by_rows) {
          add_row<kSquare>(acc, x + item * width, width);
        } else {
          acc[item % channels] += sum_run<kSquare>(x + item * v.inner, v.inner);
        }
      }
    }
  });
  std::vector<double> sums(channels, 0.0);
  for (int64_t k = 0; k < chunks; ++k) {
    const double* acc = partial.data() + k * width;
    for (int64_t c = 0; c < channels; ++c) {
      if (by_rows) {
        for (int64_t i = 0; i < v.inner; ++i) sums[c] += acc[c * v.inner + i];
      } else {
        sums[c] += acc[c];
      }
    }
  }
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

bool due(const std::optional<at::Tensor>& step, int64_t interval) {
  return !step.has_value() || statistics_due(*step->const_data_ptr<float>(), interval);
}

#define CAFIN_DISPATCH_INPUT(TYPE, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, "cafin_statistics", __VA_ARGS__)

// ------------------------------------------------------------------------------------ sumsq

void sumsq_stats_cpu(const at::Tensor& stat, const at::Tensor& x, int64_t start_dim, int64_t end_dim,
                     bool append_one, const std::optional<at::Tensor>& step, int64_t interval) {
  const ChannelView v = check_sumsq_stats(stat, x, start_dim, end_dim, append_one, step, interval);
  if (!due(step, interval)) return;
  const at::Tensor input = x.contiguous();
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    std::vector<double> z = channel_sums<true>(input.const_data_ptr<scalar_t>(), v);
    const double rows = static_cast<double>(v.outer * v.inner);
    for (double& value : z) value /= rows;
    if (append_one) z.push_back(1.0);  // the constant bias input: the mean of N ones
    accumulate<at::opmath_type<scalar_t>>(stat, z);
  });
}

// ------------------------------------------------------------------------------------ norm layers

void norm_grad_stats_cpu(const at::Tensor& stat, const at::Tensor& g, int64_t start_dim, int64_t end_dim,
                         const std::optional<at::Tensor>& step, int64_t interval) {
  const ChannelView v = check_norm_grad_stats(stat, g, start_dim, end_dim, step, interval);
  if (!due(step, interval)) return;
  const at::Tensor input = g.contiguous();
  CAFIN_DISPATCH_INPUT(g.scalar_type(), [&] {
    std::vector<double> z = channel_sums<false>(input.const_data_ptr<scalar_t>(), v);
    const double batch = static_cast<double>(g.size(0));
    for (double& value : z) value = value * value / batch;
    accumulate<at::opmath_type<scalar_t>>(stat, z);
  });
}

void norm_input_stats_cpu(const at::Tensor& stat, const at::Tensor& x,
                          const std::optional<at::Tensor>& step, int64_t interval) {
  const ChannelView v = check_norm_input_stats(stat, x, step, interval);
  if (!due(step, interval)) return;
  const at::Tensor input = x.contiguous();
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    const std::vector<double> u = channel_sums<false>(input.const_data_ptr<scalar_t>(), v);
    const double rest_sq = static_cast<double>(v.inner) * static_cast<double>(v.inner);
    double sum_sq = 0.0;
    for (const double value : u) sum_sq += (value / rest_sq) * (value / rest_sq);
    const double batch_sq = static_cast<double>(v.outer) * static_cast<double>(v.outer);
    accumulate<at::opmath_type<scalar_t>>(stat, {sum_sq / batch_sq, v.channels / batch_sq});
  });
}

// ------------------------------------------------------------------------------------ conv2d

// The output positions o in [0, out) whose tap o * stride + offset lands inside [0, size).
struct TapRange {
  int64_t first, last;  // inclusive; empty when first > last
};

TapRange tap_range(int64_t out, int64_t stride, int64_t offset, int64_t size) {
  const int64_t first = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  const int64_t top = size - 1 - offset;
  const int64_t last = top < 0 ? -1 : std::min(out - 1, top / stride);
  return {first, last};
}

// X2[c, y, x] = sum over the batch of x[b, c, y, x]^2: one pass over the input, each chunk of
// positions owned by one thread.
template <typename scalar_t>
std::vector<double> batch_sum_of_squares(const scalar_t* x, int64_t batch, int64_t positions) {
  std::vector<double> x2(positions, 0.0);
  const int64_t chunks = std::min(positions, chunk_count(batch * positions));
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const int64_t lo = positions * k / chunks;
      const int64_t hi = positions * (k + 1) / chunks;
      // Tiles small enough for the double accumulators to stay in L1 across the batch.
      constexpr int64_t kTile = 32768;
      for (int64_t t = lo; t < hi; t += kTile) {
        const int64_t n = std::min(kTile, hi - t);
        for (int64_t b = 0; b < batch; ++b) add_row<true>(x2.data() + t, x + b * positions + t, n);
      }
    }
  });
  return x2;
}

// Strided 2-D prefix sums of one X2 plane: q[y][x] = sum of X2[y'][x'] over y' <= y, x' <= x with
// y' = y (mod sh) and x' = x (mod sw). The taps of one kernel entry (i, j) over every output
// position lie on such a lattice, so each entry is four lookups instead of oh*ow additions.
void strided_prefix(const double* x2, double* q, int64_t height, int64_t width, int64_t sh, int64_t sw) {
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      double v = x2[y * width + x];
      if (y >= sh) v += q[(y - sh) * width + x];
      if (x >= sw) v += q[y * width + x - sw];
      if (y >= sh && x >= sw) v -= q[(y - sh) * width + x - sw];
      q[y * width + x] = v;
    }
  }
}

// The sum of X2 over rows y0, y0 + sh, ..., y1 and columns x0, x0 + sw, ..., x1, from q.
double lattice_sum(const double* q, int64_t width, int64_t sh, int64_t sw, int64_t y0, int64_t y1,
                   int64_t x0, int64_t x1) {
  double total = q[y1 * width + x1];
  if (y0 >= sh) total -= q[(y0 - sh) * width + x1];
  if (x0 >= sw) total -= q[y1 * width + x0 - sw];
  if (y0 >= sh && x0 >= sw) total += q[(y0 - sh) * width + x0 - sw];
  return total;
}

// h[(c, i, j)] = sum over groups and output positions of the in-range taps of X2.
std::vector<double> patch_sums(const std::vector<double>& x2, const ConvGeometry& g) {
  const int64_t cg = g.group_channels();
  const int64_t plane = g.height * g.width;
  std::vector<double> h(g.patch(), 0.0);
  at::parallel_for(0, cg, 1, [&](int64_t first, int64_t last) {
    std::vector<double> q(plane);
    for (int64_t c = first; c < last; ++c) {
      for (int64_t grp = 0; grp < g.groups; ++grp) {
        const double* x2_plane = x2.data() + (grp * cg + c) * plane;
        // Differences of prefix sums turn an overflowed (inf) square into NaN: such a plane is
        // summed tap by tap, so it gives +inf like the reference.
        const bool finite = std::all_of(x2_plane, x2_plane + plane, [](double v) { return std::isfinite(v); });
        if (finite) strided_prefix(x2_plane, q.data(), g.height, g.width, g.sh, g.sw);
        for (int64_t i = 0; i < g.kh; ++i) {
          const TapRange ps = tap_range(g.out_h, g.sh, i * g.dh - g.top, g.height);
          if (ps.first > ps.last) continue;
          const int64_t y0 = ps.first * g.sh + i * g.dh - g.top;
          const int64_t y1 = ps.last * g.sh + i * g.dh - g.top;
          for (int64_t j = 0; j < g.kw; ++j) {
            const TapRange rs = tap_range(g.out_w, g.sw, j * g.dw - g.left, g.width);
            if (rs.first > rs.last) continue;
            const int64_t x0 = rs.first * g.sw + j * g.dw - g.left;
            const int64_t x1 = rs.last * g.sw + j * g.dw - g.left;
            double total = 0.0;
            if (finite) {
              total = lattice_sum(q.data(), g.width, g.sh, g.sw, y0, y1, x0, x1);
            } else {
              for (int64_t y = y0; y <= y1; y += g.sh) {
                for (int64_t x = x0; x <= x1; x += g.sw) total += x2_plane[y * g.width + x];
              }
            }
            h[(c * g.kh + i) * g.kw + j] += total;
          }
        }
      }
    }
  });
  return h;
}

void conv2d_input_stats_cpu(const at::Tensor& stat, const at::Tensor& x, at::IntArrayRef kernel_size,
                            at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                            int64_t groups, bool append_one, const std::optional<at::Tensor>& step,
                            int64_t interval) {
  const ConvGeometry g = check_conv2d_input_stats(stat, x, kernel_size, stride, padding, dilation,
                                                  groups, append_one, step, interval);
  if (!due(step, interval)) return;
  const at::Tensor input = x.contiguous();
  CAFIN_DISPATCH_INPUT(x.scalar_type(), [&] {
    const std::vector<double> x2 = batch_sum_of_squares(input.const_data_ptr<scalar_t>(), g.batch,
                                                        g.channels * g.height * g.width);
    std::vector<double> z = patch_sums(x2, g);
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
