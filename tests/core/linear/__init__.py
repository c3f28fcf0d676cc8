"""The linear family's tests (``rl_kernel_core/linear/``): one module per op (``test_<op>.py``) with
the op's shared cases on every backend that serves it, then each backend's own cases; the Hopper
passes and the benchmark script's smoke test. A package, so that pytest puts ``tests/core`` (the
shared helpers ``oracles`` and ``op_backends``) on ``sys.path`` for these modules too."""
