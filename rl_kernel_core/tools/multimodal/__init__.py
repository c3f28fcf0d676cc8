"""Image-text batches for RL: the schema (:mod:`.schema`), rollout-vs-training layout parity
(:mod:`.parity`) and the saved form both sides write (:mod:`.storage`)."""
