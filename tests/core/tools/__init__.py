"""The tools' tests (``rl_kernel_core/tools/``): the ``rl-kernel`` command, the step-log report, the
benchmark plumbing, the consistency chain and report (text and vision-language models) and the
multimodal batch with its layout parity. A package, so that pytest puts ``tests/core`` (the shared
helpers ``oracles`` and ``tiny_vlm_processor``) on ``sys.path`` for these modules too."""
