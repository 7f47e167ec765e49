// The CUDA constructs the statistics kernels use, emulated on the CPU, so that their code runs in
// CPU tests (tools/cuda_emulator/statistics.py): a block's threads run at once on a pool of OS
// threads, with real barriers for __syncthreads and a per-warp exchange for the shuffles; blocks
// run one after another, in order, reversed or shuffled. Per block it records a __syncthreads or
// shuffle count that differs between the threads (a barrier some thread skipped) and a shuffle
// with a partial mask. Shared memory is a function's statics, poisoned after every block. A
// barrier that waits longer than g_timeout_s prints where it hung and exits with status 77.
// Not emulated: blocks running at the same time (so a missing __threadfence cannot show) and
// the GPU's weaker memory ordering.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct emu_stream_t {};
using cudaStream_t = emu_stream_t*;

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace c10 { namespace cuda {
struct CUDAGuard { explicit CUDAGuard(const c10::Device&) {} };
inline cudaStream_t getCurrentCUDAStream() { return nullptr; }
}}  // namespace c10::cuda
#define C10_CUDA_KERNEL_LAUNCH_CHECK() do {} while (0)

namespace emu {

inline double g_timeout_s = 20.0;
inline thread_local int t_lane = -1, t_warp = -1, t_tid = -1;
inline const char* g_kernel = "";

[[noreturn]] inline void hang(const char* what) {
  std::fprintf(stderr, "\nEMU HANG in %s at %s: block (%u,%u) thread (%u,%u) lane %d warp %d\n", g_kernel, what,
               blockIdx.x, blockIdx.y, threadIdx.x, threadIdx.y, t_lane, t_warp);
  std::fflush(stderr);
  std::_Exit(77);
}

class Barrier {
  std::mutex m_;
  std::condition_variable cv_;
  int n_ = 0, count_ = 0;
  uint64_t gen_ = 0;
 public:
  void init(int n) { n_ = n; count_ = 0; }
  void wait(const char* what) {
    std::unique_lock<std::mutex> l(m_);
    const uint64_t g = gen_;
    if (++count_ == n_) { count_ = 0; ++gen_; cv_.notify_all(); return; }
    if (!cv_.wait_for(l, std::chrono::duration<double>(g_timeout_s), [&] { return gen_ != g; })) hang(what);
  }
};

struct Warp {
  Barrier bar;
  alignas(16) unsigned char buf[32][16];
  unsigned mask[32];
};

struct BlockCtx {
  Barrier block_bar;
  std::vector<Warp> warps{32};
  std::vector<int> syncs = std::vector<int>(1024);
  std::vector<int> shfls = std::vector<int>(1024);
};
inline BlockCtx g_block;

// __shared__ storage: function-level statics, poisoned after every block (so a block reading
// shared memory it did not write in this block sees garbage, not the previous block's values).
struct SharedRegion { void* p; size_t n; bool is_bool; };
inline std::mutex g_shared_m;
inline std::vector<SharedRegion> g_shared;
template <typename T>
void shared_register(T* p) {
  std::lock_guard<std::mutex> l(g_shared_m);
  for (auto& r : g_shared) if (r.p == p) return;
  g_shared.push_back({p, sizeof(T), std::is_same_v<std::remove_all_extents_t<T>, bool>});
}
inline uint64_t g_block_counter = 0;
inline void poison_shared() {
  ++g_block_counter;
  for (auto& r : g_shared) {
    if (r.is_bool) { bool v = g_block_counter & 1; for (size_t i = 0; i < r.n; ++i) static_cast<bool*>(r.p)[i] = v; }
    else std::memset(r.p, 0xFF, r.n);  // NaN for float/double
  }
}

class Pool {
  std::vector<std::thread> th_;
  std::mutex m_;
  std::condition_variable cv_, done_;
  uint64_t gen_ = 0;
  int active_ = 0, remaining_ = 0;
  std::function<void(int)> job_;
  void worker(int i) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> l(m_);
    for (;;) {
      cv_.wait(l, [&] { return gen_ != seen; });
      seen = gen_;
      if (i >= active_) continue;
      auto job = job_;
      l.unlock();
      job(i);
      l.lock();
      if (--remaining_ == 0) done_.notify_all();
    }
  }
 public:
  void run(int n, std::function<void(int)> f) {
    while (static_cast<int>(th_.size()) < n) {
      const int i = th_.size();
      th_.emplace_back([this, i] { worker(i); });
      th_.back().detach();
    }
    std::unique_lock<std::mutex> l(m_);
    job_ = std::move(f);
    active_ = n;
    remaining_ = n;
    ++gen_;
    cv_.notify_all();
    done_.wait(l, [&] { return remaining_ == 0; });
  }
};
inline Pool& pool() { static Pool* p = new Pool; return *p; }

