// Python bindings of the native linear_logprob's per-chunk pass (linear_logprob.cu) and of the sm_90a
// gemm-route passes the Triton backend uses on Hopper (linear_sm90.cu): one extension per source group, built on the first
// call of one of its ops. rl_kernel_core.linear.native wraps each function in a torch.library
// custom op; the argument contracts are stated in ops.h.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rl-kernel native CUDA kernels: linear_logprob's per-chunk pass (linear_logprob.cu), sm_90a gemm-route passes (linear_sm90.cu)";
  m.def("linear_chunk_stats", &rlk::linear_chunk_stats,
        "linear_logprob chunk pass: logprob, lse, entropy of an fp32 logits chunk into given [n] tensors",
        py::arg("logits"), py::arg("bias"), py::arg("targets"), py::arg("inv_temp"), py::arg("ignore_index"),
        py::arg("logprob"), py::arg("entropy"), py::arg("lse"));
  m.def("linear_chunk_grad", &rlk::linear_chunk_grad,
        "linear_logprob chunk pass: d raw logits into dl (may alias the fp32 chunk)", py::arg("logits"), py::arg("dl"),
        py::arg("bias"), py::arg("targets"), py::arg("lse"), py::arg("entropy"), py::arg("grad_logprob"),
        py::arg("grad_entropy"), py::arg("inv_temp"), py::arg("ignore_index"));
  m.def("linear_stats_sm90", &rlk::linear_stats_sm90,
        "linear_logprob gemm-route statistics pass on sm_90a, bitwise the Triton pass at its default tile",
        py::arg("hidden"), py::arg("weight"), py::arg("bias"), py::arg("targets"), py::arg("rows"), py::arg("inv_temp"),
        py::arg("ignore_index"), py::arg("partials"), py::arg("ztgt"), py::arg("want_entropy"), py::arg("keep"),
        py::arg("group_m"));
  m.def("linear_grad_sm90", &rlk::linear_grad_sm90,
        "linear_logprob gemm-route gradient pass on sm_90a, bitwise the Triton pass", py::arg("hidden"), py::arg("weight"),
        py::arg("bias"), py::arg("targets"), py::arg("rows"), py::arg("inv_temp"), py::arg("ignore_index"), py::arg("lse"),
        py::arg("entropy"), py::arg("grad_logprob"), py::arg("grad_entropy"), py::arg("dl"), py::arg("group_m"));
  m.def("linear_sm90_built", &rlk::linear_sm90_built, "whether this build holds the sm_90a passes");
}
