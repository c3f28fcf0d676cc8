"""The loss family: verl's PPO/GRPO policy loss and its log-ratio and KL terms.

- ``api.py``: the public :func:`~rl_kernel_core.loss.api.ratio_kl`, :func:`~rl_kernel_core.loss.api.policy_loss`
  and :func:`~rl_kernel_core.loss.api.fused_linear_policy_loss` (argument checks, then dispatch);
- ``opdef.py``: the frozen ``LossSettings``, the custom-op schemas, fakes and autograd glue every fast
  backend shares;
- ``reference.py``: the math, in plain PyTorch (the ``torch`` backend of the three ops);
- ``triton.py``: the Triton kernels of ``ratio_kl`` and ``policy_loss``, registered as ``triton``
  (``fused_linear_policy_loss``'s Triton backend is the linear family's ``triton_fused_loss.py``);
- ``native.py``: the native backend's loader over ``native/csrc/loss.cu``.
"""
