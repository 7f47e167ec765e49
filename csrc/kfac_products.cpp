// kfac_eigen_products_: the eigenbasis products of many layers in one call, through ATen's GEMMs
// (MKL, cuBLAS), on any device. Its point is the CPU: there each layer's chain of products runs
// on one thread and the layers are shared out over the threads. MKL splits one product over the
// threads, which on the 100-500-wide products of a layer gains little from a second thread; two
// layers at once, one per thread, run each at the one-thread rate. A layer too large to share
// out keeps MKL's threads. Semantics: cafin/reference/kfac.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

namespace cafin {
namespace {

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

// [groups, a, b] of t (2-D: one group), checked.
void check_matrix(const at::Tensor& t, const char* name, int64_t i, int64_t dims, int64_t groups,
                  int64_t rows, int64_t cols, const at::Tensor& like) {
  TORCH_CHECK(t.dim() == dims, name, "[", i, "] has ", t.dim(), " dims, expected ", dims,
              " (as grads[", i, "])");
  TORCH_CHECK(t.device() == like.device(), name, "[", i, "] is on ", t.device(), ", expected ",
              like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, "[", i, "] has dtype ", t.scalar_type(),
              ", expected ", like.scalar_type());
  const int64_t o = dims - 2;
  TORCH_CHECK((dims == 2 || t.size(0) == groups) && t.size(o) == rows && t.size(o + 1) == cols, name,
              "[", i, "] has shape ", t.sizes(), ", expected ", dims == 3 ? "[groups, " : "[", rows, ", ",
              cols, "] with groups ", groups);
}

// The products of entry i, written as multiplications by an eigenbasis on the right (with Q_A;
// on one core MKL ran them 10-20 % faster so on bias-column widths, 129 and 513) or as they are
// (Q_A = I): the result in grad, work overwritten.
void entry_products(const at::Tensor& grad, const at::Tensor& work, const at::Tensor& source,
                    const std::optional<at::Tensor>& qa, const at::Tensor& qg, const at::Tensor& dgda) {
  // Below autograd on every thread (the guard is thread-local): operands may require grad.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const bool stacked = grad.dim() == 3;
  auto mm = [&](at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
    if (stacked) {
      at::bmm_out(out, a, b);
    } else {
      at::mm_out(out, a, b);
    }
  };
  if (!qa.has_value()) {
    mm(work, qg.mT(), source);
    work.mul_(dgda);
    mm(grad, qg, work);
    return;
  }
  const at::Tensor& q_a = *qa;
  mm(work, source.mT(), qg);      // X^T = G^T Q_G
  mm(grad, work.mT(), q_a);       // Y = X Q_A
  grad.mul_(dgda);
  mm(work, grad.mT(), qg.mT());   // Z^T = Y^T Q_G^T
  mm(grad, work.mT(), q_a.mT());  // V = Z Q_A^T
}

// The multiply-adds of entry i's products.
double entry_cost(const at::Tensor& grad, const at::Tensor& qg) {
  return static_cast<double>(grad.numel()) * static_cast<double>(qg.size(-1) + grad.size(-1));
}

// How the entries run on `threads` threads: `alone`, one after the other with every thread on
// each product, the entries too large to share out (each larger than its share of what is left:
// one thread would hold up the others); `bins`, the rest, one list per thread, largest first,
// each to the thread with the least work so far. Fixed by the shapes and the thread count.
struct Plan {
  std::vector<int64_t> alone;
  std::vector<std::vector<int64_t>> bins;
};

Plan share_out(const at::TensorList grads, const at::TensorList qg, int64_t threads) {
  const int64_t n = static_cast<int64_t>(grads.size());
  std::vector<double> cost(n);
  double left = 0.0;
  for (int64_t i = 0; i < n; ++i) left += cost[i] = entry_cost(grads[i], qg[i]);
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  Plan plan;
  size_t k = 0;
  for (; k < order.size() && cost[order[k]] * threads > left; ++k) {
    plan.alone.push_back(order[k]);
    left -= cost[order[k]];
  }
  plan.bins.resize(threads);
  std::vector<double> load(threads, 0.0);
  for (; k < order.size(); ++k) {
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    plan.bins[t].push_back(order[k]);
    load[t] += cost[order[k]];
  }
  return plan;
}

void kfac_eigen_products(at::TensorList grads, at::TensorList works, const OptionalTensors& sources,
                         const OptionalTensors& qa, at::TensorList qg, at::TensorList dgda) {
  const size_t n = grads.size();
  TORCH_CHECK(works.size() == n && sources.size() == n && qa.size() == n && qg.size() == n &&
                  dgda.size() == n,
              "works, sources, qa, qg and dgda must have as many entries as grads (", n, "), got ",
              works.size(), ", ", sources.size(), ", ", qa.size(), ", ", qg.size(), ", ", dgda.size());
  std::vector<at::Tensor> source(n);
  std::vector<std::optional<at::Tensor>> q_a(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& g = grads[k];
    TORCH_CHECK(g.dim() == 2 || g.dim() == 3, "grads[", i, "] must be [d_g, d_a] or [groups, d_g, d_a], got shape ",
                g.sizes());
    TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kDouble, "grads[", i,
                "] has dtype ", g.scalar_type(), ", expected float32 or float64");
    const int64_t dims = g.dim(), groups = dims == 3 ? g.size(0) : 1;
    const int64_t d_g = g.size(-2), d_a = g.size(-1);
    q_a[k] = qa.get(k);
    source[k] = sources.get(k).has_value() ? *sources.get(k) : g;
    check_matrix(source[k], "sources", i, dims, groups, d_g, d_a, g);
    check_matrix(qg[k], "qg", i, dims, groups, d_g, d_g, g);
    check_matrix(dgda[k], "dgda", i, dims, groups, d_g, d_a, g);
    if (q_a[k].has_value()) {
      check_matrix(*q_a[k], "qa", i, dims, groups, d_a, d_a, g);
      check_matrix(works[k], "works", i, dims, groups, d_a, d_g, g);
    } else {
      check_matrix(works[k], "works", i, dims, groups, d_g, d_a, g);
    }
    TORCH_CHECK(!works[k].is_same(g) && !source[k].is_same(works[k]), "works[", i,
                "] must be a tensor of its own (not grads[", i, "] or sources[", i, "])");
  }
  auto run = [&](int64_t k) { entry_products(grads[k], works[k], source[k], q_a[k], qg[k], dgda[k]); };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(n));
  if (n == 0 || grads[0].device().type() != at::kCPU || threads < 2) {
    for (size_t k = 0; k < n; ++k) run(static_cast<int64_t>(k));
    return;
  }
  const Plan plan = share_out(grads, qg, threads);
  for (const int64_t k : plan.alone) run(k);
  // Inside the parallel region MKL and ATen run single-threaded.
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (const int64_t k : plan.bins[t]) run(k);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(cafin, CPU, m) { m.impl("kfac_eigen_products_", &kfac_eigen_products); }
TORCH_LIBRARY_IMPL(cafin, CUDA, m) { m.impl("kfac_eigen_products_", &kfac_eigen_products); }

}  // namespace cafin
