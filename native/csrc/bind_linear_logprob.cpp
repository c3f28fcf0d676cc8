// Python bindings of the native linear_logprob's per-chunk pass (linear_logprob.cu): one extension per source group, built on the first
// call of one of its ops. rl_kernel_core.native.linear_logprob wraps each function in a torch.library
// custom op; the argument contracts are stated in ops.h.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rl-kernel native CUDA kernels: linear_logprob's per-chunk pass (linear_logprob.cu)";
  m.def("linear_chunk_stats", &rlk::linear_chunk_stats,
        "linear_logprob chunk pass: logprob, lse, entropy of an fp32 logits chunk into given [n] tensors",
        py::arg("logits"), py::arg("bias"), py::arg("targets"), py::arg("inv_temp"), py::arg("ignore_index"),
        py::arg("logprob"), py::arg("entropy"), py::arg("lse"));
  m.def("linear_chunk_grad", &rlk::linear_chunk_grad,
        "linear_logprob chunk pass: d raw logits into dl (may alias the fp32 chunk)", py::arg("logits"), py::arg("dl"),
        py::arg("bias"), py::arg("targets"), py::arg("lse"), py::arg("entropy"), py::arg("grad_logprob"),
        py::arg("grad_entropy"), py::arg("inv_temp"), py::arg("ignore_index"));
}
