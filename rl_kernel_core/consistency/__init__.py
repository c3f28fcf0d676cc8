"""Train/rollout consistency: the chain model, the log-prob harness in each layout, the drift probe,
the input parity precheck and the ``rl-kernel consistency`` report."""
