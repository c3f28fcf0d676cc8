"""The batch-invariant mode's family: every row's bits independent of the batch it is computed in.

- ``api.py``: the mode (``batch_invariant``, ``set_batch_invariant_mode``, ``is_batch_invariant``), the aten
  routes it installs, and the public ops it routes to (``rms_norm`` and the ``bi_*`` matmul, linear,
  log-softmax, logsumexp and mean);
- ``api_attention.py``: the public ``varlen_attention`` (and the paged form an engine's cache reads),
  which the mode's models use for attention;
- ``reference.py``, ``reference_attention.py``: the math, in plain PyTorch (the ``torch`` backend);
- ``triton.py``, ``triton_attention.py``: the Triton kernels, registered as ``triton``;
- ``triton_launch.py``: the launch plans that run those kernels' compiled cubins from C++
  (``native/csrc/bind_triton_launch.cpp``, route ``triton+cpp_launch``).

Attention belongs here: its public function suspends the mode's routes, its reference accumulates
with the mode's dtype rule, and its Triton kernels launch through the mode's C++ launcher.
"""
