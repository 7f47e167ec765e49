// CUDA kernels of the K-FAC ops. Per-step scalars (decay, damping, lr, kl_clip, the step count)
// are read through device pointers and the KL-clip factor is reduced and applied on the device:
// no host sync, so the calls can be captured in a CUDA graph. Semantics:
// cafin/reference/kfac.py; arithmetic: kfac_math.h, shared with the CPU kernels.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "cuda/multi_tensor.cuh"
#include "kfac_checks.h"
#include "kfac_math.h"

namespace cafin {
namespace cuda {
namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

// The fold as multi-tensor launches (multi_tensor.cuh): every factor of one dtype in one kernel
// per table, each block one chunk of one factor; a launch that marks the statistics holding inf
// or NaN first, then the fold, then one list op that empties the counts: three launches for any
// number of layers (it was three per factor).
constexpr int kFoldEntries = 40;  // 48-byte entries: a table stays under 4 KB of arguments

struct FoldMeta {
  void* f;
  void* s;
  const void* count;
  int* bad;
  int64_t d;
};

using FoldTable = TensorTable<FoldMeta, kFoldEntries>;

// Marks `bad` when a statistic holds inf or NaN (an overflowing GradScaler step): it is dropped.
// The first to mark a statistic that a due fold would have taken adds 1 to `dropped`: one
// integer-valued add per statistic, so the count is the same in any order.
template <typename scalar_t>
__global__ void nonfinite_kernel(const FoldTable table, float* __restrict dropped,
                                 const float* __restrict step, int64_t interval) {
  const FoldMeta& t = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t lo = int64_t(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  const scalar_t* s = static_cast<const scalar_t*>(t.s);
  for (int64_t idx = lo + threadIdx.x; idx < hi; idx += blockDim.x) {
    if (!isfinite(s[idx])) {
      const bool first = atomicExch(t.bad, 1) == 0;
      if (first && dropped != nullptr && kfac_due(step, interval) &&
          *static_cast<const scalar_t*>(t.count) > scalar_t(0)) {
        atomicAdd(dropped, 1.0f);
      }
      return;
    }
  }
}

// Thread (r, j), j >= r, of each group folds the entry and its mirror and empties both
// statistics, so nothing is read after another thread wrote it (the mirror may lie in another
// block's chunk: its own thread, j < r, skips).
template <typename scalar_t>
__global__ void factor_ema_kernel(const FoldTable table, const double* __restrict decay,
                                  const float* __restrict step, int64_t interval) {
  const FoldMeta& t = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t lo = int64_t(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  scalar_t* f = static_cast<scalar_t*>(t.f);
  scalar_t* s = static_cast<scalar_t*>(t.s);
  const scalar_t c = *static_cast<const scalar_t*>(t.count);
  const bool fold = kfac_due(step, interval) && c > scalar_t(0) && *t.bad == 0;
  const scalar_t dec = static_cast<scalar_t>(*decay);
  const int64_t d = t.d;
  for (int64_t idx = lo + threadIdx.x; idx < hi; idx += blockDim.x) {
    const int64_t base = (idx / (d * d)) * d * d;
    const int64_t r = (idx - base) / d, j = (idx - base) % d;
    if (j < r) continue;
    const int64_t a = base + r * d + j, b = base + j * d + r;
    const scalar_t sa = s[a], sb = s[b];
    if (fold) {
      f[a] = kfac_ema(f[a], sa, sb, c, dec);
      if (a != b) f[b] = kfac_ema(f[b], sb, sa, c, dec);
    }
    s[a] = scalar_t(0);
    s[b] = scalar_t(0);
  }
}

void kfac_factor_ema_cuda(at::TensorList factors, at::TensorList stats, at::TensorList counts,
                          const at::Tensor& decay, const std::optional<at::Tensor>& step,
                          int64_t interval, const std::optional<at::Tensor>& dropped) {
  check_kfac_factor_ema(factors, stats, counts, decay, step, interval, dropped);
  if (factors.empty()) return;
  const c10::cuda::CUDAGuard guard(factors[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  static_assert(sizeof(FoldTable) + 3 * sizeof(void*) <= 4000, "kernel arguments must stay under 4 KB");
  const float* step_ptr = step.has_value() ? step->const_data_ptr<float>() : nullptr;
  float* dropped_ptr = dropped.has_value() ? dropped->mutable_data_ptr<float>() : nullptr;
  const at::Tensor bad = at::zeros({static_cast<int64_t>(factors.size())},
                                   factors[0].options().dtype(at::kInt));
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    std::vector<FoldMeta> metas;
    std::vector<int64_t> numels;
    for (size_t i = 0; i < factors.size(); ++i) {
      if (factors[i].scalar_type() != dtype || factors[i].numel() == 0) continue;
      metas.push_back({factors[i].data_ptr(), stats[i].data_ptr(), counts[i].const_data_ptr(),
                       bad.mutable_data_ptr<int>() + i, factors[i].size(1)});
      numels.push_back(factors[i].numel());
    }
    if (metas.empty()) continue;
    AT_DISPATCH_FLOATING_TYPES(dtype, "kfac_factor_ema_", [&] {
      multi_tensor_apply<FoldMeta, kFoldEntries>(metas, numels, [&](const FoldTable& table, int blocks) {
        nonfinite_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(table, dropped_ptr, step_ptr, interval);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      multi_tensor_apply<FoldMeta, kFoldEntries>(metas, numels, [&](const FoldTable& table, int blocks) {
        factor_ema_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(table, decay.const_data_ptr<double>(),
                                                                     step_ptr, interval);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
  // After every fold has read its count (same stream, so in order).
  at::_foreach_zero_(counts);
}

template <typename scalar_t>
__global__ void eigen_scale_kernel(scalar_t* __restrict v, const scalar_t* __restrict dg,
                                   const scalar_t* __restrict da, const double* __restrict damping,
                                   int64_t groups, int64_t rows, int64_t cols) {
  const scalar_t lam = static_cast<scalar_t>(*damping);
  const int64_t total = groups * rows * cols;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(blockDim.x) * gridDim.x) {
    const int64_t gr = idx / cols;          // group * rows + row
    const int64_t c = idx - gr * cols;
    const int64_t g = gr / rows;
    v[idx] = kfac_eigen_scale(v[idx], dg[gr], da[g * cols + c], lam);
  }
}

void kfac_eigen_scale_cuda(at::TensorList v, at::TensorList dg, at::TensorList da,
                           const at::Tensor& damping) {
  check_kfac_eigen_scale(v, dg, da, damping);
  if (v.empty()) return;
  const c10::cuda::CUDAGuard guard(v[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t n = v[i].numel();
    if (n == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(v[i].scalar_type(), "kfac_eigen_scale_", [&] {
      eigen_scale_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
          v[i].mutable_data_ptr<scalar_t>(), dg[i].const_data_ptr<scalar_t>(),
          da[i].const_data_ptr<scalar_t>(), damping.const_data_ptr<double>(), v[i].size(0),
          v[i].size(1), v[i].size(2));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

// The gradient entry that precond entry (r, c) of a [rows, cols] matrix replaces.
template <typename scalar_t>
__device__ __forceinline__ scalar_t* grad_at(scalar_t* w, scalar_t* b, int64_t r, int64_t c,
                                             int64_t wc) {
  return c < wc ? w + r * wc + c : b + r;
}

// precond + shift at (r, c), rounded to scalar_t as the write rounds it (no shift: as it is).
template <typename scalar_t>
__device__ __forceinline__ scalar_t shifted(const scalar_t* __restrict v, int64_t r, int64_t c, int64_t ld,
                                            const scalar_t* __restrict shift) {
  return shift == nullptr ? v[r * ld + c] : scalar_t(v[r * ld + c] + *shift);
}

// The write as multi-tensor launches (multi_tensor.cuh): every entry in one kernel per table,
// each block one chunk of one entry's [rows, cols] elements (the weight columns, then the bias
// column). With a KL clip, a first pass writes each chunk's two terms of the clip sum, one block
// per entry then adds its chunks' terms in order, and one thread makes the factor: a fixed order
// from run to run (no atomics), whatever the number of layers, in four launches and the write.
constexpr int kWriteEntries = 30;  // 64-byte entries: a table stays under 4 KB of arguments

struct WriteMeta {
  const void* v;
  void* w;
  void* b;
  int64_t cols, ld, wc;  // columns, distance between rows of v, weight columns
  const void* shift;     // nullptr: none
  double* terms;         // this entry's first chunk's two terms
};

using WriteTable = TensorTable<WriteMeta, kWriteEntries>;

template <typename scalar_t>
__global__ void dot_kernel(const WriteTable table) {
  __shared__ double partial[2][kThreads];
  const WriteMeta& t = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t chunk = table.block_to_chunk[blockIdx.x];
  const int64_t lo = chunk * kChunkSize, hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  const scalar_t* v = static_cast<const scalar_t*>(t.v);
  const scalar_t* w = static_cast<const scalar_t*>(t.w);
  const scalar_t* b = static_cast<const scalar_t*>(t.b);
  const scalar_t* shift = static_cast<const scalar_t*>(t.shift);
  double weights = 0.0, bias = 0.0;  // two registers (an array indexed by c would sit in local memory)
  for (int64_t idx = lo + threadIdx.x; idx < hi; idx += blockDim.x) {
    const int64_t r = idx / t.cols, c = idx - r * t.cols;
    const double term = static_cast<double>(shifted(v, r, c, t.ld, shift));
    if (c < t.wc) {
      weights += term * static_cast<double>(w[r * t.wc + c]);
    } else {
      bias += term * static_cast<double>(b[r]);
    }
  }
  partial[0][threadIdx.x] = weights;
  partial[1][threadIdx.x] = bias;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      partial[0][threadIdx.x] += partial[0][threadIdx.x + stride];
      partial[1][threadIdx.x] += partial[1][threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    t.terms[2 * chunk] = partial[0][0];
    t.terms[2 * chunk + 1] = partial[1][0];
  }
}

// Entry k's two terms of the clip sum, its chunks' terms added in order: parts[2 (first + k)].
constexpr int kSumEntries = 240;  // 16-byte entries

struct TermsTable {
  const double* terms[kSumEntries];
  int64_t chunks[kSumEntries];
};

__global__ void entry_terms_kernel(const TermsTable table, int64_t first, double* __restrict parts) {
  const double* terms = table.terms[blockIdx.x];
  const int64_t chunks = table.chunks[blockIdx.x];
  if (threadIdx.x < 2) {
    double total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) total += terms[2 * c + threadIdx.x];
    parts[2 * (first + blockIdx.x) + threadIdx.x] = total;
  }
}

// The clip factor from every entry's two terms, on the device.
__global__ void clip_scale_kernel(const double* __restrict parts, int64_t n, bool abs_terms,
                                  const double* __restrict lr, const double* __restrict kl_clip,
                                  double* __restrict nu) {
  *nu = kfac_kl_scale(kfac_clip_sum(parts, n, abs_terms) * (*lr * *lr), *kl_clip);
}

template <typename scalar_t>
__global__ void apply_kernel(const WriteTable table, const double* __restrict nu_ptr) {
  const WriteMeta& t = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t lo = int64_t(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  const scalar_t nu = nu_ptr == nullptr ? scalar_t(1) : static_cast<scalar_t>(*nu_ptr);
  const scalar_t* v = static_cast<const scalar_t*>(t.v);
  scalar_t* w = static_cast<scalar_t*>(t.w);
  scalar_t* b = static_cast<scalar_t*>(t.b);
  const scalar_t* shift = static_cast<const scalar_t*>(t.shift);
  for (int64_t idx = lo + threadIdx.x; idx < hi; idx += blockDim.x) {
    const int64_t r = idx / t.cols, c = idx - r * t.cols;
    *grad_at(w, b, r, c, t.wc) = shifted(v, r, c, t.ld, shift) * nu;
  }
}

void kfac_precondition_apply_cuda(at::TensorList weight_grads, at::TensorList bias_grads,
                                  at::TensorList precond, const at::Tensor& lr,
                                  const std::optional<at::Tensor>& kl_clip,
                                  const std::optional<at::Tensor>& shift, bool abs_terms) {
  check_kfac_precondition_apply(weight_grads, bias_grads, precond, lr, kl_clip, shift);
  if (weight_grads.empty()) return;
  const c10::cuda::CUDAGuard guard(weight_grads[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  static_assert(sizeof(WriteTable) + sizeof(void*) <= 4000, "kernel arguments must stay under 4 KB");
  static_assert(sizeof(TermsTable) + 2 * sizeof(void*) <= 4000, "kernel arguments must stay under 4 KB");
  const int64_t n = static_cast<int64_t>(precond.size());
  // Each entry's chunks' terms in a row, in one scratch; then its two terms (parts).
  std::vector<int64_t> first_chunk(n), numels(n);
  int64_t chunks = 0;
  for (int64_t i = 0; i < n; ++i) {
    numels[i] = precond[i].size(0) * precond[i].size(1) * precond[i].size(2);
    first_chunk[i] = chunks;
    chunks += (numels[i] + kChunkSize - 1) / kChunkSize;
  }
  at::Tensor terms, parts, nu;
  if (kl_clip.has_value()) {
    terms = at::empty({2 * std::max<int64_t>(chunks, 1)}, lr.options());
    parts = at::empty({2 * n}, lr.options());
    nu = at::empty({}, lr.options());
  }
  AT_DISPATCH_FLOATING_TYPES(weight_grads[0].scalar_type(), "kfac_precondition_apply_", [&] {
    const scalar_t* shifts = shift.has_value() ? shift->const_data_ptr<scalar_t>() : nullptr;
    std::vector<WriteMeta> metas(n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t cols = precond[i].size(2);
      metas[i] = {precond[i].const_data_ptr(), weight_grads[i].data_ptr(), bias_grads[i].data_ptr(), cols,
                  kfac_row_stride(precond[i]), cols - (bias_grads[i].numel() > 0 ? 1 : 0),
                  shifts == nullptr ? nullptr : shifts + i,
                  kl_clip.has_value() ? terms.mutable_data_ptr<double>() + 2 * first_chunk[i] : nullptr};
    }
    if (kl_clip.has_value()) {
      multi_tensor_apply<WriteMeta, kWriteEntries>(metas, numels, [&](const WriteTable& table, int blocks) {
        dot_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(table);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      // Every entry's two parts are written (an entry without elements: zeros).
      for (int64_t first = 0; first < n; first += kSumEntries) {
        TermsTable table;
        int count = 0;
        for (int64_t i = first; i < std::min<int64_t>(n, first + kSumEntries); ++i, ++count) {
          table.terms[count] = metas[i].terms;
          table.chunks[count] = (numels[i] + kChunkSize - 1) / kChunkSize;
        }
        entry_terms_kernel<<<count, 32, 0, stream>>>(table, first, parts.mutable_data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      clip_scale_kernel<<<1, 1, 0, stream>>>(parts.const_data_ptr<double>(), 2 * n, abs_terms,
                                             lr.const_data_ptr<double>(),
                                             kl_clip->const_data_ptr<double>(), nu.mutable_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const double* nu_ptr = kl_clip.has_value() ? nu.const_data_ptr<double>() : nullptr;
    multi_tensor_apply<WriteMeta, kWriteEntries>(metas, numels, [&](const WriteTable& table, int blocks) {
      apply_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(table, nu_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("kfac_factor_ema_", &cuda::kfac_factor_ema_cuda);
  m.impl("kfac_eigen_scale_", &cuda::kfac_eigen_scale_cuda);
  m.impl("kfac_precondition_apply_", &cuda::kfac_precondition_apply_cuda);
}

}  // namespace cafin