// Block order: 0 in order, 1 reversed, 2 random permutation.
inline int g_order = 0;
inline uint64_t g_seed = 1;
struct LaunchRecord { std::string name; unsigned gx, gy, bx, by; };
inline std::vector<LaunchRecord> g_launches;
inline std::vector<std::string> g_errors;

template <typename F>
void launch(const char* name, dim3 grid, dim3 block, size_t /*shmem*/, cudaStream_t, F&& f) {
  g_kernel = name;
  const int nthreads = block.x * block.y * block.z;
  if (nthreads % 32 != 0 || nthreads > 1024) { std::fprintf(stderr, "bad block size\n"); std::abort(); }
  g_launches.push_back({name, grid.x, grid.y, block.x, block.y});
  const int64_t nblocks = int64_t(grid.x) * grid.y * grid.z;
  std::vector<int64_t> order(nblocks);
  std::iota(order.begin(), order.end(), 0);
  if (g_order == 1) std::reverse(order.begin(), order.end());
  if (g_order == 2) { std::mt19937_64 rng(g_seed++); std::shuffle(order.begin(), order.end(), rng); }
  for (int64_t b : order) {
    const dim3 bid(b % grid.x, (b / grid.x) % grid.y, b / (int64_t(grid.x) * grid.y));
    g_block.block_bar.init(nthreads);
    for (int w = 0; w < nthreads / 32; ++w) g_block.warps[w].bar.init(32);
    std::fill(g_block.syncs.begin(), g_block.syncs.end(), 0);
    std::fill(g_block.shfls.begin(), g_block.shfls.end(), 0);
    pool().run(nthreads, [&](int t) {
      threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      blockIdx = bid;
      blockDim = block;
      gridDim = grid;
      t_tid = t;
      t_lane = t % 32;
      t_warp = t / 32;
      f();
      t_tid = t_lane = t_warp = -1;
    });
    for (int t = 1; t < nthreads; ++t) {
      if (g_block.syncs[t] != g_block.syncs[0]) {
        g_errors.push_back(std::string(name) + ": __syncthreads count differs within block " + std::to_string(b));
        break;
      }
    }
    for (int t = 0; t < nthreads; ++t) {
      if (g_block.shfls[t] != g_block.shfls[t & ~31]) {
        g_errors.push_back(std::string(name) + ": shuffle count differs within a warp, block " + std::to_string(b));
        break;
      }
    }
    poison_shared();
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace emu

inline void __syncthreads() {
  ++emu::g_block.syncs[emu::t_tid];
  emu::g_block.block_bar.wait("__syncthreads");
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v, std::memory_order_seq_cst);
}
template <typename T>
inline T __ldcg(const T* p) { return *p; }

namespace emu {
template <typename T>
T shuffle(unsigned mask, T v, int src_of_lane, bool down, int delta, const char* what) {
  static_assert(sizeof(T) <= 16);
  if (mask != 0xffffffffu) g_errors.push_back(std::string(what) + " with partial mask");
  Warp& w = g_block.warps[t_warp];
  ++g_block.shfls[t_tid];
  std::memcpy(w.buf[t_lane], &v, sizeof(T));
  w.bar.wait(what);
  T r = v;
  int src = down ? t_lane + delta : src_of_lane;
  if (src >= 0 && src < 32) std::memcpy(&r, w.buf[src], sizeof(T));
  w.bar.wait(what);
  return r;
}
}  // namespace emu
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::shuffle(mask, v, 0, true, static_cast<int>(delta), "__shfl_down_sync");
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return emu::shuffle(mask, v, src % 32, false, 0, "__shfl_sync");
}
