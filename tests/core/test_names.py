"""``rl_kernel_core.X`` means one thing: the batch-invariant mode's context manager, not its module."""

import rl_kernel_core as rk


def test_batch_invariant_is_the_context_manager():
    import rl_kernel_core.invariance as invariance

    assert rk.batch_invariant is invariance.batch_invariant
    assert callable(rk.batch_invariant)
