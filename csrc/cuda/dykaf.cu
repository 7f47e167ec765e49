// CUDA kernels of the DyKAF ops (schemas in csrc/ops.cpp, semantics in
// cafin/reference/dykaf.py, per-element arithmetic in dykaf_math.h shared with the CPU kernels).
// beta2, step_size and lr are read through device pointers: no host sync, capturable launches.
// The rotations around these ops are GEMMs and stay in cuBLAS through torch.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "dykaf_checks.h"
#include "dykaf_math.h"

namespace cafin {
namespace cuda {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

// Sum over the block of one double per thread; thread 0 gets the result.
__device__ double block_sum(double v) {
  __shared__ double shared[kThreads];
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double out = shared[0];
  __syncthreads();
  return out;
}

// ---------------------------------------------------------------------------- rank-one moment
// scratch layout (double): [0] |l|, [1] |r|, [2] |l'|, [3] |r'|, [4] quad
template <typename T>
__global__ void norms_kernel(const T* l, int64_t m, const T* r, int64_t n, double* scratch) {
  double a = 0, b = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) a += double(l[i]) * double(l[i]);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) b += double(r[j]) * double(r[j]);
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    scratch[0] = sqrt(a);
    scratch[1] = sqrt(b);
  }
}

template <typename T>
__device__ T unit_at(const T* x, int64_t i, int64_t n, double norm, bool guard) {
  if (guard && !(norm > 0)) return T(rsqrt(double(n)));
  return x[i] / T(norm);
}

// rows[i] = sum_j gp_ij^2 * unit(r)_j, one block per row.
template <typename T>
__global__ void rows_kernel(const T* gp, int64_t m, int64_t n, const T* r, const double* r_norm,
                            const double* guard_value, T* rows) {
  const bool guard = *guard_value > 0;
  for (int64_t i = blockIdx.x; i < m; i += gridDim.x) {
    double acc = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const T g = gp[i * n + j];
      acc += double(g * g * unit_at(r, j, n, *r_norm, guard));
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) rows[i] = T(acc);
  }
}

// cols[j] = sum_i gp_ij^2 * unit(l)_i, one thread per column (coalesced along a row).
template <typename T>
__global__ void cols_kernel(const T* gp, int64_t m, int64_t n, const T* l, const double* l_norm,
                            const double* guard_value, T* cols) {
  const bool guard = *guard_value > 0;
  for (int64_t j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
    T acc = 0;
    for (int64_t i = 0; i < m; ++i) {
      const T g = gp[i * n + j];
      acc += g * g * unit_at(l, i, m, *l_norm, guard);
    }
    cols[j] = acc;
  }
}

// l_new, r_new (unnormalised) into dir_l, dir_r and their norms into scratch[2], scratch[3].
template <typename T>
__global__ void directions_kernel(const T* l, int64_t m, const T* r, int64_t n, const T* rows,
                                  const T* cols, const double* beta2, const double* guard_value, double* scratch,
                                  T* dir_l, T* dir_r) {
  const bool guard = *guard_value > 0;
  const T b = T(*beta2);
  const T np = T(scratch[0]) * T(scratch[1]);
  double a = 0, c = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const T x = dykaf_rank_one_direction(unit_at(l, i, m, scratch[0], guard), rows[i], b, np);
    dir_l[i] = x;
    a += double(x) * double(x);
  }
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const T x = dykaf_rank_one_direction(unit_at(r, j, n, scratch[1], guard), cols[j], b, np);
    dir_r[j] = x;
    c += double(x) * double(x);
  }
  a = block_sum(a);
  c = block_sum(c);
  if (threadIdx.x == 0) {
    scratch[2] = sqrt(a);
    scratch[3] = sqrt(c);
  }
}

