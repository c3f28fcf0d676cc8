"""Train/rollout consistency: the chain model (:mod:`.model`), its log-probs in each layout
(:mod:`.chain`), a Hugging Face model's (:mod:`.hf`) and a vision-language model's (:mod:`.vlm`), the
input parity precheck (:mod:`.parity`), the layer-wise drift probe (:mod:`.probe`), the
``rl-kernel consistency`` report (:mod:`.run`) and its off/on engine pair (:mod:`.engine_pair`)."""
