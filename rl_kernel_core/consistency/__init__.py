"""Deprecated paths, kept for one release: the trainer's hooks moved to
``rl_kernel_core/batch_invariant_mode/`` (``api_hf``, ``api_vlm``, ``api_rope``, ``api_moe``,
``api_row_parallel``), the consistency tooling to :mod:`rl_kernel_core.tools.consistency`."""
