// Python bindings of the native ratio_kl and policy_loss (loss.cu): one extension per source group, built on the first
// call of one of its ops. rl_kernel_core.loss.native wraps each function in a torch.library
// custom op; the argument contracts are stated in ops.h.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rl-kernel native CUDA kernels: ratio_kl and policy_loss (loss.cu)";
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
}
