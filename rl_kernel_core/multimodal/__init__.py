"""Deprecated paths, kept for one release: moved to :mod:`rl_kernel_core.tools.multimodal`."""
