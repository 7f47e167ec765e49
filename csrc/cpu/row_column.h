// The CPU skeleton of AdaFisher's update and SINGD's diagonal step: each parameter of a bucket is
// viewed as [rows, cols] and each of its elements is updated from its own values (theta, grad,
// optional per-element state) and a row factor R[r] times a column factor C[c], or from no
// factors. An `Op` supplies the types and the per-element maths (see AdaFisherElement in
// adafisher_update.cpp, SingdDiagElement in singd.cpp):
//
//   using scalar_t, opmath_t, state_t; struct Coeffs; static constexpr bool kState;
//   static void plain(opmath_t& theta, opmath_t& state, opmath_t g, const Coeffs&);
//   template <bool kGuarded> static void factored(opmath_t& theta, opmath_t& state, opmath_t g,
//                                                 opmath_t r, opmath_t c, const Coeffs&);
//
// The update is memory-bound, so the work is one flat range over every element of every tensor,
// split evenly between threads (a bucket mixes tensors of a few elements with tensors of
// millions), and walked in runs along a row, where R[r] is constant and C is contiguous. Each run
// is a branch-free loop the compiler vectorises: tests/test_vectorised.py compiles this header
// and checks the report.
#pragma once

#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/vectorize.h"

namespace cafin {

// How a tensor's factors enter its elements.
enum class RowColumnFactors : int {
  kNone,     // no factors (or factors that mean none): Op::plain
  kFactors,  // Op::factored<false>(R[r], C[c])
  kGuarded,  // Op::factored<true>: the factors hold entries the element itself must test
};

template <typename Op>
struct RowColumnTensor {
  typename Op::scalar_t* theta;
  const typename Op::scalar_t* grad;
  typename Op::state_t* state;       // nullptr when Op::kState is false
  const typename Op::opmath_t* row;  // R: one entry per row
  const typename Op::opmath_t* col;  // C: one entry per column, from the tensor's own offset on
  int64_t numel;
  int64_t cols;
  RowColumnFactors factors;
  typename Op::Coeffs coeffs;
};

// n elements. kRowsAlong: one element per row (cols == 1), so R runs along the elements (`along`)
// and C is the constant `fixed`; otherwise R is `fixed` and C runs along. The select between the
// two happens at compile time: the loop body has no branch.
template <typename Op, RowColumnFactors kFactors, bool kRowsAlong>
C10_ALWAYS_INLINE void row_column_run(typename Op::scalar_t* __restrict theta,
                                      const typename Op::scalar_t* __restrict grad,
                                      typename Op::state_t* __restrict state,
                                      const typename Op::opmath_t* __restrict along,
                                      typename Op::opmath_t fixed, int64_t n,
                                      const typename Op::Coeffs coeffs) {
  using scalar_t = typename Op::scalar_t;
  using opmath_t = typename Op::opmath_t;
  using state_t = typename Op::state_t;
  for (int64_t k = 0; k < n; ++k) {
    opmath_t th = static_cast<opmath_t>(theta[k]);
    opmath_t st = Op::kState ? static_cast<opmath_t>(state[k]) : opmath_t(0);
    const opmath_t g = static_cast<opmath_t>(grad[k]);
    if constexpr (kFactors == RowColumnFactors::kNone) {
      Op::plain(th, st, g, coeffs);
    } else {
      const opmath_t r = kRowsAlong ? along[k] : fixed;
      const opmath_t c = kRowsAlong ? fixed : along[k];
      Op::template factored<kFactors == RowColumnFactors::kGuarded>(th, st, g, r, c, coeffs);
    }
    theta[k] = static_cast<scalar_t>(th);
    if (Op::kState) state[k] = static_cast<state_t>(st);
  }
}

// Elements [lo, hi) of one tensor, in runs along its rows. Explicit calls, not a helper lambda:
// a lambda would not be inlined into the ISA clones below.
template <typename Op, RowColumnFactors kFactors>
C10_ALWAYS_INLINE void row_column_part(const RowColumnTensor<Op>& t, int64_t lo, int64_t hi) {
  using opmath_t = typename Op::opmath_t;
  typename Op::state_t* state = Op::kState ? t.state + lo : nullptr;
  if constexpr (kFactors == RowColumnFactors::kNone) {
    row_column_run<Op, kFactors, false>(t.theta + lo, t.grad + lo, state, nullptr, opmath_t(1), hi - lo,
                                        t.coeffs);
  } else if (t.cols == 1) {
    row_column_run<Op, kFactors, true>(t.theta + lo, t.grad + lo, state, t.row + lo, t.col[0], hi - lo,
                                       t.coeffs);
  } else {
    int64_t row = lo / t.cols;
    int64_t col = lo - row * t.cols;
    for (int64_t k = lo; k < hi; ++row, col = 0) {
      const int64_t n = std::min(hi - k, t.cols - col);
      row_column_run<Op, kFactors, false>(t.theta + k, t.grad + k, Op::kState ? t.state + k : nullptr,
                                          t.col + col, t.row[row], n, t.coeffs);
      k += n;
    }
  }
}

template <typename Op>
CAFIN_CPU_CLONES void row_column_range(const RowColumnTensor<Op>& t, int64_t lo, int64_t hi) {
  switch (t.factors) {
    case RowColumnFactors::kNone:
      row_column_part<Op, RowColumnFactors::kNone>(t, lo, hi);
      break;
    case RowColumnFactors::kFactors:
      row_column_part<Op, RowColumnFactors::kFactors>(t, lo, hi);
      break;
    case RowColumnFactors::kGuarded:
      row_column_part<Op, RowColumnFactors::kGuarded>(t, lo, hi);
      break;
  }
}

// Every element of every tensor, threads over the one flat range.
template <typename Op>
void row_column_apply(const std::vector<RowColumnTensor<Op>>& tensors) {
  std::vector<int64_t> starts(1, 0);  // tensor i owns flat elements [starts[i], starts[i + 1])
  starts.reserve(tensors.size() + 1);
  for (const auto& t : tensors) starts.push_back(starts.back() + t.numel);
  at::parallel_for(0, starts.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; begin < end; ++i) {
      const int64_t stop = std::min(end, starts[i + 1]);
      if (stop > begin) row_column_range(tensors[i], begin - starts[i], stop - starts[i]);
      begin = stop;
    }
  });
}

}  // namespace cafin
