"""The tools, a layer above the operators: nothing below imports them, and the adapters' and trainers'
run time does not need them.

- ``cli.py``: the ``rl-kernel`` command (``info``, ``bench``, ``compare``, ``consistency``);
- ``bench.py``: the benchmark plumbing of ``rl-kernel bench`` and ``benchmarks/``;
- ``report.py``: the off-vs-on comparison of two step logs (``rl-kernel compare``);
- ``consistency/``: the train/rollout consistency report (chain model, layouts, parity precheck,
  drift probe, the engine pair);
- ``multimodal/``: image-text batches and their rollout-vs-training layout parity.

What a trainer calls at run time to follow the batch-invariant mode (``use_mode_attention``,
``use_mode_vlm``, ``use_row_parallel_split``, the rotary and MoE functions) is in
``rl_kernel_core/batch_invariant_mode/`` (``api_hf.py``, ``api_vlm.py``, ``api_rope.py``,
``api_moe.py``, ``api_row_parallel.py``); the step records the adapters write are
``rl_kernel_core/profiling.py``'s.
"""
