// The op contract of cafin: every schema in one place, plus the Autograd-key kernel that makes the
// ops non-differentiable by declaration. Kernels live in cpu/ and cuda/; semantics are defined by
// cafin/reference/, the plain-PyTorch version of each op.
#include <Python.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

extern "C" {
// Importing cafin._C runs the static initialisers below, which register the ops.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(cafin, m) {
  // One AdaFisher/AdaFisherW update for a bucket of same-device, same-dtype parameters.
  // F = S[r] * H[h_offsets[i] + c] + damping for parameter i viewed as [S.numel(), -1];
  // an empty S/H, or a factor still holding its initial -1, means F = 1.
  // The hyperparameters are 0-dim tensors read on the device (lr of the op-math dtype; beta,
  // weight_decay, damping float64): a float that a schedule changes would be a new constant,
  // and a recompile, every step.
  m.def(
      "adafisher_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor[] steps, "
      "Tensor[] fisher_S, Tensor[] fisher_H, int[] h_offsets, Tensor lr, Tensor beta, "
      "Tensor weight_decay, Tensor damping, bool decoupled, Tensor? grad_scale=None, "
      "Tensor? found_inf=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  // Raw statistics accumulate into `stat`, whose last element counts the contributions.
  // With `step` given they run only when step % interval == 0 (the decision made on the device).
  // `workspace`: the CUDA kernels' scratch, kept by the caller so that a call allocates nothing
  // (csrc/checks.h: check_workspace); a channel statistic then launches once. Without it a CUDA
  // call allocates its own. The CPU kernels need none and only check it.
  m.def(
      "sumsq_stats_(Tensor(a!) stat, Tensor x, int start_dim, int end_dim, bool append_one, "
      "Tensor? step=None, int interval=1, Tensor(b!)? workspace=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "conv2d_input_stats_(Tensor(a!) stat, Tensor x, int[2] kernel_size, int[2] stride, "
      "int[4] padding, int[2] dilation, int groups, bool append_one, Tensor? step=None, "
      "int interval=1, Tensor(b!)? workspace=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "norm_input_stats_(Tensor(a!) stat, Tensor x, Tensor? step=None, int interval=1, "
      "Tensor(b!)? workspace=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "norm_grad_stats_(Tensor(a!) stat, Tensor g, int start_dim, int end_dim, Tensor? step=None, "
      "int interval=1, Tensor(b!)? workspace=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  // Normalise the accumulated statistics and fold them into the factors; empties the statistics.
  // gamma is a 0-dim float64 tensor (the coefficients 0.1 gamma and 0.01 gamma are formed in
  // float64, as published).
  m.def(
      "fisher_average_(Tensor(a!)[] factors, Tensor(b!)[] stats, Tensor(c!) skipped, Tensor gamma, "
      "bool[] grad_side, Tensor? grad_scale=None, Tensor? found_inf=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  // SINGD step of a bucket of parameters whose layers have diagonal K and C: the natural gradient
  // C^2 G K^2 (K read from k_offsets[i] on, one entry per column of the parameter viewed as
  // [C.numel(), -1]; K and C both empty: no factors, g itself), weight decay, momentum (none when
  // momentum_buffers is empty), update.
  // lr, momentum, weight_decay and grad_scale (the gradients' divisor; None: unscaled) are 0-dim
  // tensors of the op-math dtype read on the device: schedules of any of them do not recompile,
  // and a GradScaler's scale needs no host sync.
  m.def(
      "singd_diag_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor[] K, Tensor[] C, int[] k_offsets, Tensor lr, Tensor momentum, Tensor weight_decay, "
      "Tensor? grad_scale=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  // SINGD preconditioner update, elementwise over the parts of structured factors (one list entry
  // per part; the GEMMs around it stay in torch). Where go[i]: m <- scale*(c_h*H + c_damp*pi*KtK
  // - I) + alpha1*m (m not read when alpha1 == 0), H <- 0; elsewhere nothing is written.
  // c_h, c_damp, scale and alpha1 are 0-dim tensors of the op-math dtype; pi (1 or 2) is the
  // projection's fold on the part, fixed by the structure.
  // eye: 0 no identity entry, 1 the diagonal of each [rows, cols] matrix, 2 every entry, 3 entry 0.
  m.def(
      "singd_momentum_(Tensor(a!)[] m, Tensor(b!)[] H, Tensor[] KtK, Tensor[] c_h, Tensor[] c_damp, "
      "Tensor[] go, int[] eye, int[] pi, Tensor[] scale, Tensor[] alpha1) -> ()",
      {at::Tag::pt2_compliant_tag});
  // Where go[i]: K <- K - beta*KM (KM = K m from a GEMM), or K <- K - beta*K*KM where elementwise.
  m.def(
      "singd_factor_step_(Tensor(a!)[] K, Tensor[] KM, Tensor[] beta, Tensor[] go, "
      "bool[] elementwise) -> ()",
      {at::Tag::pt2_compliant_tag});
  // K-FAC (semantics: cafin/reference/kfac.py). Fold summed covariances into [groups, d, d]
  // factors: F <- decay*F + (1-decay)*sym(S)/count when count > 0, S is finite (and step %
  // interval == 0 when step is given); S and count are emptied either way. `dropped` (a 0-dim
  // float32) counts the statistics a due fold dropped for inf/NaN.
  m.def(
      "kfac_factor_ema_(Tensor(a!)[] factors, Tensor(b!)[] stats, Tensor(c!)[] counts, Tensor decay, "
      "Tensor? step=None, int interval=1, Tensor(d!)? dropped=None) -> ()",
      {at::Tag::pt2_compliant_tag});
  // v <- v / (dg da^T + damping), per group.
  m.def("kfac_eigen_scale_(Tensor(a!)[] v, Tensor[] dg, Tensor[] da, Tensor damping) -> ()",
        {at::Tag::pt2_compliant_tag});
  // Gradients <- nu * (precond + shift[i]) (weight columns, then the bias column), nu the
  // KL-clip factor from lr^2 sum <precond + shift, grad> (1 without kl_clip); abs_terms sums
  // each tensor's term's absolute value instead (two-level K-FAC's clip).
  m.def(
      "kfac_precondition_apply_(Tensor(a!)[] weight_grads, Tensor(b!)[] bias_grads, Tensor[] precond, "
      "Tensor lr, Tensor? kl_clip=None, Tensor? shift=None, bool abs_terms=False) -> ()",
      {at::Tag::pt2_compliant_tag});
  // The eigenbasis products of many layers: grads[i] <- Q_G ((Q_G^T S Q_A) * dgda) Q_A^T, S
  // sources[i] (None: grads[i]), Q_A = I where qa[i] is None; works[i] is scratch. On the CPU
  // the layers are shared out over the threads, each layer's products on one.
  m.def(
      "kfac_eigen_products_(Tensor(a!)[] grads, Tensor(b!)[] works, Tensor?[] sources, Tensor?[] qa, "
      "Tensor[] qg, Tensor[] dgda) -> ()",
      {at::Tag::pt2_compliant_tag});
  // DyKAF (semantics: cafin/reference/dykaf.py). Every scalar is a 0-dim float64 tensor.
  // The rank-one second moment l r^T of each rotated gradient gp (one projector-splitting step
  // towards beta2 V + (1 - beta2) gp^2).
  m.def(
      "dykaf_rank_one_(Tensor(a!)[] l, Tensor(b!)[] r, Tensor[] gp, Tensor beta2, Tensor guard) -> ()",
      {at::Tag::pt2_compliant_tag});
  // mp <- mp / (sqrt(l r^T) + guard), the denominator formed per element.
  m.def("dykaf_precondition_(Tensor(a!)[] mp, Tensor[] l, Tensor[] r, Tensor guard) -> ()",
        {at::Tag::pt2_compliant_tag});
  // v <- beta2 v + (1 - beta2) gp^2, mp <- mp / (sqrt(v) + eps).
  m.def(
      "dykaf_adam_precondition_(Tensor(a!)[] mp, Tensor(b!)[] v, Tensor[] gp, Tensor beta2, "
      "Tensor eps) -> ()",
      {at::Tag::pt2_compliant_tag});
  // theta <- theta - step_size * u (RMS-normalised when normalize), then theta <- theta - lr*wd*theta;
  // step_size is one for all (0-dim) or one per tensor ([len(params)]).
  m.def(
      "dykaf_apply_(Tensor(a!)[] params, Tensor[] updates, Tensor step_size, Tensor lr, "
      "Tensor weight_decay, bool normalize) -> ()",
      {at::Tag::pt2_compliant_tag});
  // The factor split around its GEMMs, per matrix of [B, d, d] stacks (sigma [B]):
  // K <- unit(sigma L + K), M <- unit(sigma R + M); then S = sigma <L,U><R,V> + <U,C>,
  // U, V <- sqrt(S) U, sqrt(S) V.
  m.def(
      "dykaf_split_normalize_(Tensor(a!)[] K, Tensor(b!)[] M, Tensor[] L, Tensor[] R, "
      "Tensor[] sigma) -> ()",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "dykaf_split_scale_(Tensor(a!)[] U, Tensor(b!)[] V, Tensor[] L, Tensor[] R, Tensor[] C, "
      "Tensor[] sigma) -> ()",
      {at::Tag::pt2_compliant_tag});
}

namespace {

// Non-differentiable by declaration: run the kernel below autograd, so a call on tensors that
// require grad never builds a graph, then bump the version counters of what the op wrote, as
// aten's in-place ops do, so autograd still notices a saved tensor that a step modified.
void below_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const auto inputs = torch::jit::last(*stack, arguments.size());
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    if (inputs[i].isTensor()) {
      written.push_back(inputs[i].toTensor());
    } else if (inputs[i].isTensorList()) {
      for (const at::Tensor& t : inputs[i].toTensorList()) written.push_back(t);
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(stack);
  }
  for (const auto& t : written) {
    if (t.defined() && !t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

}  // namespace

// Every op TORCH_LIBRARY above defines (it runs first: same translation unit, earlier), so the
// m.def list is the one list of ops.
TORCH_LIBRARY_IMPL(cafin, Autograd, m) {
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNames()) {
    const auto ns = op.getNamespace();
    if (!ns.has_value() || *ns != "cafin") continue;
    m.impl(op.name.c_str(), torch::CppFunction::makeFromBoxedFunction<&below_autograd>());
  }
}
