"""The advantages family's tests (``rl_kernel_core/advantages/``): ``group_advantages``' shared cases on
every backend that serves it, then each backend's own cases. A package, so that pytest puts
``tests/core`` (the shared helpers ``oracles`` and ``op_backends``) on ``sys.path`` for these modules too."""
