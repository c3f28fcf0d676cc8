"""The loss family's tests (``rl_kernel_core/loss/``): one module per op (``test_<op>.py``) with the op's
shared cases on every backend that serves it, then each backend's own cases (``fused_linear_policy_loss``'s
are the linear family's, beside its Triton backend). A package, so that pytest puts ``tests/core`` (the
shared helpers ``oracles`` and ``op_backends``) on ``sys.path`` for these modules too."""
