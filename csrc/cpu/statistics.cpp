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
#include <vector>

#include "adafisher_math.h"
#include "checks.h"

namespace cafin {
namespace {

// Below this many elements threads cost more than they save (aten's TensorIterator grain).
constexpr int64_t kGrainSize = 32768;

// Hot loops are compiled for several ISAs and picked at load time: the build may not use -march.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CAFIN_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CAFIN_CPU_CLONES
#endif

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
  // With inner == 1 a chunk is a range of rows; otherwise a range of (outer, channel) runs.
  const int64_t items = v.inner == 1 ? v.outer : v.outer * channels;
  const int64_t chunks = std::min(items, chunk_count(v.outer * channels * v.inner));
  std::vector<double> partial(chunks * channels, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      double* acc = partial.data() + k * channels;
      const int64_t lo = items * k / chunks;
      const int64_t hi = items * (k + 1) / chunks;
      for (int64_t item = lo; item < hi; ++item) {
        if (v.inner == 1) {
          add_row<kSquare>(acc, x + item * channels, channels);
        } else {
          acc[item % channels] += sum_run<kSquare>(x + item * v.inner, v.inner);
        }
      }
    }
  });
  std::vector<double> sums(partial.begin(), partial.begin() + channels);
  for (int64_t k = 1; k < chunks; ++k) {
    for (int64_t c = 0; c < channels; ++c) sums[c] += partial[k * channels + c];
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
      for (int64_t b = 0; b < batch; ++b) add_row<true>(x2.data() + lo, x + b * positions + lo, hi - lo);
    }
  });
  return x2;
}

// h[(c, i, j)] = sum over groups and output positions of the in-range taps of X2.
std::vector<double> patch_sums(const std::vector<double>& x2, const ConvGeometry& g) {
  const int64_t cg = g.group_channels();
  std::vector<double> h(g.patch(), 0.0);
  at::parallel_for(0, g.patch(), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const int64_t c = k / (g.kh * g.kw);
      const int64_t i = k / g.kw % g.kh;
      const int64_t j = k % g.kw;
      const TapRange ps = tap_range(g.out_h, g.sh, i * g.dh - g.top, g.height);
      const TapRange rs = tap_range(g.out_w, g.sw, j * g.dw - g.left, g.width);
      double total = 0.0;
      for (int64_t q = 0; q < g.groups; ++q) {
        const double* plane = x2.data() + (q * cg + c) * g.height * g.width;
        for (int64_t p = ps.first; p <= ps.last; ++p) {
          const double* line = plane + (p * g.sh + i * g.dh - g.top) * g.width + j * g.dw - g.left;
          for (int64_t r = rs.first; r <= rs.last; ++r) total += line[r * g.sw];
        }
      }
      h[k] = total;
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
