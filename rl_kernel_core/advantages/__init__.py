"""The advantages family: GRPO-style group advantages and the token advantages built on them.

- ``api.py``: the public :func:`~rl_kernel_core.advantages.api.group_advantages` (argument checks, then dispatch);
- ``api_rewards.py``: the public :func:`~rl_kernel_core.advantages.api_rewards.token_advantages`, per-token
  advantages from rewards over :func:`group_advantages`;
- ``opdef.py``: the custom-op schema, fake and ``supports`` reasons every fast backend shares;
- ``reference.py``: the math, in plain PyTorch (the ``torch`` backend);
- ``triton.py``: the Triton kernel, registered as ``triton``;
- ``native.py``: the native backend's loader over ``native/csrc/advantages.cu``.
"""
