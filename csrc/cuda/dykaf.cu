// CUDA kernels of the DyKAF ops (schemas in csrc/ops.cpp, semantics in
// cafin/reference/dykaf.py, per-element arithmetic in dykaf_math.h shared with the CPU kernels).
// beta2, step_size and lr are read through device pointers: no host sync, capturable launches.
// The rotations around these ops are GEMMs and stay in cuBLAS through torch.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "cuda/multi_tensor.cuh"
#include "dykaf_checks.h"
#include "dykaf_math.h"

namespace cafin {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Sum over the block (kThreads threads, one dimension) of one double per thread, in a fixed
// order; every thread gets the result.
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
// Six launches per call over every matrix of one dtype (up to kRankOneMatrices a launch): the
// matrix is blockIdx.y, and blockIdx.x strides its rows or column tiles (a block past a smaller
// matrix's share exits). Per matrix, the scalars (double): [0] |l|, [1] |r|, [2] |l'|, [3] |r'|;
// the work vectors (T): rows [m], dir_l [m], rows2 [m], cols [n], dir_r [n].
constexpr int kRankOneMatrices = 48;  // 64-byte entries: a table stays under 4 KB of arguments

struct RankOneMeta {
  void* l;
  void* r;
  const void* gp;
  int64_t m, n;
  double* s;
  void* work;
};

struct RankOneTable {
  RankOneMeta meta[kRankOneMatrices];
};

template <typename T>
struct RankOneView {
  T *l, *r;
  const T* gp;
  int64_t m, n;
  double* s;
  T *rows, *dir_l, *rows2, *cols, *dir_r;
};

template <typename T>
__device__ RankOneView<T> rank_one_view(const RankOneTable& table) {
  const RankOneMeta& meta = table.meta[blockIdx.y];
  RankOneView<T> v;
  v.l = static_cast<T*>(meta.l);
  v.r = static_cast<T*>(meta.r);
  v.gp = static_cast<const T*>(meta.gp);
  v.m = meta.m;
  v.n = meta.n;
  v.s = meta.s;
  v.rows = static_cast<T*>(meta.work);
  v.dir_l = v.rows + v.m;
  v.rows2 = v.dir_l + v.m;
  v.cols = v.rows2 + v.m;
  v.dir_r = v.cols + v.n;
  return v;
}

template <typename T>
__device__ T unit_at(const T* x, int64_t i, int64_t n, double norm, bool guard) {
  if (guard && !(norm > 0)) return T(rsqrt(double(n)));
  return x[i] / T(norm);
}

// |l| and |r|, one block per matrix.
template <typename T>
__global__ void norms_kernel(const RankOneTable table) {
  const RankOneView<T> v = rank_one_view<T>(table);
  double a = 0, b = 0;
  for (int64_t i = threadIdx.x; i < v.m; i += blockDim.x) a += double(v.l[i]) * double(v.l[i]);
  for (int64_t j = threadIdx.x; j < v.n; j += blockDim.x) b += double(v.r[j]) * double(v.r[j]);
  a = block_sum(a);
  b = block_sum(b);
  if (threadIdx.x == 0) {
    v.s[0] = sqrt(a);
    v.s[1] = sqrt(b);
  }
}

// rows[i] = sum_j gp_ij^2 * unit(x)_j (x: r, or dir_r for rows2), a block per row.
template <typename T, bool kSecond>
__global__ void rows_kernel(const RankOneTable table, const double* guard_value) {
  const RankOneView<T> v = rank_one_view<T>(table);
  const bool guard = *guard_value > 0;
  const T* x = kSecond ? v.dir_r : v.r;
  const double norm = kSecond ? v.s[3] : v.s[1];
  T* out = kSecond ? v.rows2 : v.rows;
  for (int64_t i = blockIdx.x; i < v.m; i += gridDim.x) {
    double acc = 0;
    for (int64_t j = threadIdx.x; j < v.n; j += blockDim.x) {
      const T g = v.gp[i * v.n + j];
      acc += double(g * g * unit_at(x, j, v.n, norm, guard));
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) out[i] = T(acc);
  }
}

// cols[j] = sum_i gp_ij^2 * unit(l)_i: a 32 x 8 block per 32 columns, thread (x, y) summing
// rows y, y + 8, ... of column x (coalesced along a row), then the 8 sums of a column added in
// order; so a tall matrix's long columns are shared out over 8 threads each, and every 32
// columns make a block (one thread per column made 2 blocks of a 512-wide matrix).
template <typename T>
__global__ void cols_kernel(const RankOneTable table, const double* guard_value) {
  const RankOneView<T> v = rank_one_view<T>(table);
  __shared__ T lanes[8][33];
  const bool guard = *guard_value > 0;
  for (int64_t first = int64_t(blockIdx.x) * 32; first < v.n; first += int64_t(gridDim.x) * 32) {
    const int64_t j = first + threadIdx.x;
    T acc = 0;
    if (j < v.n) {
      for (int64_t i = threadIdx.y; i < v.m; i += 8) {
        const T g = v.gp[i * v.n + j];
        acc += g * g * unit_at(v.l, i, v.m, v.s[0], guard);
      }
    }
    lanes[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < v.n) {
      T total = 0;
      for (int k = 0; k < 8; ++k) total += lanes[k][threadIdx.x];
      v.cols[j] = total;
    }
    __syncthreads();
  }
}

// l_new, r_new (unnormalised) into dir_l, dir_r and their norms into s[2], s[3]; a block per matrix.
template <typename T>
__global__ void directions_kernel(const RankOneTable table, const double* beta2, const double* guard_value) {
  const RankOneView<T> v = rank_one_view<T>(table);
  const bool guard = *guard_value > 0;
  const T b = T(*beta2);
  const T np = T(v.s[0]) * T(v.s[1]);
  double a = 0, c = 0;
  for (int64_t i = threadIdx.x; i < v.m; i += blockDim.x) {
    const T x = dykaf_rank_one_direction(unit_at(v.l, i, v.m, v.s[0], guard), v.rows[i], b, np);
    v.dir_l[i] = x;
    a += double(x) * double(x);
  }
  for (int64_t j = threadIdx.x; j < v.n; j += blockDim.x) {
    const T x = dykaf_rank_one_direction(unit_at(v.r, j, v.n, v.s[1], guard), v.cols[j], b, np);
    v.dir_r[j] = x;
    c += double(x) * double(x);
  }
  a = block_sum(a);
  c = block_sum(c);
  if (threadIdx.x == 0) {
    v.s[2] = sqrt(a);
    v.s[3] = sqrt(c);
  }
}

// c = beta2 (l'.l^)(r'.r^)|l||r| + (1-beta2) l'^T gp^2 r', then l, r <- sqrt(c) l', sqrt(c) r';
// rows2[i] = sum_j gp_ij^2 r'_j. A block per matrix.
template <typename T>
__global__ void finish_kernel(const RankOneTable table, const double* beta2, const double* guard_value) {
  const RankOneView<T> v = rank_one_view<T>(table);
  const bool guard = *guard_value > 0;
  const T b = T(*beta2);
  double ll = 0, rr = 0, quad = 0;
  for (int64_t i = threadIdx.x; i < v.m; i += blockDim.x) {
    const T u = unit_at(v.dir_l, i, v.m, v.s[2], guard);
    ll += double(u * unit_at(v.l, i, v.m, v.s[0], guard));
    quad += double(u * v.rows2[i]);
  }
  for (int64_t j = threadIdx.x; j < v.n; j += blockDim.x) {
    rr += double(unit_at(v.dir_r, j, v.n, v.s[3], guard) * unit_at(v.r, j, v.n, v.s[1], guard));
  }
  ll = block_sum(ll);
  rr = block_sum(rr);
  quad = block_sum(quad);
  const T c = b * T(ll) * T(rr) * T(v.s[0]) * T(v.s[1]) + (T(1) - b) * T(quad);
  const T root = sqrt(c);
  // Every thread has read l and r above (block_sum synchronises) before any writes them.
  for (int64_t i = threadIdx.x; i < v.m; i += blockDim.x) v.l[i] = unit_at(v.dir_l, i, v.m, v.s[2], guard) * root;
  for (int64_t j = threadIdx.x; j < v.n; j += blockDim.x) v.r[j] = unit_at(v.dir_r, j, v.n, v.s[3], guard) * root;
}

void rank_one_cuda(at::TensorList ls, at::TensorList rs, at::TensorList gps, const at::Tensor& beta2,
                   const at::Tensor& guard) {
  check_dykaf_rank_one(ls, rs, gps, beta2, guard);
  if (gps.empty()) return;
  const c10::cuda::CUDAGuard device_guard(gps[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  static_assert(sizeof(RankOneTable) <= 4000, "kernel arguments must stay under 4 KB");
  const double* g = guard.const_data_ptr<double>();
  const double* b = beta2.const_data_ptr<double>();
  // Every matrix's scalars in one scratch for the call (each written before it is read).
  const at::Tensor scalars = at::empty({4 * static_cast<int64_t>(gps.size())}, gps[0].options().dtype(at::kDouble));
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    std::vector<size_t> idx;
    int64_t work_size = 0;
    for (size_t t = 0; t < gps.size(); ++t) {
      if (gps[t].scalar_type() != dtype) continue;
      idx.push_back(t);
      work_size += 3 * gps[t].size(0) + 2 * gps[t].size(1);
    }
    if (idx.empty()) continue;
    const at::Tensor work = at::empty({work_size}, gps[idx[0]].options());
    AT_DISPATCH_FLOATING_TYPES(dtype, "dykaf_rank_one_cuda", [&] {
      using T = scalar_t;
      T* next = work.mutable_data_ptr<T>();
      for (size_t first = 0; first < idx.size(); first += kRankOneMatrices) {
        const size_t count = std::min<size_t>(kRankOneMatrices, idx.size() - first);
        RankOneTable table;
        int64_t max_m = 1, max_tiles = 1;
        for (size_t k = 0; k < count; ++k) {
          const size_t t = idx[first + k];
          const int64_t m = gps[t].size(0), n = gps[t].size(1);
          table.meta[k] = {ls[t].data_ptr(), rs[t].data_ptr(), gps[t].const_data_ptr(), m, n,
                           scalars.mutable_data_ptr<double>() + 4 * t, next};
          next += 3 * m + 2 * n;
          max_m = std::max(max_m, m);
          max_tiles = std::max(max_tiles, (n + 31) / 32);
        }
        const unsigned matrices = static_cast<unsigned>(count);
        const dim3 each(1, matrices);
        const dim3 rows_grid(static_cast<unsigned>(std::min<int64_t>(max_m, 4096)), matrices);
        const dim3 cols_grid(static_cast<unsigned>(std::min<int64_t>(max_tiles, 4096)), matrices);
        norms_kernel<T><<<each, kThreads, 0, stream>>>(table);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        rows_kernel<T, false><<<rows_grid, kThreads, 0, stream>>>(table, g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        cols_kernel<T><<<cols_grid, dim3(32, 8), 0, stream>>>(table, g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        directions_kernel<T><<<each, kThreads, 0, stream>>>(table, b, g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        rows_kernel<T, true><<<rows_grid, kThreads, 0, stream>>>(table, g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        finish_kernel<T><<<each, kThreads, 0, stream>>>(table, b, g);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  }
}

// ---------------------------------------------------------------------------- rotated Adam
// Multi-tensor launches (multi_tensor.cuh, as the update below): every matrix of one dtype in
// one kernel per table of kApplyTensors, each block one chunk of one tensor.
constexpr int kApplyTensors = 48;  // entries of at most 40 bytes: a table stays under 4 KB of arguments

struct PreconditionMeta {
  void* mp;
  const void* l;
  const void* r;
  int64_t n;  // columns
};

struct AdamMeta {
  void* mp;
  void* v;
  const void* gp;
};

template <typename T>
__global__ void precondition_kernel(const TensorTable<PreconditionMeta, kApplyTensors> table,
                                    const double* guard_value) {
  const PreconditionMeta& meta = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t lo = int64_t(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  const T guard = T(*guard_value);
  T* mp = static_cast<T*>(meta.mp);
  const T* l = static_cast<const T*>(meta.l);
  const T* r = static_cast<const T*>(meta.r);
  for (int64_t k = lo + threadIdx.x; k < hi; k += blockDim.x) {
    mp[k] = dykaf_rank_one_precondition(mp[k], l[k / meta.n], r[k % meta.n], guard);
  }
}

void precondition_cuda(at::TensorList mps, at::TensorList ls, at::TensorList rs, const at::Tensor& guard) {
  check_dykaf_precondition(mps, ls, rs, guard);
  if (mps.empty()) return;
  const c10::cuda::CUDAGuard device_guard(mps[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    std::vector<PreconditionMeta> metas;
    std::vector<int64_t> numels;
    for (size_t t = 0; t < mps.size(); ++t) {
      if (mps[t].scalar_type() != dtype || mps[t].numel() == 0) continue;
      metas.push_back({mps[t].data_ptr(), ls[t].const_data_ptr(), rs[t].const_data_ptr(), mps[t].size(1)});
      numels.push_back(mps[t].numel());
    }
    if (metas.empty()) continue;
    AT_DISPATCH_FLOATING_TYPES(dtype, "dykaf_precondition_cuda", [&] {
      multi_tensor_apply<PreconditionMeta, kApplyTensors>(
          metas, numels, [&](const TensorTable<PreconditionMeta, kApplyTensors>& table, int blocks) {
            precondition_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(table, guard.const_data_ptr<double>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
    });
  }
}

template <typename T>
__global__ void adam_precondition_kernel(const TensorTable<AdamMeta, kApplyTensors> table, const double* beta2,
                                         const double* eps_value) {
  const AdamMeta& meta = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t lo = int64_t(table.block_to_chunk[blockIdx.x]) * kChunkSize;
  const int64_t hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  const T b = T(*beta2), eps = T(*eps_value);
  T* mp = static_cast<T*>(meta.mp);
  T* v = static_cast<T*>(meta.v);
  const T* gp = static_cast<const T*>(meta.gp);
  for (int64_t k = lo + threadIdx.x; k < hi; k += blockDim.x) {
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
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    std::vector<AdamMeta> metas;
    std::vector<int64_t> numels;
    for (size_t t = 0; t < mps.size(); ++t) {
      if (mps[t].scalar_type() != dtype || mps[t].numel() == 0) continue;
      metas.push_back({mps[t].data_ptr(), vs[t].data_ptr(), gps[t].const_data_ptr()});
      numels.push_back(mps[t].numel());
    }
    if (metas.empty()) continue;
    AT_DISPATCH_FLOATING_TYPES(dtype, "dykaf_adam_precondition_cuda", [&] {
      multi_tensor_apply<AdamMeta, kApplyTensors>(
          metas, numels, [&](const TensorTable<AdamMeta, kApplyTensors>& table, int blocks) {
            adam_precondition_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
                table, beta2.const_data_ptr<double>(), eps.const_data_ptr<double>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
    });
  }
}

// ---------------------------------------------------------------------------- parameter update
// Multi-tensor launches (multi_tensor.cuh): every parameter of one (parameter, update) dtype
// pair in one kernel per table, each block one chunk of one tensor. With normalize, a first
// launch writes each chunk's sum of squares of u into `partial` (a tensor's chunks in a row);
// the update's blocks add their tensor's partials in one fixed order (deterministic, no atomics).

struct SumsqMeta {
  const void* u;
  double* partial;  // this tensor's first chunk's entry
};

struct ApplyMeta {
  void* theta;
  const void* u;
  const double* step_size;
  const double* partial;  // nullptr: not normalised
};

template <typename T>
__global__ void sumsq_chunks_kernel(const TensorTable<SumsqMeta, kApplyTensors> table) {
  const SumsqMeta& meta = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t chunk = table.block_to_chunk[blockIdx.x];
  const T* u = static_cast<const T*>(meta.u);
  const int64_t lo = chunk * kChunkSize, hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  double acc = 0;
  for (int64_t k = lo + threadIdx.x; k < hi; k += blockDim.x) acc += double(u[k]) * double(u[k]);
  acc = block_sum(acc);
  if (threadIdx.x == 0) meta.partial[chunk] = acc;
}

template <typename P, typename T>
__global__ void apply_kernel(const TensorTable<ApplyMeta, kApplyTensors> table, const double* lr,
                             const double* weight_decay) {
  const ApplyMeta& meta = table.meta[table.block_to_tensor[blockIdx.x]];
  const int64_t total = table.numel[table.block_to_tensor[blockIdx.x]];
  const int64_t chunk = table.block_to_chunk[blockIdx.x];
  T scale = T(1);
  if (meta.partial != nullptr) {
    const int64_t chunks = (total + kChunkSize - 1) / kChunkSize;
    double sq = 0;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) sq += meta.partial[c];
    sq = block_sum(sq);
    scale = T(1) / (T(1e-30) + T(sqrt(sq / double(total))));
  }
  const T s = T(*meta.step_size);
  const T decay = *weight_decay > 0 ? T(*lr * *weight_decay) : T(0);
  P* theta = static_cast<P*>(meta.theta);
  const T* u = static_cast<const T*>(meta.u);
  const int64_t lo = chunk * kChunkSize, hi = lo + kChunkSize < total ? lo + kChunkSize : total;
  for (int64_t k = lo + threadIdx.x; k < hi; k += blockDim.x) {
    theta[k] = static_cast<P>(dykaf_apply(static_cast<T>(theta[k]), u[k], scale, s, decay));
  }
}

void apply_cuda(at::TensorList params, at::TensorList updates, const at::Tensor& step_size,
                const at::Tensor& lr, const at::Tensor& weight_decay, bool normalize) {
  check_dykaf_apply(params, updates, step_size, lr, weight_decay, normalize);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard device_guard(params[0].device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  static_assert(sizeof(TensorTable<ApplyMeta, kApplyTensors>) + 2 * sizeof(void*) <= 4000,
                "kernel arguments must stay under 4 KB");
  // Each tensor's chunks' partial sums, in a row, in one scratch for the call.
  std::vector<int64_t> first_chunk(params.size(), 0);
  int64_t chunks = 0;
  for (size_t t = 0; t < params.size(); ++t) {
    first_chunk[t] = chunks;
    chunks += (params[t].numel() + kChunkSize - 1) / kChunkSize;
  }
  at::Tensor partial;
  if (normalize && chunks > 0) partial = at::empty({chunks}, updates[0].options().dtype(at::kDouble));
  const double* sizes = step_size.const_data_ptr<double>();
  const bool per_tensor = step_size.dim() == 1;
  // One group per (parameter dtype, update dtype), in the order of first appearance.
  std::vector<std::pair<at::ScalarType, at::ScalarType>> kinds;
  for (size_t t = 0; t < params.size(); ++t) {
    const auto kind = std::make_pair(params[t].scalar_type(), updates[t].scalar_type());
    if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(kind);
  }
  for (const auto& kind : kinds) {
    const at::ScalarType param_type = kind.first, update_type = kind.second;
    std::vector<ApplyMeta> metas;
    std::vector<SumsqMeta> sumsq_metas;
    std::vector<int64_t> numels;
    for (size_t t = 0; t < params.size(); ++t) {
      if (params[t].scalar_type() != param_type || updates[t].scalar_type() != update_type) continue;
      double* tensor_partial = normalize && chunks > 0 ? partial.mutable_data_ptr<double>() + first_chunk[t] : nullptr;
      metas.push_back({params[t].data_ptr(), updates[t].const_data_ptr(), sizes + (per_tensor ? t : 0),
                       tensor_partial});
      sumsq_metas.push_back({updates[t].const_data_ptr(), tensor_partial});
      numels.push_back(params[t].numel());
    }
    AT_DISPATCH_FLOATING_TYPES(update_type, "dykaf_apply_cuda", [&] {
      using T = scalar_t;
      if (normalize) {
        multi_tensor_apply<SumsqMeta, kApplyTensors>(
            sumsq_metas, numels, [&](const TensorTable<SumsqMeta, kApplyTensors>& table, int blocks) {
              sumsq_chunks_kernel<T><<<blocks, kThreads, 0, stream>>>(table);
              C10_CUDA_KERNEL_LAUNCH_CHECK();
            });
      }
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, param_type, "dykaf_apply_p", [&] {
        multi_tensor_apply<ApplyMeta, kApplyTensors>(
            metas, numels, [&](const TensorTable<ApplyMeta, kApplyTensors>& table, int blocks) {
              apply_kernel<scalar_t, T><<<blocks, kThreads, 0, stream>>>(table, lr.const_data_ptr<double>(),
                                                                        weight_decay.const_data_ptr<double>());
              C10_CUDA_KERNEL_LAUNCH_CHECK();
            });
      });
    });
  }
}

// ---------------------------------------------------------------------------- factor split
// A matrix of the stack is shared out over up to kSplitChunks blocks (blockIdx.x its chunk,
// blockIdx.y the matrix, strided past 65535), so one large factor (a tied embedding's 8192^2)
// fills the GPU instead of one SM. Each op is two launches: the first writes one partial sum per
// block, the second has every block of a matrix add that matrix's partials in the same fixed
// order (so they agree bit for bit, and from run to run) before it scales its own chunk. A
// matrix's partials sit `stride` apart per side (stride: the grid's chunk count, the larger
// side's).
constexpr int64_t kSplitChunks = 1024;
constexpr int64_t kSplitChunkMin = 8 * kThreads;  // elements a block takes at least

// The chunk count of a d2-element matrix and the elements per chunk.
struct Chunks {
  int64_t count, size;
};

__host__ __device__ inline Chunks chunks_of(int64_t d2) {
  int64_t count = (d2 + kSplitChunkMin - 1) / kSplitChunkMin;
  count = count < 1 ? 1 : (count > kSplitChunks ? kSplitChunks : count);
  return {count, (d2 + count - 1) / count};
}

unsigned matrix_blocks(int64_t batch) { return static_cast<unsigned>(batch < 65535 ? batch : 65535); }

// This block's share of a stack: its side (blockIdx.z: 0 the left matrix, of left2 elements,
// 1 the right, of right2), that side's chunk count, and the chunk's elements [lo, hi).
struct Span {
  bool left;
  int64_t d2, chunks, lo, hi;
};

// False for a block past its side's chunks (it has nothing to do).
__device__ bool block_span(int64_t left2, int64_t right2, Span& span) {
  span.left = blockIdx.z == 0;
  span.d2 = span.left ? left2 : right2;
  const Chunks c = chunks_of(span.d2);
  span.chunks = c.count;
  if (static_cast<int64_t>(blockIdx.x) >= c.count) return false;
  span.lo = blockIdx.x * c.size;
  span.hi = span.lo + c.size < span.d2 ? span.lo + c.size : span.d2;
  return true;
}

// The sum of parts[0], ..., parts[n - 1] in a fixed order, in every thread.
__device__ double sum_parts(const double* parts, int64_t n) {
  double acc = 0;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) acc += parts[k];
  return block_sum(acc);
}

// Side z (blockIdx.z: 0 is K with L, 1 is M with R): x = split_sum(f, x, sigma) over this block's
// chunk, and the chunk's sum of squares into partial[(b * 2 + z) * stride + chunk].
template <typename T>
__global__ void split_sum_kernel(T* k, const T* l, int64_t k2, T* m, const T* r, int64_t m2, const T* sigma,
                                 int64_t batch, int64_t stride, double* partial) {
  Span sp;
  if (!block_span(k2, m2, sp)) return;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    T* xb = (sp.left ? k : m) + b * sp.d2;
    const T* fb = (sp.left ? l : r) + b * sp.d2;
    const T s = sigma[b];
    double sq = 0;
    for (int64_t i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) {
      const T v = dykaf_split_sum(fb[i], xb[i], s);
      xb[i] = v;
      sq += double(v) * double(v);
    }
    sq = block_sum(sq);
    if (threadIdx.x == 0) partial[(b * 2 + blockIdx.z) * stride + blockIdx.x] = sq;
  }
}

// x /= |x| over this block's chunk, |x| from the matrix's partials.
template <typename T>
__global__ void split_divide_kernel(T* k, int64_t k2, T* m, int64_t m2, int64_t batch, int64_t stride,
                                    const double* partial) {
  Span sp;
  if (!block_span(k2, m2, sp)) return;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const T norm = T(sqrt(sum_parts(partial + (b * 2 + blockIdx.z) * stride, sp.chunks)));
    T* xb = (sp.left ? k : m) + b * sp.d2;
    for (int64_t i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) xb[i] = xb[i] / norm;
  }
}

// Side 0 sums <l, u> and <u, c> over its chunk of u, side 1 sums <r, v>: partial[(b * 3 + q) *
// stride + chunk] for q = 0 (<l, u>), 1 (<u, c>), 2 (<r, v>).
template <typename T>
__global__ void split_dots_kernel(const T* u, const T* l, const T* c, int64_t m2, const T* v, const T* r,
                                  int64_t n2, int64_t batch, int64_t stride, double* partial) {
  Span sp;
  if (!block_span(m2, n2, sp)) return;
  const int64_t lo = sp.lo, hi = sp.hi;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    double* out = partial + b * 3 * stride + blockIdx.x;
    if (sp.left) {
      const T* ub = u + b * m2;
      const T* lb = l + b * m2;
      const T* cb = c + b * m2;
      double lu = 0, uc = 0;
      for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        lu += double(lb[i]) * double(ub[i]);
        uc += double(ub[i]) * double(cb[i]);
      }
      lu = block_sum(lu);
      uc = block_sum(uc);
      if (threadIdx.x == 0) {
        out[0] = lu;
        out[stride] = uc;
      }
    } else {
      const T* vb = v + b * n2;
      const T* rb = r + b * n2;
      double rv = 0;
      for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) rv += double(rb[i]) * double(vb[i]);
      rv = block_sum(rv);
      if (threadIdx.x == 0) out[2 * stride] = rv;
    }
  }
}

// u and v times sqrt(split_weight(<l, u>, <r, v>, <u, c>, sigma)) over this block's chunk.
template <typename T>
__global__ void split_weigh_kernel(T* u, int64_t m2, T* v, int64_t n2, const T* sigma, int64_t batch,
                                   int64_t stride, const double* partial) {
  Span sp;
  if (!block_span(m2, n2, sp)) return;
  const int64_t left_chunks = chunks_of(m2).count, right_chunks = chunks_of(n2).count;
  for (int64_t b = blockIdx.y; b < batch; b += gridDim.y) {
    const double* parts = partial + b * 3 * stride;
    const double lu = sum_parts(parts, left_chunks);
    const double uc = sum_parts(parts + stride, left_chunks);
    const double rv = sum_parts(parts + 2 * stride, right_chunks);
    const T root = sqrt(dykaf_split_weight(T(lu), T(rv), T(uc), sigma[b]));
    T* xb = (sp.left ? u : v) + b * sp.d2;
    for (int64_t i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) xb[i] *= root;
  }
}

// The grid of a stack of `batch` matrix pairs with d2 and e2 elements.
dim3 split_grid(int64_t batch, int64_t d2, int64_t e2) {
  const int64_t chunks = std::max(chunks_of(d2).count, chunks_of(e2).count);
  return dim3(static_cast<unsigned>(chunks), matrix_blocks(batch), 2);
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
    const int64_t batch = K[t].size(0);
    if (batch == 0) continue;
    const int64_t k2 = K[t].size(1) * K[t].size(2), m2 = M[t].size(1) * M[t].size(2);
    const dim3 grid = split_grid(batch, k2, m2);
    const int64_t stride = grid.x;
    const at::Tensor partial = at::empty({batch * 2 * stride}, K[t].options().dtype(at::kDouble));
    AT_DISPATCH_FLOATING_TYPES(K[t].scalar_type(), "dykaf_split_normalize_cuda", [&] {
      split_sum_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          K[t].data_ptr<scalar_t>(), L[t].const_data_ptr<scalar_t>(), k2, M[t].data_ptr<scalar_t>(),
          R[t].const_data_ptr<scalar_t>(), m2, sigma[t].const_data_ptr<scalar_t>(), batch, stride,
          partial.mutable_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      split_divide_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          K[t].data_ptr<scalar_t>(), k2, M[t].data_ptr<scalar_t>(), m2, batch, stride,
          partial.const_data_ptr<double>());
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
    const int64_t batch = U[t].size(0);
    if (batch == 0) continue;
    const int64_t m2 = U[t].size(1) * U[t].size(2), n2 = V[t].size(1) * V[t].size(2);
    const dim3 grid = split_grid(batch, m2, n2);
    const int64_t stride = grid.x;
    const at::Tensor partial = at::empty({batch * 3 * stride}, U[t].options().dtype(at::kDouble));
    AT_DISPATCH_FLOATING_TYPES(U[t].scalar_type(), "dykaf_split_scale_cuda", [&] {
      split_dots_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          U[t].const_data_ptr<scalar_t>(), L[t].const_data_ptr<scalar_t>(), C[t].const_data_ptr<scalar_t>(), m2,
          V[t].const_data_ptr<scalar_t>(), R[t].const_data_ptr<scalar_t>(), n2, batch, stride,
          partial.mutable_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      split_weigh_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
          U[t].data_ptr<scalar_t>(), m2, V[t].data_ptr<scalar_t>(), n2, sigma[t].const_data_ptr<scalar_t>(),
          batch, stride, partial.const_data_ptr<double>());
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
