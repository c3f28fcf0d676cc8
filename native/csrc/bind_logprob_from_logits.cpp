// Python bindings of the native logprob_from_logits (logprob_from_logits.cu): one extension per source group, built on the first
// call of one of its ops. rl_kernel_core.logprob.native wraps each function in a torch.library
// custom op; the argument contracts are stated in ops.h.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rl-kernel native CUDA kernels: logprob_from_logits (logprob_from_logits.cu)";
  m.def("logprob_fwd", &rlk::logprob_fwd, "logprob_from_logits forward: (logprob, entropy or [0], lse)",
        py::arg("logits"), py::arg("targets"), py::arg("temperature"), py::arg("ignore_index"),
        py::arg("with_entropy"));
  m.def("logprob_bwd", &rlk::logprob_bwd, "logprob_from_logits backward: d logits in the logits' dtype",
        py::arg("logits"), py::arg("targets"), py::arg("lse"), py::arg("entropy"), py::arg("grad_logprob"),
        py::arg("grad_entropy"), py::arg("temperature"), py::arg("ignore_index"));
}
