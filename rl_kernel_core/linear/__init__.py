"""The linear family: log-probs from hidden states without logits (``linear_logprob``) and the
Triton kernels of the fused linear policy loss.

- ``api.py``: the public :func:`~rl_kernel_core.linear.api.linear_logprob` (argument checks, then dispatch);
- ``opdef.py``: the custom-op schemas, fakes and autograd glue every fast backend shares;
- ``reference.py``: the math, in plain PyTorch (the ``torch`` backend of both log-prob ops);
- ``chunks.py``: the backend-neutral chunk driver and :class:`~rl_kernel_core.linear.chunks.LinearTuning`;
- ``triton.py``: the Triton backend's registration over the passes of ``triton_tile.py`` (the logits
  tile), ``triton_stats.py`` (statistics and merge), ``triton_grad.py`` (gradient),
  ``triton_sm90.py`` (where the Hopper CUDA passes run them) and ``triton_vocab_parallel.py``
  (``tp_group``); ``triton_fused_loss.py``: ``fused_linear_policy_loss``'s Triton backend;
- ``native.py``: the native backend's loader over ``native/csrc/linear_logprob.cu``.
"""
