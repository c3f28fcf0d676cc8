"""Train/rollout consistency: the chain model (:mod:`.model`), its log-probs in each layout
(:mod:`.chain`), Hugging Face models in batch-invariant mode (:mod:`.hf`), the input parity precheck
(:mod:`.parity`), the layer-wise drift probe (:mod:`.probe`) and the ``rl-kernel consistency``
report (:mod:`.run`)."""
