"""Run one real vLLM engine on CPU and write what it returned (a subprocess of the tests).

Usage: ``python vllm_engine_run.py SPEC.json OUT.json``. SPEC holds ``model`` (a checkpoint
directory), ``requests`` (a list of ``{"prompt_token_ids": [...], "params": {SamplingParams
kwargs}}``) and ``engine`` (``vllm.LLM`` kwargs; fp32, eager and seed 0 unless it says otherwise). All requests go to one ``generate`` call,
so they share engine steps (mixed temperatures in one batch). OUT gets, per request, the output
token ids and every returned ``{token id: [logprob, rank]}`` per position, plus the plugin status
of the driver process and of each worker (through ``LLM.collective_rpc``). The plugin's switches
come from the environment, as in any vLLM deployment.

vLLM starts its engine-core and worker processes with ``spawn`` here, which re-imports the main
module: everything runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _qualname(obj) -> str:
    return type(obj).__module__ + "." + type(obj).__qualname__


def worker_report(worker) -> dict:
    """Runs inside each vLLM worker process: the plugin's status and the live vLLM objects."""
    # before this function imports anything of ours; the switch reader (rl_kernel_core.switches and
    # .adapters, standard library only) is the one part of rl_kernel_core the plugin loads while off
    core_imported = any(
        m.startswith("rl_kernel_core.") and m not in ("rl_kernel_core.switches", "rl_kernel_core.adapters")
        for m in sys.modules
    )
    import rl_kernel_vllm
    from rl_kernel_core import adapters
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.sample.sampler import Sampler

    model = worker.model_runner.get_model()
    report = {
        "pid": os.getpid(),
        "status": rl_kernel_vllm.status(),
        "rl_kernel_core_imported": core_imported,
        "sampler_forward_patched": adapters.is_patched(Sampler.__dict__["forward"]),
        "runner_sampler_type": _qualname(worker.model_runner.sampler),
        "logits_processor_types": sorted({_qualname(m) for m in model.modules() if isinstance(m, LogitsProcessor)}),
    }
    return report


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    import rl_kernel_vllm

    llm = LLM(**{"model": spec["model"], "dtype": "float32", "enforce_eager": True, "seed": 0, **spec["engine"]})
    t_engine = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in spec["requests"]]
    params = [SamplingParams(**r["params"]) for r in spec["requests"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t_generate = time.perf_counter() - t0 - t_engine
    results = []
    for out in outputs:
        completion = out.outputs[0]
        positions = [
            {str(tok): [lp.logprob, lp.rank] for tok, lp in pos.items()} for pos in (completion.logprobs or [])
        ]
        results.append(
            {
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "logprobs": positions,
            }
        )
    report = {
        "driver_pid": os.getpid(),
        "driver_status": rl_kernel_vllm.status(),
        "workers": llm.collective_rpc(worker_report),
        "results": results,
        "seconds": {"engine_start": t_engine, "generate": t_generate},
    }
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
