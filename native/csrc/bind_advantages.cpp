// Python bindings of the native group_advantages (advantages.cu): one extension per source group, built on the first
// call of one of its ops. rl_kernel_core.advantages.native wraps each function in a torch.library
// custom op; the argument contracts are stated in ops.h.
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rl-kernel native CUDA kernels: group_advantages (advantages.cu)";
  m.def("group_advantages", &rlk::group_advantages, "group advantages [N] (fp64 math)", py::arg("rewards"),
        py::arg("group_size"), py::arg("group_index"), py::arg("estimator"), py::arg("norm_by_std"), py::arg("eps"));
}