// c = beta2 (l'.l^)(r'.r^)|l||r| + (1-beta2) l'^T gp^2 r', then l, r <- sqrt(c) l', sqrt(c) r'.
// rows2[i] = sum_j gp_ij^2 r'_j was computed by rows_kernel on dir_r.
template <typename T>
__global__ void finish_kernel(T* l, int64_t m, T* r, int64_t n, const T* dir_l, const T* dir_r,
                              const T* rows2, const double* beta2, const double* guard_value,
                              const double* scratch) {
  const bool guard = *guard_value > 0;
  const T b = T(*beta2);
  double ll = 0, rr = 0, quad = 0;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const T u = unit_at(dir_l, i, m, scratch[2], guard);
    ll += double(u * unit_at(l, i, m, scratch[0], guard));
    quad += double(u * rows2[i]);
  }
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    rr += double(unit_at(dir_r, j, n, scratch[3], guard) * unit_at(r, j, n, scratch[1], guard));
  }
  ll = block_sum(ll);
  rr = block_sum(rr);
  quad = block_sum(quad);
  const T c = b * T(ll) * T(rr) * T(scratch[0]) * T(scratch[1]) + (T(1) - b) * T(quad);
  const T root = sqrt(c);
  // Every thread has read l and r above (block_sum synchronises) before any writes them.
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) l[i] = unit_at(dir_l, i, m, scratch[2], guard) * root;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) r[j] = unit_at(dir_r, j, n, scratch[3], guard) * root;
}

