"""Layer-wise drift probe: forward hooks on every module of a model record each module's input and
output per token, in one configuration (the reference), then measure how far a second configuration
(another layout, batch size or mode) lands from it, module by module.

Layouts put a token on different rows (packed, padded, one row per decode step), so before each
model call the harness tells the probe which ``(sequence, position)`` each row holds
(:meth:`DriftProbe.rows`); a module's output is split into rows by its leading dims and matched by
that key. Tensors of the reference configuration are kept on the CPU in fp32; the second one is
compared on the fly and only its drift is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


@dataclass
class ModuleDrift:
    """One module's largest |difference| over the matched tokens, input and output (``nan``: not matched)."""

    name: str
    kind: str
    input_drift: float
    output_drift: float


def _first_tensor(value) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            t = _first_tensor(v)
            if t is not None:
                return t
    if hasattr(value, "last_hidden_state"):
        return value.last_hidden_state
    if hasattr(value, "logits"):
        return value.logits
    return None


def _split_rows(t: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """``t`` as ``[n, -1]`` when its leading dims multiply to ``n``, else None."""
    size = 1
    for d in range(t.dim()):
        size *= t.shape[d]
        if size == n:
            return t.reshape(n, -1)
        if size > n:
            return None
    return None


class DriftProbe:
    """Hooks on every named submodule of ``model``; use as a context manager around both runs.

    1. ``probe.reference()`` then run configuration A (the harness calls :meth:`rows` before each
       model call); 2. ``probe.compare()`` then run configuration B; 3. :meth:`drifts` and
       :meth:`first_divergent`.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.order: list[str] = []
        self.kinds: dict[str, str] = {}
        self._keys: list = []
        self._phase = "reference"
        self._saved: dict[tuple[str, str], dict] = {}
        self._drift: dict[tuple[str, str], float] = {}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> "DriftProbe":
        for name, module in self.model.named_modules():
            if name:
                self.kinds[name] = type(module).__name__
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def rows(self, keys: list) -> None:
        """The ``(sequence, position)`` of each row of the next model call (None: a padding row)."""
        self._keys = list(keys)

    def reference(self) -> None:
        """Record the next runs as the reference configuration."""
        self._phase = "reference"
        self._saved.clear()
        self.order.clear()

    def compare(self) -> None:
        """Compare the next runs with the reference."""
        self._phase = "compare"
        self._drift.clear()

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if not self._keys:
                return
            for part, value in (("input", inputs), ("output", output)):
                t = _first_tensor(value)
                if t is None or not t.is_floating_point():
                    continue
                rows = _split_rows(t.detach(), len(self._keys))
                if rows is None:
                    continue
                self._record(name, part, rows)

        return hook

    def _record(self, name: str, part: str, rows: torch.Tensor) -> None:
        slot = (name, part)
        if self._phase == "reference":
            if name not in self.order:
                self.order.append(name)
            store = self._saved.setdefault(slot, {})
            cpu = rows.float().cpu()
            for i, key in enumerate(self._keys):
                if key is not None:
                    store[key] = cpu[i]
            return
        saved = self._saved.get(slot)
        if saved is None:
            return
        worst = self._drift.get(slot, 0.0)
        cpu = rows.float().cpu()
        for i, key in enumerate(self._keys):
            ref = saved.get(key) if key is not None else None
            if ref is not None and ref.shape == cpu[i].shape:
                d = float((cpu[i] - ref).abs().max()) if ref.numel() else 0.0
                worst = max(worst, d if not math.isnan(d) else math.inf)
        self._drift[slot] = worst

    def drifts(self) -> list[ModuleDrift]:
        """Each recorded module in the reference run's execution order."""
        return [
            ModuleDrift(
                n, self.kinds[n], self._drift.get((n, "input"), math.nan), self._drift.get((n, "output"), math.nan)
            )
            for n in self.order
        ]

    def first_divergent(self, threshold: float = 0.0) -> Optional[dict]:
        """The first module (execution order) whose output drift exceeds ``threshold``, and whether
        its input already did: ``{"module", "kind", "output_drift", "input_drift", "cause"}``."""
        previous = None
        for d in self.drifts():
            if not d.output_drift > threshold:
                previous = d.name if not math.isnan(d.output_drift) else previous
                continue
            if d.input_drift > threshold:
                cause = (
                    f"its input already differs: the divergence starts in code between {previous or 'the model input'} "
                    f"and {d.name} that is not a module (e.g. attention or an elementwise op)"
                )
            else:
                cause = f"its input matches: the {d.kind} operator {d.name} produces the divergence"
            return {
                "module": d.name,
                "kind": d.kind,
                "output_drift": d.output_drift,
                "input_drift": d.input_drift,
                "cause": cause,
            }
        return None
