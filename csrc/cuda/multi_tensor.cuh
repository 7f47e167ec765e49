// Multi-tensor apply, shaped like aten's MultiTensorApply.cuh: the addresses of many tensors and a
// block -> (tensor, chunk) map travel by value as one kernel argument, so a whole bucket of
// parameters is updated in a few launches with no host-to-device copy (which keeps the launch
// capturable in a CUDA graph). Each optimizer supplies its own per-tensor Meta and kernel.
#pragma once

#include <cstdint>
#include <vector>

namespace cafin {
namespace cuda {

constexpr int64_t kChunkSize = 65536;
constexpr int kBlockSize = 512;
constexpr int kILP = 4;
constexpr int kMaxBlocks = 320;

// Kernel arguments are limited to 4 KB: with kMaxBlocks entries of 5 bytes, a table of 64-byte
// tensor entries holds about 30 tensors.
template <typename Meta, int kMaxTensors>
struct TensorTable {
  Meta meta[kMaxTensors];
  int64_t numel[kMaxTensors];
  unsigned char block_to_tensor[kMaxBlocks];
  int block_to_chunk[kMaxBlocks];
};

// Calls launch(table, blocks) once per full table, each block owning kChunkSize elements of one
// tensor. A tensor whose chunks do not fit continues in slot 0 of the next table.
template <typename Meta, int kMaxTensors, typename Launch>
void multi_tensor_apply(const std::vector<Meta>& metas, const std::vector<int64_t>& numels,
                        Launch&& launch) {
  static_assert(kMaxTensors <= 256, "block_to_tensor holds one byte");
  TensorTable<Meta, kMaxTensors> table;
  int slot = 0;
  int blocks = 0;
  for (size_t i = 0; i < metas.size(); ++i) {
    if (numels[i] == 0) continue;
    table.meta[slot] = metas[i];
    table.numel[slot] = numels[i];
    const int64_t chunks = (numels[i] + kChunkSize - 1) / kChunkSize;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      table.block_to_tensor[blocks] = static_cast<unsigned char>(slot);
      table.block_to_chunk[blocks] = static_cast<int>(chunk);
      ++blocks;
      const bool tensor_done = chunk == chunks - 1;
      if (blocks == kMaxBlocks || (tensor_done && slot == kMaxTensors - 1)) {
        launch(table, blocks);  // the table is copied into the launch: it may be reused now
        blocks = 0;
        if (tensor_done) {
          slot = -1;  // the next tensor starts a fresh table at slot 0
        } else {
          table.meta[0] = table.meta[slot];
          table.numel[0] = table.numel[slot];
          slot = 0;
        }
      }
    }
    ++slot;
  }
  if (blocks > 0) launch(table, blocks);
}

// ILP elements loaded or stored as one aligned access.
template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

template <int N, typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * N) == 0;
}

}  // namespace cuda
}  // namespace cafin
