"""Two gloo ranks (``torch.distributed.run --nproc_per_node=2``): verl's FSDP2 engine with the
untied LM head sharded across both ranks, rl-kernel switch off and on.

This is the layout of verl issue 5633: the head is its own FSDP unit, so each rank holds half of
its weight as a ``DTensor`` shard; the rl-kernel head computation must all-gather it through FSDP
and reduce-scatter its gradient (averaged over data-parallel ranks, gradient sync deferred across
micro-batches) exactly as verl's own ``lm_head`` call does. Each rank gets its own random rollout.
Usage: ``python -m torch.distributed.run --nproc_per_node=2 fsdp2_two_ranks.py MODEL_DIR``; exits
non-zero (assertion) when a log-prob, metric or gradient differs beyond the contract.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verl_cpu  # noqa: E402  (sets verl up on CPU before anything else imports verl)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from rl_kernel_core.contract import assert_close  # noqa: E402

FP32 = torch.float32
OVERRIDES = (
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation=True",
)


def main(model_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    off = verl_cpu.build_worker(model_dir, "actor", *OVERRIDES)
    on = verl_cpu.build_worker(model_dir, "actor", *OVERRIDES, verl_cpu.SWITCH_ON)
    weight = verl_cpu.engine_of(on).module.lm_head.weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),), weight
    assert weight.to_local().shape[0] == verl_cpu.VOCAB // world, weight.to_local().shape

    g = torch.Generator().manual_seed(1000 + rank)
    rollout = verl_cpu.random_rollout(g)
    temperature = 0.8
    lp_on, ent_on, _ = verl_cpu.infer(on, rollout, temperature)
    lp_off, ent_off, _ = verl_cpu.infer(off, rollout, temperature)
    assert_close(lp_on, lp_off, "logprob", FP32, name=f"rank {rank} log_probs")
    assert_close(ent_on, ent_off, "logprob", FP32, name=f"rank {rank} entropy")

    per_token = verl_cpu.policy_inputs(off, rollout, temperature, g)
    metrics_on, grads_on = verl_cpu.update_actor(on, rollout, per_token, temperature, world_size=world)
    metrics_off, grads_off = verl_cpu.update_actor(off, rollout, per_token, temperature, world_size=world)
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss", "loss", "grad_norm"):
        assert_close(
            torch.tensor(metrics_on[key], dtype=torch.float64),
            torch.tensor(metrics_off[key], dtype=torch.float64),
            "reduction",
            FP32,
            name=f"rank {rank} {key}",
        )
    assert grads_on.keys() == grads_off.keys() and "lm_head.weight" in grads_on
    for name in grads_off:
        assert_close(grads_on[name], grads_off[name], "gradient", FP32, name=f"rank {rank} grad {name}")
    assert "rl_kernel/logprob_ms" in metrics_on and not [k for k in metrics_off if k.startswith("rl_kernel/")]
    print(f"rank {rank}: log-probs, entropies, loss metrics and {len(grads_on)} gradients match", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
