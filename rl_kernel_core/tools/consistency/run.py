"""``rl-kernel consistency``: a model's rollout-like vs training-like log-probs of a fixed sequence
set, with batch-invariant mode off and on, against the numerical contract.

Configurations (the same weights, sequences and seed):

* training-like: one forward over all sequences (the built-in tiny model: packed ``cu_seqlens``
  layout; a Hugging Face model: one right-padded batch);
* rollout-like: prompts prefilled into a KV cache, then one token per step, ``rollout_batch``
  sequences at a time (left-padded prompts for a Hugging Face model).

For each mode the report gives the max and mean |log-prob difference| over all compared tokens,
a KL estimate (the mean of ``exp(d) - d - 1`` with ``d = lp_rollout - lp_training``: the k3
estimator of KL(training || rollout), averaged over the fixed sequences' tokens rather than over
tokens drawn from the training-side model) and the contract bound
(``logprob`` class for the model dtype: ``atol + rtol * |lp|`` per token; the KL bound is the
mean of ``exp(b) - b - 1`` over the per-token bounds ``b``, the largest k3 that tokens within
their bounds can give). Mode on passes when
the two are bitwise equal (the contract's bitwise invariances); mode off passes when it is within
the bound. Before any comparison, :mod:`~rl_kernel_core.tools.consistency.parity` checks that the two
configurations' batches hold the same tokens, positions and masks. When a mode fails, or a plot
is asked for, the :class:`~rl_kernel_core.tools.consistency.probe.DriftProbe` compares every module's
output between the two configurations and names the first divergent module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rl_kernel_core import contract
from rl_kernel_core.batch_invariant_mode.api import batch_invariant
from rl_kernel_core.tools.consistency import chain, parity
from rl_kernel_core.tools.consistency.probe import DriftProbe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Settings:
    """What ``rl-kernel consistency`` runs."""

    model: str = "tiny"
    sequences: int = 8
    min_len: int = 8
    max_len: int = 24
    prompt_len: int = 4
    rollout_batch: int = 3
    seed: int = 0
    device: str = "cpu"
    dtype: str = "fp32"
    probe: bool = False


class Subject:
    """A model with its two configurations; :func:`load` builds one."""

    def __init__(self, model, describe: str, vocab: int, pad_id: int, hf: bool):
        self.model, self.describe, self.vocab, self.pad_id, self.hf = model, describe, vocab, pad_id, hf

    def batches(self, seqs: list[torch.Tensor]) -> tuple[parity.Batch, parity.Batch]:
        """The (rollout, training) batches each configuration feeds, for the parity precheck."""
        special = {"pad": self.pad_id}
        rollout = parity.from_sequences(seqs, "left", [0] * len(seqs), self.pad_id, special)
        training = parity.from_sequences(seqs, "right", [0] * len(seqs), self.pad_id, special)
        return rollout, training

    def training(self, batch: parity.Batch, probe=None) -> list[torch.Tensor]:
        """Training-like log-probs of ``batch``'s sequences (one forward)."""
        if self.hf:
            from rl_kernel_core.tools.consistency import hf

            return hf.training_logprobs(self.model, batch, probe)
        return chain.packed_logprobs(self.model, batch.sequences(), probe)

    def rollout(self, seqs: list[torch.Tensor], settings: Settings, probe=None) -> list[torch.Tensor]:
        """Rollout-like log-probs of ``seqs`` (prefill, then decode over a KV cache)."""
        if self.hf:
            from rl_kernel_core.tools.consistency import hf

            return hf.rollout_logprobs(
                self.model, seqs, settings.prompt_len, settings.rollout_batch, self.pad_id, probe
            )
        out = []
        for first in range(0, len(seqs), settings.rollout_batch):
            out += chain.decode_logprobs(
                self.model, seqs[first : first + settings.rollout_batch], settings.prompt_len, probe, first_index=first
            )
        return out


def load(settings: Settings) -> Subject:
    """The built-in tiny Qwen3-style decoder (``"tiny"``, seeded) or a Hugging Face causal LM path."""
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    if settings.model == "tiny":
        from rl_kernel_core.tools.consistency.model import TinyConfig, TinyDecoder

        torch.manual_seed(settings.seed)
        config = TinyConfig()
        model = TinyDecoder(config).to(device=device, dtype=dtype).eval()
        return Subject(model, f"built-in tiny Qwen3-style decoder {config}", config.vocab_size, 0, hf=False)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise RuntimeError(f"--model {settings.model!r} needs transformers (pip install transformers): {exc}") from None
    from rl_kernel_core.batch_invariant_mode.api_hf import use_mode_attention

    # transformers types PreTrainedModel.to through functools.wraps, whose type does not bind self
    model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    use_mode_attention(model)
    pad_id = 0
    try:
        tok = AutoTokenizer.from_pretrained(settings.model)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    except (OSError, ValueError):
        pass  # a model directory without a tokenizer: token ids are drawn directly, pad 0
    return Subject(
        model, f"transformers {type(model).__name__} from {settings.model}", model.config.vocab_size, pad_id, hf=True
    )


def _compare(rollout: list[torch.Tensor], training: list[torch.Tensor], dtype: torch.dtype) -> dict:
    r = torch.cat([x.detach().double().cpu() for x in rollout])
    t = torch.cat([x.detach().double().cpu() for x in training])
    d = r - t
    tol = contract.tolerance("logprob", dtype)
    bound = tol.atol + tol.rtol * t.abs()
    excess = d.abs() - bound
    kl, kl_bound = float((d.exp() - d - 1).mean()), float((bound.exp() - bound - 1).mean())
    return {
        "tokens": int(d.numel()),
        "max_abs_diff": float(d.abs().max()),
        "mean_abs_diff": float(d.abs().mean()),
        "kl_k3": kl,
        "kl_k3_bound": kl_bound,
        "bitwise_equal": bool(torch.equal(r, t)),
        "within_contract": bool((excess <= 0).all()),
        "worst_excess_over_contract": float(excess.max()),
    }


