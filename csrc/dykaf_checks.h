// Argument checks of the DyKAF ops, shared by the CPU and CUDA entry points and mirrored by
// cafin/ops/dykaf.py: every kernel runs all of them before it writes anything.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "checks.h"

namespace cafin {

inline void check_dykaf_same_length(size_t n, size_t k, const char* name, const char* first) {
  TORCH_CHECK_VALUE(k == n, name, " has ", k, " entries but ", first, " has ", n);
}

inline void check_dykaf_work(const at::Tensor& t, const std::string& name, const at::Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, name,
                   " must be float32 or float64, got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " has dtype ",
                   dtype_name(t.scalar_type()), ", expected ", dtype_name(like.scalar_type()));
  TORCH_CHECK_VALUE(t.device() == like.device(), name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

// A 0-dim float64 tensor >= 0 (its value read where that costs no sync: on the CPU).
inline void check_dykaf_scalar(const at::Tensor& t, const char* name, const at::Device& device) {
  check_scalar_tensor(t, name, device, at::kDouble);
  if (device.is_cpu()) {
    const double v = t.item<double>();
    TORCH_CHECK_VALUE(v >= 0, name, " must be >= 0, got ", v);
  }
}

inline void check_dykaf_rank_one(at::TensorList ls, at::TensorList rs, at::TensorList gps,
                                 const at::Tensor& beta2, const at::Tensor& guard) {
  check_dykaf_same_length(ls.size(), rs.size(), "r", "l");
  check_dykaf_same_length(ls.size(), gps.size(), "gp", "l");
  if (!gps.empty()) check_dykaf_scalar(guard, "guard", gps[0].device());
  for (size_t i = 0; i < gps.size(); ++i) {
    const std::string k = "[" + std::to_string(i) + "]";
    TORCH_CHECK_VALUE(gps[i].dim() == 2, "gp", k, " must be 2-D, got shape ", gps[i].sizes());
    check_dykaf_work(gps[i], "gp" + k, gps[i]);
    check_dykaf_work(ls[i], "l" + k, gps[i]);
    check_dykaf_work(rs[i], "r" + k, gps[i]);
    TORCH_CHECK_VALUE(ls[i].numel() == gps[i].size(0), "l", k, " has ", ls[i].numel(),
                      " entries, expected ", gps[i].size(0));
    TORCH_CHECK_VALUE(rs[i].numel() == gps[i].size(1), "r", k, " has ", rs[i].numel(),
                      " entries, expected ", gps[i].size(1));
    check_scalar_tensor(beta2, "beta2", gps[i].device(), at::kDouble);
  }
}

inline void check_dykaf_precondition(at::TensorList mps, at::TensorList ls, at::TensorList rs,
                                     const at::Tensor& guard) {
  check_dykaf_same_length(mps.size(), ls.size(), "l", "mp");
  check_dykaf_same_length(mps.size(), rs.size(), "r", "mp");
  if (!mps.empty()) check_dykaf_scalar(guard, "guard", mps[0].device());
  for (size_t i = 0; i < mps.size(); ++i) {
    const std::string k = "[" + std::to_string(i) + "]";
    TORCH_CHECK_VALUE(mps[i].dim() == 2, "mp", k, " must be 2-D, got shape ", mps[i].sizes());
    check_dykaf_work(mps[i], "mp" + k, mps[i]);
    TORCH_CHECK_VALUE(mps[i].device() == mps[0].device(), "mp", k, " is on ", mps[i].device(),
                      " but mp[0] is on ", mps[0].device(), ": one call runs on one device");
    check_dykaf_work(ls[i], "l" + k, mps[i]);
    check_dykaf_work(rs[i], "r" + k, mps[i]);
    TORCH_CHECK_VALUE(ls[i].numel() == mps[i].size(0) && rs[i].numel() == mps[i].size(1), "l", k,
                      " and r", k, " must have ", mps[i].size(0), " and ", mps[i].size(1),
                      " entries, got ", ls[i].numel(), " and ", rs[i].numel());
  }
}

inline void check_dykaf_adam_precondition(at::TensorList mps, at::TensorList vs, at::TensorList gps,
                                          const at::Tensor& beta2, const at::Tensor& eps) {
  check_dykaf_same_length(mps.size(), vs.size(), "v", "mp");
  check_dykaf_same_length(mps.size(), gps.size(), "gp", "mp");
  if (!mps.empty()) check_dykaf_scalar(eps, "eps", mps[0].device());
  for (size_t i = 0; i < mps.size(); ++i) {
    const std::string k = "[" + std::to_string(i) + "]";
    check_dykaf_work(mps[i], "mp" + k, mps[i]);
    check_dykaf_work(vs[i], "v" + k, mps[i]);
    check_dykaf_work(gps[i], "gp" + k, mps[i]);
    TORCH_CHECK_VALUE(vs[i].sizes() == mps[i].sizes() && gps[i].sizes() == mps[i].sizes(), "v", k,
                      " and gp", k, " must have mp's shape ", mps[i].sizes());
    check_scalar_tensor(beta2, "beta2", mps[i].device(), at::kDouble);
  }
}

inline void check_dykaf_apply(at::TensorList params, at::TensorList updates, const at::Tensor& step_size,
                              const at::Tensor& lr, const at::Tensor& weight_decay, bool) {
  check_dykaf_same_length(params.size(), updates.size(), "updates", "params");
  if (!params.empty()) check_dykaf_scalar(weight_decay, "weight_decay", params[0].device());
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string k = "[" + std::to_string(i) + "]";
    TORCH_CHECK_TYPE(is_supported_float(params[i].scalar_type()), "params", k, " has dtype ",
                     dtype_name(params[i].scalar_type()));
    TORCH_CHECK_VALUE(params[i].is_contiguous(), "params", k, " must be contiguous");
    check_dykaf_work(updates[i], "updates" + k, updates[i]);
    TORCH_CHECK_TYPE(updates[i].scalar_type() == state_dtype(params[i].scalar_type()), "updates", k,
                     " has dtype ", dtype_name(updates[i].scalar_type()), ", expected ",
                     dtype_name(state_dtype(params[i].scalar_type())));
    TORCH_CHECK_VALUE(updates[i].numel() == params[i].numel() && updates[i].device() == params[i].device(),
                      "updates", k, " must have params", k, "'s size and device");
    check_scalar_tensor(lr, "lr", params[i].device(), at::kDouble);
  }
  if (step_size.dim() != 0 && !params.empty()) {
    TORCH_CHECK_VALUE(step_size.dim() == 1 && step_size.numel() == static_cast<int64_t>(params.size()) &&
                          step_size.is_contiguous(),
                      "step_size must be a 0-dim tensor or a contiguous vector of one per parameter (",
                      params.size(), "), got shape ", step_size.sizes());
    TORCH_CHECK_VALUE(step_size.device() == params[0].device(), "step_size is on ", step_size.device(),
                      ", expected ", params[0].device());
    TORCH_CHECK_TYPE(step_size.scalar_type() == at::kDouble, "step_size has dtype ",
                     dtype_name(step_size.scalar_type()), ", expected float64");
  } else if (!params.empty()) {
    check_scalar_tensor(step_size, "step_size", params[0].device(), at::kDouble);
  }
}

// A stack of square matrices [B, d, d] and its companions of the same shape, sigma [B].
inline void check_dykaf_split(const char* op, std::initializer_list<std::pair<const char*, at::TensorList>> lists,
                              at::TensorList sigma) {
  const auto& first = *lists.begin();
  for (const auto& [name, list] : lists) check_dykaf_same_length(first.second.size(), list.size(), name, first.first);
  check_dykaf_same_length(first.second.size(), sigma.size(), "sigma", first.first);
  for (size_t i = 0; i < sigma.size(); ++i) {
    const std::string k = "[" + std::to_string(i) + "]";
    const at::Tensor& x = first.second[i];
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(1) == x.size(2), op, ": ", first.first, k,
                      " must be a [B, d, d] stack, got shape ", x.sizes());
    TORCH_CHECK_VALUE(x.device() == first.second[0].device(), op, ": ", first.first, k, " is on ", x.device(),
                      " but ", first.first, "[0] is on ", first.second[0].device(), ": one call runs on one device");
    for (const auto& [name, list] : lists) {
      check_dykaf_work(list[i], std::string(name) + k, x);
      TORCH_CHECK_VALUE(list[i].dim() == 3 && list[i].size(0) == x.size(0) && list[i].size(1) == list[i].size(2),
                        op, ": ", name, k, " must be a [", x.size(0), ", d, d] stack, got shape ",
                        list[i].sizes());
    }
    check_dykaf_work(sigma[i], "sigma" + k, x);
    TORCH_CHECK_VALUE(sigma[i].numel() == x.size(0), "sigma", k, " has ", sigma[i].numel(),
                      " entries, expected ", x.size(0));
  }
}

inline void check_dykaf_same_shape(const at::Tensor& a, const at::Tensor& b, const char* na,
                                   const char* nb, size_t i) {
  TORCH_CHECK_VALUE(a.sizes() == b.sizes(), na, "[", i, "] has shape ", a.sizes(), " but ", nb, "[", i,
                    "] has shape ", b.sizes());
}

}  // namespace cafin
