"""One test module per public op (``test_<op>.py``): the op's shared cases on every backend that
serves it, then each backend's own cases. A package, so that pytest puts ``tests/core`` (the shared
helpers ``oracles`` and ``op_backends``) on ``sys.path`` for these modules too."""
