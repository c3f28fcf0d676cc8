"""rl-kernel's vLLM plugin, loaded by vLLM through the ``vllm.general_plugins`` entry point.

Off unless ``RL_KERNEL_VLLM=1``; see :mod:`rl_kernel_vllm.switches` for the per-hook switches
and ``docs/vllm.md`` for what each changes. ``status()`` reports what is live in this process, ``restore()`` undoes it.
"""

from rl_kernel_vllm.plugin import TargetError, register, restore, status

__all__ = ["TargetError", "register", "restore", "status"]
