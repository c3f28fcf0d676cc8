"""verl 0.9.1 on CPU: a device platform for verl's ``PlatformRegistry`` and unpinned FSDP2 offload.

verl ships CUDA/NPU/ROCm platforms only. Importing this module registers ``PlatformCPU`` under
the name ``cpu``, makes FSDP2's ``CPUOffloadPolicy`` unpinned (:func:`use_unpinned_cpu_offload`),
verl's Ray workers' process groups gloo (:func:`use_gloo_process_groups`) and, in vLLM's worker
processes, vLLM's CPU linear layers reloadable (:func:`use_plain_vllm_cpu_linear`). With
``VERL_PLATFORM=cpu`` verl then runs its FSDP2 engine on
CPU tensors with gloo collectives; ``VERL_ENGINE_DEVICE=cuda`` makes ``EngineRegistry`` hand out
the FSDP engine verl registers for CUDA (:func:`grpo.verl_engine.environment` sets the three).

Two users: the verl adapter tests import it in-process, and the recipe's verl engine names it in
``VERL_USE_EXTERNAL_MODULES``, which ``import verl`` reads in every process of a run (the
trainer and each Ray worker), so every process registers the platform before verl picks one.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _cpu_device_module() -> types.SimpleNamespace:
    zero = lambda *a, **k: 0  # noqa: E731
    nothing = lambda *a, **k: None  # noqa: E731
    return types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: "cpu",
        set_device=nothing,
        synchronize=nothing,
        empty_cache=nothing,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        max_memory_allocated=zero,
        max_memory_reserved=zero,
        memory_allocated=zero,
        memory_reserved=zero,
        reset_peak_memory_stats=nothing,
        mem_get_info=lambda *a, **k: (0, 0),
        get_device_name=lambda *a, **k: "CPU",
    )


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl platform for CPU tensors: device ``cpu``, gloo collectives, no profiler."""

    _module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return self._module

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        # verl's trainer counts and places its workers by Ray's GPU resource; a CPU run declares
        # logical GPU slots (``ray_init.num_gpus``), each held by a CPU worker process
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def use_unpinned_cpu_offload():
    """Make ``torch.distributed.fsdp.CPUOffloadPolicy`` ignore ``pin_memory=True``.

    verl gives forward-only (reference) FSDP2 engines ``CPUOffloadPolicy(pin_memory=True)``;
    pinning host memory needs an accelerator, so on CPU the same policy is used unpinned. verl
    binds the name when ``verl.utils.fsdp_utils`` is first imported, so this must run before that
    (importing this module does); holders already imported are patched too. Returns a function
    that restores torch's class everywhere it was replaced.
    """
    import torch.distributed.fsdp as fsdp

    policy = fsdp.CPUOffloadPolicy
    if getattr(policy, "_rl_kernel_unpinned", False):
        return lambda: None

    class UnpinnedCPUOffloadPolicy(policy):
        _rl_kernel_unpinned = True

        def __init__(self, pin_memory: bool = True):
            super().__init__(pin_memory=False)

    holders = [fsdp] + [
        sys.modules[name]
        for name in ("verl.utils.fsdp_utils", "verl.workers.engine.fsdp.transformer_impl")
        if name in sys.modules
    ]
    for module in holders:
        module.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy

    def restore() -> None:
        for module in holders:
            module.CPUOffloadPolicy = policy

    return restore


def use_gloo_process_groups() -> None:
    """verl's Ray workers join ``cpu:gloo,<device>:<collective backend>``, which on CPU names
    ``cpu`` twice (torch rejects that); they join plain ``gloo`` instead. verl's modules bind the
    function when first imported, so this must run before them (importing this module does)."""
    from verl.utils import distributed

    join = distributed.initialize_global_process_group_ray
    if getattr(join, "_rl_kernel_gloo", False):
        return

    def join_gloo(timeout_second=None, backend=None):
        return join(timeout_second=timeout_second, backend=backend or "gloo")

    join_gloo._rl_kernel_gloo = True
    distributed.initialize_global_process_group_ray = join_gloo


def use_plain_vllm_cpu_linear() -> None:
    """vLLM's CPU layers compute with ``torch.nn.functional.linear`` on their live weights.

    vLLM's CPU build prepacks each linear weight for oneDNN after loading and replaces the layer's
    weight with an empty tensor without a ``weight_loader``, so verl's in-place weight sync
    (``model.load_weights`` after every update) fails, and a prepacked head would not see new
    weights. vLLM's own fallback dispatch (what it does without oneDNN) keeps the weight and
    calls ``F.linear``; this makes every 2-D weight take it. Must run in vLLM's worker process
    before the model loads: verl's worker extension class imports verl there, and with it this
    module.
    """
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_rl_kernel_plain", False):
        return

    def dispatch_plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:
            return dispatch(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch_plain._rl_kernel_plain = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_plain


use_unpinned_cpu_offload()
use_gloo_process_groups()
if "vllm" in sys.modules:  # a vLLM process (verl's processes import verl first, and vLLM only if they serve)
    use_plain_vllm_cpu_linear()