def run(settings: Settings) -> dict:
    """Run both configurations with the mode off and on; returns the report (JSON-serialisable)."""
    if settings.prompt_len < 1 or settings.prompt_len >= settings.min_len:
        raise ValueError(f"prompt_len must be in [1, min_len={settings.min_len}), got {settings.prompt_len}")
    if settings.max_len < settings.min_len:
        raise ValueError(f"max_len must be >= min_len={settings.min_len}, got {settings.max_len}")
    subject = load(settings)
    device = torch.device(settings.device)
    vocab_hi = min(subject.vocab, 32000)
    seqs = [
        s.to(device)
        for s in chain.fixed_sequences(vocab_hi, settings.sequences, settings.min_len, settings.max_len, settings.seed)
    ]
    rollout_batch, training_batch = subject.batches(seqs)
    mismatch = parity.check(rollout_batch, training_batch)
    tol = contract.tolerance("logprob", DTYPES[settings.dtype])
    report: dict[str, Any] = {
        "settings": asdict(settings),
        "model": subject.describe,
        "lengths": [len(s) for s in seqs],
        "contract": {
            "op_class": "logprob",
            "dtype": settings.dtype,
            "atol": tol.atol,
            "rtol": tol.rtol,
            "mode_on_requires": "bitwise equality",
            "mode_off_requires": "within atol + rtol * |lp| per token",
        },
        "parity": "ok" if mismatch is None else str(mismatch),
        "modes": {},
    }
    if mismatch is not None:
        report["passed"] = False
        return report
    for mode in ("off", "on"):
        with batch_invariant(mode == "on"), torch.no_grad():
            training = subject.training(training_batch)
            rollout = subject.rollout(rollout_batch.sequences(), settings)
            result = _compare(rollout, training, DTYPES[settings.dtype])
            result["passed"] = result["bitwise_equal"] if mode == "on" else result["within_contract"]
            if settings.probe or not result["passed"]:
                with DriftProbe(subject.model) as probe:
                    probe.reference()
                    subject.training(training_batch, probe)
                    probe.compare()
                    subject.rollout(rollout_batch.sequences(), settings, probe)
                result["layers"] = [asdict(d) for d in probe.drifts()]
                result["first_divergent"] = probe.first_divergent()
        report["modes"][mode] = result
    report["passed"] = all(m["passed"] for m in report["modes"].values())
    return report


def plot_available() -> None:
    """Raise a clear error when matplotlib (needed by :func:`plot`) is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"--plot needs matplotlib (pip install matplotlib): {exc}") from None


def plot(report: dict, path: str) -> None:
    """PNG of each module's output drift (rollout vs training, max |diff|) in execution order, mode
    off vs on; zero (bitwise equal) sits on the axis of a symmetric-log scale."""
    plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4.5))
    names: list[str] = []
    styles: dict[str, dict[str, Any]] = {
        "off": dict(color="tab:red", marker="o"),
        "on": dict(color="tab:green", marker="s"),
    }
    for mode, style in styles.items():
        layers = report["modes"].get(mode, {}).get("layers")
        if not layers:
            continue
        names = names or [d["name"] for d in layers]
        ys = [0.0 if math.isnan(d["output_drift"]) else d["output_drift"] for d in layers]
        result = report["modes"][mode]
        ax.plot(
            range(len(ys)),
            ys,
            label=f"mode {mode}: log-prob max |diff| {result['max_abs_diff']:.3g}",
            markersize=3,
            linewidth=1,
            **style,
        )
    ax.set_yscale("symlog", linthresh=1e-9)
    ax.set_ylim(bottom=0)
    step = max(1, len(names) // 40)
    ax.set_xticks(range(0, len(names), step))
    ax.set_xticklabels(names[::step], rotation=90, fontsize=6)
    ax.set_ylabel("max |rollout - training| of module output")
    ax.set_title(f"Rollout vs training drift per module, 0 = bitwise equal\n{report['model'][:110]}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def text(report: dict) -> str:
    """The human-readable report."""
    lines = [
        f"model: {report['model']}",
        f"sequences: {len(report['lengths'])} (lengths {min(report['lengths'])}..{max(report['lengths'])}), "
        f"rollout batch {report['settings']['rollout_batch']}, prompt {report['settings']['prompt_len']} tokens, seed {report['settings']['seed']}",
        f"input parity: {report['parity']}",
    ]
    c = report["contract"]
    lines.append(f"contract: logprob/{c['dtype']} atol={c['atol']} rtol={c['rtol']}; mode on must be bitwise equal")
    lines.append(
        f"{'mode':<6}{'tokens':>8}{'max |diff|':>14}{'mean |diff|':>14}{'KL (k3)':>12}{'KL bound':>12}{'bitwise':>9}  result"
    )
    for mode, m in report["modes"].items():
        lines.append(
            f"{mode:<6}{m['tokens']:>8}{m['max_abs_diff']:>14.3g}{m['mean_abs_diff']:>14.3g}{m['kl_k3']:>12.3g}"
            f"{m['kl_k3_bound']:>12.3g}{str(m['bitwise_equal']):>9}  {'PASS' if m['passed'] else 'FAIL'}"
        )
        first = m.get("first_divergent")
        if first:
            lines.append(
                f"  first divergent module ({mode}): {first['module']} ({first['kind']}), output drift "
                f"{first['output_drift']:.3g}; {first['cause']}"
            )
    lines.append("PASSED" if report["passed"] else "FAILED")
    return "\n".join(lines)
