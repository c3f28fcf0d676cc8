"""The Triton backend: one module per op family, each holding its kernels, launchers and custom-op
registration (:attr:`rl_kernel_core.ops.OpSpec.backends` says which module serves which op;
dispatch imports it on the first call of that op). Kernels run on CUDA tensors, and on CPU
tensors under the Triton interpreter (``TRITON_INTERPRET=1``) when the backend is named."""
