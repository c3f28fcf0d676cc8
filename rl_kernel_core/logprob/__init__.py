"""The log-prob family: per-token log-probs and entropies from logits a framework holds
(``logprob_from_logits``), and the row math the linear family builds on.

- ``api.py``: the public :func:`~rl_kernel_core.logprob.api.logprob_from_logits` (argument checks, then
  dispatch) and the result helpers ``linear_logprob`` shares;
- ``opdef.py``: the custom-op schemas, fakes and autograd glue every fast backend shares;
- ``reference.py``: the math, in plain PyTorch (the ``torch`` backend), and the row statistics and
  gradient ``rl_kernel_core/linear/reference.py`` reuses;
- ``triton.py``: the Triton kernels, registered as ``triton`` (the sampler reuses its forward);
- ``native.py``: the native backend's loader over ``native/csrc/logprob_from_logits.cu``.
"""
