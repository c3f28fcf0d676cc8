// Python bindings of the rl-kernel native extension. rl_kernel_core.native_ops wraps each function
// in a torch.library custom op (with a fake implementation and autograd); the argument contracts
// are stated in ops.h.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rl-kernel native CUDA kernels: logprob_from_logits, ratio_kl, policy_loss, group_advantages, linear_logprob chunk pass";
  m.def("logprob_fwd", &rlk::logprob_fwd, "logprob_from_logits forward: (logprob, entropy or [0], lse)",
        py::arg("logits"), py::arg("targets"), py::arg("temperature"), py::arg("ignore_index"),
        py::arg("with_entropy"));
  m.def("logprob_bwd", &rlk::logprob_bwd, "logprob_from_logits backward: d logits in the logits' dtype",
        py::arg("logits"), py::arg("targets"), py::arg("lse"), py::arg("entropy"), py::arg("grad_logprob"),
        py::arg("grad_entropy"), py::arg("temperature"), py::arg("ignore_index"));
  m.def("ratio_kl_fwd", &rlk::ratio_kl_fwd, "ratio_kl forward: (ratio, kl) fp32", py::arg("logprob"),
        py::arg("old_logprob"), py::arg("ref_logprob"), py::arg("kl_code"));
  m.def("ratio_kl_bwd", &rlk::ratio_kl_bwd, "ratio_kl backward: d logprob in logprob's dtype", py::arg("logprob"),
        py::arg("old_logprob"), py::arg("ref_logprob"), py::arg("grad_ratio"), py::arg("grad_kl"),
        py::arg("kl_code"), py::arg("kl_plus"));
  m.def("policy_loss_fwd", &rlk::policy_loss_fwd, "policy_loss forward: (loss, metrics[6], seq_weight, totals)",
        py::arg("logprob"), py::arg("old_logprob"), py::arg("advantages"), py::arg("mask"), py::arg("ref_logprob"),
        py::arg("entropy"), py::arg("rollout_is_weights"), py::arg("clip_ratio_low"), py::arg("clip_ratio_high"),
        py::arg("clip_ratio_c"), py::arg("kl_code"), py::arg("kl_coef"), py::arg("entropy_coef"), py::arg("agg"));
  m.def("policy_loss_bwd", &rlk::policy_loss_bwd, "policy_loss backward into preallocated gradients",
        py::arg("grad_loss"), py::arg("logprob"), py::arg("old_logprob"), py::arg("advantages"), py::arg("mask"),
        py::arg("ref_logprob"), py::arg("rollout_is_weights"), py::arg("seq_weight"), py::arg("totals"),
        py::arg("clip_ratio_low"), py::arg("clip_ratio_high"), py::arg("clip_ratio_c"), py::arg("kl_code"),
        py::arg("kl_plus"), py::arg("kl_coef"), py::arg("entropy_coef"), py::arg("agg"), py::arg("grad_logprob"),
        py::arg("grad_entropy"));
  m.def("linear_chunk_stats", &rlk::linear_chunk_stats,
        "linear_logprob chunk pass: logprob, lse, entropy of an fp32 logits chunk into given [n] tensors",
        py::arg("logits"), py::arg("bias"), py::arg("targets"), py::arg("inv_temp"), py::arg("ignore_index"),
        py::arg("logprob"), py::arg("entropy"), py::arg("lse"));
  m.def("linear_chunk_grad", &rlk::linear_chunk_grad,
        "linear_logprob chunk pass: d raw logits into dl (may alias the fp32 chunk)", py::arg("logits"), py::arg("dl"),
        py::arg("bias"), py::arg("targets"), py::arg("lse"), py::arg("entropy"), py::arg("grad_logprob"),
        py::arg("grad_entropy"), py::arg("inv_temp"), py::arg("ignore_index"));
  m.def("group_advantages", &rlk::group_advantages, "group advantages [N] (fp64 math)", py::arg("rewards"),
        py::arg("group_size"), py::arg("group_index"), py::arg("estimator"), py::arg("norm_by_std"), py::arg("eps"));
}
