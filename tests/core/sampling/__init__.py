"""The sampling family's tests (``rl_kernel_core/sampling/``): ``sample``'s shared cases on every backend
that serves it, then each backend's own cases (FlashInfer's in their own module). A package, so that
pytest puts ``tests/core`` (the shared helpers ``oracles`` and ``op_backends``) on ``sys.path`` for these
modules too."""