void rank_one_cuda(at::TensorList ls, at::TensorList rs, at::TensorList gps, const at::Tensor& beta2,
                   const at::Tensor& guard) {
  check_dykaf_rank_one(ls, rs, gps, beta2, guard);
  if (gps.empty()) return;
  const c10::cuda::CUDAGuard device_guard(gps[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const double* g = guard.const_data_ptr<double>();
  for (size_t t = 0; t < gps.size(); ++t) {
    const at::Tensor& gp = gps[t];
    const int64_t m = gp.size(0), n = gp.size(1);
    auto scratch = at::zeros({5}, gp.options().dtype(at::kDouble));
    auto work = at::empty({3 * m + 2 * n}, gp.options());
    AT_DISPATCH_FLOATING_TYPES(gp.scalar_type(), "dykaf_rank_one_cuda", [&] {
      using T = scalar_t;
      T* l = ls[t].data_ptr<T>();
      T* r = rs[t].data_ptr<T>();
      const T* x = gp.data_ptr<T>();
      T* rows = work.data_ptr<T>();
      T* dir_l = rows + m;
      T* rows2 = dir_l + m;
      T* cols = rows2 + m;
      T* dir_r = cols + n;
      double* s = scratch.data_ptr<double>();
      const double* b = beta2.data_ptr<double>();
      norms_kernel<T><<<1, kThreads, 0, stream>>>(l, m, r, n, s);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      rows_kernel<T><<<static_cast<int>(m < 4096 ? m : 4096), kThreads, 0, stream>>>(x, m, n, r, s + 1, g, rows);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cols_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(x, m, n, l, s, g, cols);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      directions_kernel<T><<<1, kThreads, 0, stream>>>(l, m, r, n, rows, cols, b, g, s, dir_l, dir_r);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      rows_kernel<T><<<static_cast<int>(m < 4096 ? m : 4096), kThreads, 0, stream>>>(x, m, n, dir_r, s + 3, g, rows2);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      finish_kernel<T><<<1, kThreads, 0, stream>>>(l, m, r, n, dir_l, dir_r, rows2, b, g, s);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

// ---------------------------------------------------------------------------- rotated Adam
template <typename T>
__global__ void precondition_kernel(T* mp, const T* l, const T* r, int64_t m, int64_t n,
                                    const double* guard_value) {
  const T guard = T(*guard_value);
  const int64_t total = m * n;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    mp[k] = dykaf_rank_one_precondition(mp[k], l[k / n], r[k % n], guard);
  }
}

void precondition_cuda(at::TensorList mps, at::TensorList ls, at::TensorList rs, const at::Tensor& guard) {
  check_dykaf_precondition(mps, ls, rs, guard);
  if (mps.empty()) return;
  const c10::cuda::CUDAGuard device_guard(mps[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (size_t t = 0; t < mps.size(); ++t) {
    const int64_t m = mps[t].size(0), n = mps[t].size(1);
    if (m * n == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(mps[t].scalar_type(), "dykaf_precondition_cuda", [&] {
      precondition_kernel<scalar_t><<<blocks_for(m * n), kThreads, 0, stream>>>(
          mps[t].data_ptr<scalar_t>(), ls[t].data_ptr<scalar_t>(), rs[t].data_ptr<scalar_t>(), m, n,
          guard.const_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

template <typename T>
__global__ void adam_precondition_kernel(T* mp, T* v, const T* gp, int64_t total, const double* beta2,
                                         const double* eps_value) {
  const T b = T(*beta2), eps = T(*eps_value);
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    T vk = v[k];
    mp[k] = dykaf_adam_precondition(mp[k], vk, gp[k], b, eps);
    v[k] = vk;
  }
}

void adam_precondition_cuda(at::TensorList mps, at::TensorList vs, at::TensorList gps,
                            const at::Tensor& beta2, const at::Tensor& eps) {
  check_dykaf_adam_precondition(mps, vs, gps, beta2, eps);
  if (mps.empty()) return;
  const c10::cuda::CUDAGuard device_guard(mps[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (size_t t = 0; t < mps.size(); ++t) {
    const int64_t total = mps[t].numel();
    if (total == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(mps[t].scalar_type(), "dykaf_adam_precondition_cuda", [&] {
      adam_precondition_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
          mps[t].data_ptr<scalar_t>(), vs[t].data_ptr<scalar_t>(), gps[t].data_ptr<scalar_t>(), total,
          beta2.data_ptr<double>(), eps.const_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

// ---------------------------------------------------------------------------- parameter update
template <typename T>
__global__ void sumsq_kernel(const T* u, int64_t total, double* out) {
  double acc = 0;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    acc += double(u[k]) * double(u[k]);
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) atomicAdd(out, acc);
}

template <typename P, typename T>
__global__ void apply_kernel(P* theta, const T* u, int64_t total, const double* step_size,
                             const double* lr, const double* weight_decay, const double* sumsq) {
  const T scale = sumsq == nullptr ? T(1) : T(1) / (T(1e-30) + T(sqrt(*sumsq / double(total))));
  const T s = T(*step_size);
  const T decay = *weight_decay > 0 ? T(*lr * *weight_decay) : T(0);
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    theta[k] = static_cast<P>(dykaf_apply(static_cast<T>(theta[k]), u[k], scale, s, decay));
  }
}

void apply_cuda(at::TensorList params, at::TensorList updates, const at::Tensor& step_size,
                const at::Tensor& lr, const at::Tensor& weight_decay, bool normalize) {
  check_dykaf_apply(params, updates, step_size, lr, weight_decay, normalize);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard device_guard(params[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor sums;
  if (normalize) sums = at::zeros({static_cast<int64_t>(params.size())}, updates[0].options().dtype(at::kDouble));
  for (size_t t = 0; t < params.size(); ++t) {
    const int64_t total = params[t].numel();
    if (total == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(updates[t].scalar_type(), "dykaf_apply_cuda", [&] {
      using T = scalar_t;
      const T* u = updates[t].data_ptr<T>();
      double* sumsq = normalize ? sums.data_ptr<double>() + t : nullptr;
      if (normalize) {
        sumsq_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(u, total, sumsq);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params[t].scalar_type(), "dykaf_apply_p", [&] {
        apply_kernel<scalar_t, T><<<blocks_for(total), kThreads, 0, stream>>>(
            params[t].data_ptr<scalar_t>(), u, total, step_size.data_ptr<double>(), lr.data_ptr<double>(),
            weight_decay.const_data_ptr<double>(), sumsq);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
}

// ---------------------------------------------------------------------------- factor split
// One block per matrix of the stack: the per-matrix norms and inner products are block sums.
template <typename T>
__global__ void split_normalize_kernel(T* x, const T* f, const T* sigma, int64_t d2) {
  const int64_t b = blockIdx.x;
  T* xb = x + b * d2;
  const T* fb = f + b * d2;
  const T s = sigma[b];
  double sq = 0;
  for (int64_t k = threadIdx.x; k < d2; k += blockDim.x) {
    const T v = dykaf_split_sum(fb[k], xb[k], s);
    xb[k] = v;
    sq += double(v) * double(v);
  }
  const T norm = T(sqrt(block_sum(sq)));
  for (int64_t k = threadIdx.x; k < d2; k += blockDim.x) xb[k] = xb[k] / norm;
}

template <typename T>
__global__ void split_scale_kernel(T* u, T* v, const T* l, const T* r, const T* c, const T* sigma,
                                   int64_t m2, int64_t n2) {
  const int64_t b = blockIdx.x;
  T* ub = u + b * m2;
  T* vb = v + b * n2;
  double lu = 0, uc = 0, rv = 0;
  for (int64_t k = threadIdx.x; k < m2; k += blockDim.x) {
    lu += double(l[b * m2 + k]) * double(ub[k]);
    uc += double(ub[k]) * double(c[b * m2 + k]);
  }
  for (int64_t k = threadIdx.x; k < n2; k += blockDim.x) rv += double(r[b * n2 + k]) * double(vb[k]);
  lu = block_sum(lu);
  uc = block_sum(uc);
  rv = block_sum(rv);
  const T root = sqrt(dykaf_split_weight(T(lu), T(rv), T(uc), sigma[b]));
  for (int64_t k = threadIdx.x; k < m2; k += blockDim.x) ub[k] *= root;
  for (int64_t k = threadIdx.x; k < n2; k += blockDim.x) vb[k] *= root;
}

void split_normalize_cuda(at::TensorList K, at::TensorList M, at::TensorList L, at::TensorList R,
                          at::TensorList sigma) {
  check_dykaf_split("dykaf_split_normalize_", {{"K", K}, {"M", M}, {"L", L}, {"R", R}}, sigma);
  for (size_t i = 0; i < K.size(); ++i) {
    check_dykaf_same_shape(K[i], L[i], "K", "L", i);
    check_dykaf_same_shape(M[i], R[i], "M", "R", i);
  }
  if (K.empty()) return;
  const c10::cuda::CUDAGuard device_guard(K[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (size_t t = 0; t < K.size(); ++t) {
    const int blocks = static_cast<int>(K[t].size(0));
    if (blocks == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(K[t].scalar_type(), "dykaf_split_normalize_cuda", [&] {
      const scalar_t* s = sigma[t].data_ptr<scalar_t>();
      split_normalize_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
          K[t].data_ptr<scalar_t>(), L[t].data_ptr<scalar_t>(), s, K[t].size(1) * K[t].size(2));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      split_normalize_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
          M[t].data_ptr<scalar_t>(), R[t].data_ptr<scalar_t>(), s, M[t].size(1) * M[t].size(2));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

void split_scale_cuda(at::TensorList U, at::TensorList V, at::TensorList L, at::TensorList R,
                      at::TensorList C, at::TensorList sigma) {
  check_dykaf_split("dykaf_split_scale_", {{"U", U}, {"V", V}, {"L", L}, {"R", R}, {"C", C}}, sigma);
  for (size_t i = 0; i < U.size(); ++i) {
    check_dykaf_same_shape(U[i], L[i], "U", "L", i);
    check_dykaf_same_shape(U[i], C[i], "U", "C", i);
    check_dykaf_same_shape(V[i], R[i], "V", "R", i);
  }
  if (U.empty()) return;
  const c10::cuda::CUDAGuard device_guard(U[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (size_t t = 0; t < U.size(); ++t) {
    const int blocks = static_cast<int>(U[t].size(0));
    if (blocks == 0) continue;
    AT_DISPATCH_FLOATING_TYPES(U[t].scalar_type(), "dykaf_split_scale_cuda", [&] {
      split_scale_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
          U[t].data_ptr<scalar_t>(), V[t].data_ptr<scalar_t>(), L[t].data_ptr<scalar_t>(),
          R[t].data_ptr<scalar_t>(), C[t].data_ptr<scalar_t>(), sigma[t].data_ptr<scalar_t>(),
          U[t].size(1) * U[t].size(2), V[t].size(1) * V[t].size(2));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CUDA, m) {
  m.impl("dykaf_split_normalize_", &split_normalize_cuda);
  m.impl("dykaf_split_scale_", &split_scale_cuda);
  m.impl("dykaf_rank_one_", &rank_one_cuda);
  m.impl("dykaf_precondition_", &precondition_cuda);
  m.impl("dykaf_adam_precondition_", &adam_precondition_cuda);
  m.impl("dykaf_apply_", &apply_cuda);
}

}  // namespace cuda
}  // namespace cafin
