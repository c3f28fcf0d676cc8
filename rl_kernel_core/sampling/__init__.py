"""The sampling family: drawing next tokens, with their log-probs, from logits (``sample``).

- ``api.py``: the public :func:`~rl_kernel_core.sampling.api.sample` (argument checks, then dispatch);
- ``reference.py``: the math, in plain PyTorch (the ``torch`` backend);
- ``triton.py``: the Triton kernels, registered as ``triton`` (the log-probs from the log-prob family's kernel);
- ``flashinfer.py``: FlashInfer's samplers, registered as ``flashinfer`` (imports FlashInfer);
  ``flashinfer_supports.py``: which calls that backend serves and why it refuses the others, importable
  without FlashInfer.

No custom ops (``OPS["sample"].glue`` is ``function``), so no ``opdef.py``.
"""
