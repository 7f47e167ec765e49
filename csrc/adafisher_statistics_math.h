// Index arithmetic of the curvature statistics, shared by the CPU and the CUDA kernels: how an input
// is viewed as [outer, channels, inner] through its strides (so no kernel needs a contiguous copy),
// how a layout whose dims do not merge is walked element by element, and which input rows and
// columns one Conv2d kernel tap reads over all output positions.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include <cstdint>

namespace cafin {

// ------------------------------------------------------------------------------------ strided views

// x as [outer, channels, inner] with one stride per part. `ok` is false when the dims of a part
// cannot be merged into one stride (then the CUDA kernels walk its dims, `DimWalk`, and the CPU
// kernels read a contiguous copy on a step that is due). Zero strides
// (expanded inputs) merge too: the element at a merged index is the same either way.
struct StridedView {
  int64_t outer = 1, channels = 1, inner = 1;
  int64_t outer_stride = 0, channel_stride = 0, inner_stride = 0;
  bool ok = true;
};

// Merges dims [first, last) of x into one (size, stride); false when they do not merge.
inline bool merge_dims(const at::Tensor& x, int64_t first, int64_t last, int64_t& size, int64_t& stride) {
  size = 1;
  stride = 0;
  bool ok = true;
  for (int64_t d = last - 1; d >= first; --d) {
    const int64_t n = x.size(d);
    if (n == 1) continue;  // a size-1 dim has any stride
    if (size == 1) {
      stride = x.stride(d);
    } else if (x.stride(d) != stride * size) {
      ok = false;
    }
    size *= n;
  }
  if (size == 1) stride = 1;
  return ok;
}

inline StridedView strided_view(const at::Tensor& x, int64_t start_dim, int64_t end_dim) {
  StridedView v;
  const bool a = merge_dims(x, 0, start_dim, v.outer, v.outer_stride);
  const bool b = merge_dims(x, start_dim, end_dim, v.channels, v.channel_stride);
  const bool c = merge_dims(x, end_dim, x.dim(), v.inner, v.inner_stride);
  v.ok = a && b && c;
  return v;
}

// ------------------------------------------------------------------------------------ dim walks

// Dims of x walked element by element through their strides, for a layout `strided_view` cannot
// merge: element `index` (row-major over the walked dims) sits at offset(index). Size-1 dims are
// dropped and adjacent dims that merge are merged, so `dims` is small for any real layout.
constexpr int kMaxWalkDims = 25;  // torch's own limit on the dims of a tensor its kernels index

struct DimWalk {
  int dims = 0;
  int64_t count = 1;  // elements walked
  int64_t size[kMaxWalkDims];
  int64_t stride[kMaxWalkDims];

  C10_HOST_DEVICE C10_ALWAYS_INLINE int64_t offset(int64_t index) const {
    int64_t off = 0;
    for (int d = dims - 1; d >= 0; --d) {
      const int64_t i = index % size[d];
      index /= size[d];
      off += i * stride[d];
    }
    return off;
  }
};

// Appends dims [first, last) of x to w (slowest first); false when w would need more than
// kMaxWalkDims dims.
inline bool walk_dims(DimWalk& w, const at::Tensor& x, int64_t first, int64_t last) {
  for (int64_t d = first; d < last; ++d) {
    const int64_t n = x.size(d);
    w.count *= n;
    if (n == 1) continue;
    if (w.dims > 0 && w.stride[w.dims - 1] == x.stride(d) * n) {  // d continues the previous dim
      w.size[w.dims - 1] *= n;
      w.stride[w.dims - 1] = x.stride(d);
      continue;
    }
    if (w.dims == kMaxWalkDims) return false;
    w.size[w.dims] = n;
    w.stride[w.dims] = x.stride(d);
    ++w.dims;
  }
  return true;
}

// ------------------------------------------------------------------------------------ conv2d taps

// The input rows (or columns) one kernel tap reads: for output positions o in [0, out), the tap
// lands on o * stride + offset; the in-range ones are first, first + stride, ..., last (count of
// them; empty when count == 0). offset = i * dilation - padding_before.
struct TapWindow {
  int64_t first, last, count;
};

C10_HOST_DEVICE C10_ALWAYS_INLINE TapWindow tap_window(int64_t out, int64_t stride, int64_t offset,
                                                      int64_t size) {
  const int64_t o_first = offset >= 0 ? 0 : (-offset + stride - 1) / stride;
  const int64_t top = size - 1 - offset;
  int64_t o_last = top < 0 ? -1 : top / stride;
  if (o_last > out - 1) o_last = out - 1;
  TapWindow w;
  w.count = o_last >= o_first ? o_last - o_first + 1 : 0;
  w.first = o_first * stride + offset;
  w.last = w.first + (w.count - 1) * stride;
  return w;
}

}  // namespace cafin
