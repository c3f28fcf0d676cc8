"""``rl_kernel_core.X`` means one thing: the batch-invariant mode's context manager, not its module."""

import rl_kernel_core as rk


def test_batch_invariant_is_the_context_manager():
    import rl_kernel_core.batch_invariant_mode.api as mode

    assert rk.batch_invariant is mode.batch_invariant
    assert callable(rk.batch_invariant)
