"""Load the plugin the way vLLM does, in a fresh process, and print what changed (a test subprocess).

Usage: ``python vllm_plugin_probe.py SCENARIO`` with the switches in the environment. Prints one
JSON object: for every target the plugin knows, whether the attribute is the same object after
``vllm.plugins.load_general_plugins()`` (and after a second ``register()``), plus ``status()``.

Scenarios: ``load`` (plain), ``moved`` (the V1 runner's target list gets a second, non-existent
attribute, as if vLLM had moved part of the API; catches the strict-mode error and prints it),
``restore`` (load, then ``rl_kernel_vllm.restore()``: ``restored`` says whether every target,
the out-of-tree registry and the batch-invariant mode are back). A switch error raised from
vLLM's loader is caught and printed too.
"""

from __future__ import annotations

import json
import logging
import sys


def main(scenario: str) -> None:
    # vLLM configures its log handler only when an engine starts; without an engine, show INFO here.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import vllm.plugins
    from vllm.model_executor.custom_op import op_registry_oot

    import rl_kernel_vllm
    from rl_kernel_core import adapters
    from rl_kernel_core.switches import SwitchError
    from rl_kernel_vllm import batch_invariant, logprobs, moe, sampler

    if scenario == "moved":
        logprobs.RUNNERS["v1"] = logprobs.V1_TARGETS + ("vllm.v1.sample.sampler:Sampler.no_such_method",)
    targets = [*logprobs.WRAPPERS, *sampler.WRAPPERS]
    from vllm.platforms import current_platform

    # the batch-invariant hook covers the CPU and CUDA platforms (the GPU release imported on a
    # CPU-only machine has neither)
    bi_platform = bool(current_platform.is_cpu() or current_platform.is_cuda())
    if scenario == "restore" and bi_platform:  # every hook on
        targets += [batch_invariant.RMS_NORM_TARGET, batch_invariant.CPU_GEMM_TARGET, *(t for t, _ in moe.TARGETS)]
    before = {t: adapters.locate(t)[2] for t in targets}
    oot_before = dict(op_registry_oot)
    error = None
    try:
        vllm.plugins.load_general_plugins()
    except (rl_kernel_vllm.TargetError, SwitchError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    first = {t: adapters.locate(t)[2] for t in targets}
    rl_kernel_vllm.register()
    second = {t: adapters.locate(t)[2] for t in targets}
    report = {
        "error": error,
        "status": rl_kernel_vllm.status(),
        "unchanged": {t: first[t] is before[t] for t in targets},
        "wraps_original": {t: getattr(first[t], adapters.ORIGINAL_ATTR, None) is before[t] for t in targets},
        "idempotent": {t: second[t] is first[t] for t in targets},
        "oot_unchanged": {k: op_registry_oot.get(k) is v for k, v in oot_before.items()}
        == {k: True for k in oot_before}
        and set(op_registry_oot) == set(oot_before),
        "oot_added": sorted(set(op_registry_oot) - set(oot_before)),
        "bi_platform": bi_platform,
    }
    report["restored"] = None
    during = {"attention_override": _attention_overrides(), "mode_on": _mode_on()}
    if scenario == "restore":
        rl_kernel_vllm.restore()
        report["restored"] = {
            "targets": {t: adapters.locate(t)[2] is before[t] for t in targets},
            "oot": dict(op_registry_oot) == oot_before,
            "status_registered": rl_kernel_vllm.status()["registered"],
            "attention_override": _attention_overrides(),
            "mode_on": _mode_on(),
        }
        report["during"] = during
    print("PROBE " + json.dumps(report))


def _attention_overrides() -> dict[str, str]:
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    return {member.name: path for member, path in _ATTN_OVERRIDES.items()}


def _mode_on() -> bool:
    import rl_kernel_core

    return rl_kernel_core.is_batch_invariant()


if __name__ == "__main__":
    main(sys.argv[1])
