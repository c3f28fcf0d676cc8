"""The batch-invariant mode's tests (``rl_kernel_core/batch_invariant_mode/``): one module per op
(``test_<op>.py``) with the op's shared cases on every backend that serves it, then each backend's
own cases; the mode's routes and the C++ launcher; the trainer-side hooks (rotary values, MoE blocks,
the row-parallel split). A package, so that pytest puts ``tests/core``
(the shared helpers ``oracles`` and ``op_backends``) on ``sys.path`` for these modules too."""
