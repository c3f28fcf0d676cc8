"""``rl-kernel consistency`` and its parts: the input parity precheck, the layer-wise drift probe,
the Hugging Face attention that follows the mode, the report and the plot."""

import json
import subprocess
import sys

import pytest
import torch

import rl_kernel_core as rk
from rl_kernel_core.batch_invariant_mode import api_hf
from rl_kernel_core.tools.consistency import chain, hf, parity, run
from rl_kernel_core.contract import assert_close
from rl_kernel_core.tools.consistency.model import TinyConfig, TinyDecoder
from rl_kernel_core.tools.consistency.probe import DriftProbe
from rl_kernel_core.tools.random_model import tiny_text_config

_SMALL_RUN = ("consistency", "--sequences", "3", "--min-len", "6", "--rollout-batch", "2", "--device", "cpu")
"""The command of the CLI runs here, less ``--max-len``: three short sequences on the CPU."""


def test_cli_reports_both_modes_as_json_and_plots(tmp_path):
    png = tmp_path / "drift.png"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_kernel_core.cli",
            *_SMALL_RUN,
            "--max-len",
            "12",
            "--json",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["parity"] == "ok" and report["passed"] is True
    on, off = report["modes"]["on"], report["modes"]["off"]
    assert on["bitwise_equal"] and on["max_abs_diff"] == 0.0 and on["kl_k3"] == 0.0
    assert off["within_contract"] and off["max_abs_diff"] >= 0.0 and 0.0 <= off["kl_k3"] <= off["kl_k3_bound"]
    assert on["layers"][0]["name"] == "embed_tokens" and on["layers"][-1]["name"] == "lm_head"
    assert all(d["output_drift"] == 0.0 for d in on["layers"])
    assert png.stat().st_size > 10_000


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="--plot needs matplotlib"):
        run.plot_available()


def _batches():
    seqs = [torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])]
    return parity.from_sequences(seqs, "left", [0, 0], 0), parity.from_sequences(seqs, "right", [0, 0], 0)


def test_parity_accepts_the_same_sequences_padded_on_either_side():
    assert parity.check(*_batches()) is None


@pytest.mark.parametrize(
    "fault, check, where",
    [
        (lambda b: b.input_ids.__setitem__((1, 2), 99), "token ids", "sequence 1, token 2"),
        (lambda b: b.position_ids.__setitem__((0, 3), 4), "position ids", "sequence 0, token 3"),
        (lambda b: b.loss_mask.__setitem__((1, 0), 0), "loss mask", "sequence 1, token 0"),
        (lambda b: b.attention_mask.__setitem__((1, 2), 0), "attention mask", "sequence 1"),
        (lambda b: b.special_tokens.__setitem__("pad", 3), "special token", "pad"),
        (lambda b: setattr(b, "padding_side", "left"), "padding side", "training"),
    ],
)
def test_parity_names_the_first_mismatch(fault, check, where):
    rollout, training = _batches()
    fault(training)
    mismatch = parity.check(rollout, training)
    assert mismatch is not None and mismatch.check == check and where in mismatch.where, str(mismatch)


def _probe_with_fault(seed, fault):
    """A probe of the same packed run twice, ``fault(model)`` applied before the second run."""
    torch.manual_seed(seed)
    model = TinyDecoder(TinyConfig()).eval()
    seqs = chain.fixed_sequences(97, 3, 6, 10, seed)
    with torch.no_grad(), DriftProbe(model) as probe:
        probe.reference()
        chain.packed_logprobs(model, seqs, probe)
        probe.compare()
        fault(model)
        chain.packed_logprobs(model, seqs, probe)
    return probe


def test_probe_names_the_operator_that_diverges(seed):
    probe = _probe_with_fault(
        seed, lambda model: model.layers[1].up_proj.register_forward_hook(lambda m, i, o: o + 1e-3, prepend=True)
    )
    first = probe.first_divergent()
    assert first["module"] == "layers.1.up_proj" and "input matches" in first["cause"]
    drifts = {d.name: d for d in probe.drifts()}
    assert drifts["layers.0"].output_drift == 0.0 and drifts["lm_head"].output_drift > 0


def test_probe_names_attention(seed, monkeypatch):
    from rl_kernel_core.tools.consistency import model as model_module

    original = model_module.F.scaled_dot_product_attention
    probe = _probe_with_fault(
        seed,
        lambda model: monkeypatch.setattr(
            model_module.F, "scaled_dot_product_attention", lambda *a, **k: original(*a, **k) * 1.01
        ),
    )
    first = probe.first_divergent()
    assert first["module"] == "layers.0.attn" and first["kind"] == "Attention" and "input matches" in first["cause"], (
        first
    )


def test_probe_blames_code_between_modules_when_the_input_already_differs(seed, monkeypatch):
    from rl_kernel_core.tools.consistency import model as model_module

    original = model_module._rope
    probe = _probe_with_fault(
        seed, lambda model: monkeypatch.setattr(model_module, "_rope", lambda *a, **k: original(*a, **k) * 1.01)
    )
    first = probe.first_divergent()
    assert first["module"] == "layers.0.attn" and "not a module" in first["cause"], first
    assert "layers.0.v_proj and layers.0.attn" in first["cause"], first


def _tiny_qwen3(**config):
    """A random two-layer Qwen3 (vocab 101, hidden 64, 4 heads of 16, 2 KV heads), ``config``
    overriding, in eval mode with the mode's attention."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(**(tiny_text_config(vocab_size=101, max_position_embeddings=128) | config))
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    api_hf.use_mode_attention(model)
    return model


def test_hf_model_rollout_equals_training_bitwise_with_mode_on(seed):
    torch.manual_seed(seed)
    model = _tiny_qwen3()
    seqs = chain.fixed_sequences(101, 5, 7, 14, seed)
    batch = parity.from_sequences(seqs, "right", [0] * 5, 0)
    with torch.no_grad():
        with rk.batch_invariant():
            training = hf.training_logprobs(model, batch)
            rollout = hf.rollout_logprobs(model, seqs, 5, 2, pad_id=0)
            alone = hf.training_logprobs(model, parity.from_sequences(seqs[3:4], "right", [0], 0))
        off = chain.max_abs_diff(hf.rollout_logprobs(model, seqs, 5, 2, pad_id=0), hf.training_logprobs(model, batch))
    for b, (r, t) in enumerate(zip(rollout, training)):
        assert r.shape == (len(seqs[b]) - 1,) and torch.equal(r, t), f"sequence {b}: rollout and training differ"
    assert torch.equal(alone[0], training[3])
    print(f"mode off: rollout vs training max |diff| {off:.3g}")
    assert off < 1e-3


def test_hf_model_packed_row_equals_padded_batch_bitwise_with_mode_on(seed):
    """Sequences packed back to back in one row, position ids restarting at 0 and no attention mask
    (verl's ``use_remove_padding`` layout), give each token the bits of the padded batch."""
    torch.manual_seed(seed)
    model = _tiny_qwen3()
    seqs = chain.fixed_sequences(101, 5, 1, 14, seed)
    seqs[2] = seqs[2][:1]  # a one-token sequence between two others
    padded = parity.from_sequences(seqs, "right", [0] * 5, 0)
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad(), rk.batch_invariant():
        rows = model(
            input_ids=padded.input_ids, attention_mask=padded.attention_mask, position_ids=padded.position_ids
        ).logits
        packed = model(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False).logits[0]
        with rk.batch_invariant(False):
            packed_off = model(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False).logits[0]
    assert torch.equal(packed, torch.cat([rows[b, : len(s)] for b, s in enumerate(seqs)]))
    # mode off, sdpa on transformers' packed mask: the same sequences (within the contract)
    assert_close(packed_off, packed, "logprob", torch.float32, name="packed logits, mode off vs on")


def test_hf_mode_attention_reads_a_forwards_layout_once(seed, monkeypatch):
    """The padded and the packed layouts' offsets (host reads) are computed once per forward, not
    per layer: kept on the mask / position-ids tensor every layer receives; a new forward, or the
    same mask changed in place, computes them again."""
    torch.manual_seed(seed)
    model = _tiny_qwen3()  # 2 layers
    calls = {"padded": 0, "packed": 0}
    for name in calls:
        original = getattr(api_hf, f"_{name}_layout" if name == "padded" else "_packed_offsets")

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(api_hf, f"_{name}_layout" if name == "padded" else "_packed_offsets", counted)
    seqs = chain.fixed_sequences(101, 5, 3, 9, seed)
    batch = parity.from_sequences(seqs, "left", [0] * 5, 0)
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad(), rk.batch_invariant():
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        assert calls["padded"] == 1, calls
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        assert calls["padded"] == 2, calls  # a new forward builds a new mask
        calls["packed"] = 0  # the padded forwards asked too (several rows: not packed)
        model(input_ids=ids, attention_mask=None, position_ids=positions, use_cache=False)
    assert calls["packed"] == 1, calls
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    q = torch.randn(2, 4, 4, 16)
    kv = torch.randn(2, 2, 4, 16)
    with rk.batch_invariant():
        api_hf.mode_attention(model.model.layers[0].self_attn, q, kv, kv, mask)
        api_hf.mode_attention(model.model.layers[0].self_attn, q, kv, kv, mask)
        assert calls["padded"] == 3, calls
        mask[1, 0, -1, 0] = False  # changed in place: a new layout
        api_hf.mode_attention(model.model.layers[0].self_attn, q, kv, kv, mask)
    assert calls["padded"] == 4, calls


def test_row_parallel_split_computes_a_two_rank_engines_sum(seed):
    """``use_row_parallel_split(model, 2)``: each decoder layer's o_proj and down_proj give, bit for
    bit under the mode, the model-dtype sum of two ranks' products (each rank's contiguous half of
    the input features and of the weight's columns, as a TP=2 engine holds them); the unsplit layer
    up to their roundings; 1 changes nothing; what it cannot reproduce is refused."""
    torch.manual_seed(seed)
    model = _tiny_qwen3().to(torch.bfloat16)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features).to(torch.bfloat16)
    with torch.no_grad(), rk.batch_invariant():
        whole = layer(x)
        assert api_hf.use_row_parallel_split(model, 1) == []
        assert torch.equal(layer(x), whole)
        names = api_hf.use_row_parallel_split(model, 2)
        assert names == [f"model.layers.{i}.{m}" for i in range(2) for m in api_hf.ROW_PARALLEL], names
        split = layer(x)
        half = layer.in_features // 2
        ranks = [
            torch.nn.functional.linear(
                x[..., r * half : (r + 1) * half].contiguous(), layer.weight[:, r * half : (r + 1) * half].clone()
            )
            for r in (0, 1)
        ]
    assert torch.equal(split, ranks[1] + ranks[0])
    # the unsplit layer up to the halves' extra bf16 roundings (eps 2**-8 each)
    assert (split.float() - whole.float()).abs().max() <= 4 * 2**-8 * whole.float().abs().max()
    with pytest.raises(ValueError, match="parts=3 does not divide the model's num_attention_heads=4"):
        api_hf.use_row_parallel_split(model, 3)
    biased = _tiny_qwen3()
    biased.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match="model.layers.1.self_attn.o_proj: a row-parallel linear with a bias"):
        api_hf.use_row_parallel_split(biased, 2)


def test_hf_mode_attention_packs_an_unpadded_batch_as_it_is(seed):
    """A decode step whose batch has no padding (or no mask) takes the batch's own layout (no
    gather, no scatter); its rows get the bits they get in a padded batch, which packs them."""
    torch.manual_seed(seed)
    module = torch.nn.Module()
    q = torch.randn(4, 4, 1, 16)
    k, v = torch.randn(4, 2, 9, 16), torch.randn(4, 2, 9, 16)
    full = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    padded = torch.ones(4, 1, 1, 9, dtype=torch.bool)
    padded[3, 0, 0, :4] = False  # a left-padded fourth row
    assert api_hf._padded_layout(full, 3, 1, 9)[:2] == (None, None)
    assert api_hf._padded_layout(padded, 4, 1, 9)[0] is not None
    with rk.batch_invariant():
        dense, _ = api_hf.mode_attention(module, q[:3], k[:3], v[:3], full)
        no_mask, _ = api_hf.mode_attention(module, q[:3], k[:3], v[:3], None)
        gathered, _ = api_hf.mode_attention(module, q, k, v, padded)
    assert torch.equal(dense, gathered[:3])
    assert torch.equal(no_mask, dense)


def test_hf_mode_attention_refuses_a_sliding_window():
    model = _tiny_qwen3(
        num_hidden_layers=1,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
        layer_types=["sliding_attention"],
    )
    with (
        torch.no_grad(),
        rk.batch_invariant(),
        pytest.raises(ValueError, match="no sliding window; got sliding_window=4"),
    ):
        model(input_ids=torch.ones(1, 6, dtype=torch.long))


def _cli(monkeypatch, capsys, *extra):
    from rl_kernel_core.tools import cli

    code = cli.main([*_SMALL_RUN, "--max-len", "10", *extra])
    return code, capsys.readouterr().out


def test_cli_failure_names_the_first_divergent_module_and_exits_1(monkeypatch, capsys):
    """A fault that only decode steps see (one token per sequence reaches the layer): mode on is
    no longer bitwise, the run fails, and the probe names the faulty module."""
    original = run.load

    def faulty(settings):
        subject = original(settings)
        subject.model.layers[1].up_proj.register_forward_hook(
            lambda m, inputs, out: out + 1e-3 if inputs[0].shape[0] <= settings.rollout_batch else out
        )
        return subject

    monkeypatch.setattr(run, "load", faulty)
    code, out = _cli(monkeypatch, capsys, "--json")
    report = json.loads(out)
    assert code == 1 and report["passed"] is False
    on = report["modes"]["on"]
    assert not on["bitwise_equal"] and not on["passed"] and on["max_abs_diff"] > 0
    assert on["first_divergent"]["module"] == "layers.1.up_proj", on["first_divergent"]
    code, out = _cli(monkeypatch, capsys)
    assert code == 1 and "first divergent module (on): layers.1.up_proj" in out and out.rstrip().endswith("FAILED")


def test_cli_stops_at_an_input_parity_mismatch(monkeypatch, capsys):
    original = run.Subject.batches

    def shifted(self, seqs):
        rollout, training = original(self, seqs)
        training.position_ids[1] += 1
        return rollout, training

    monkeypatch.setattr(run.Subject, "batches", shifted)
    code, out = _cli(monkeypatch, capsys, "--json")
    report = json.loads(out)
    assert code == 1 and report["passed"] is False and report["modes"] == {}
    assert report["parity"].startswith("position ids") and "sequence 1" in report["parity"], report["parity"]


def test_comparison_against_the_contract():
    """Per-token differences at the contract bound pass (and their k3 sits at the KL bound); twice
    the bound fails both."""
    from rl_kernel_core import contract

    training = [torch.tensor([-0.5, -3.0, -12.0]), torch.tensor([-1.0])]
    tol = contract.tolerance("logprob", torch.float32)
    at_bound = [t + 0.999 * (tol.atol + tol.rtol * t.abs()) for t in training]
    result = run._compare(at_bound, training, torch.float32)
    assert result["within_contract"] and not result["bitwise_equal"] and result["kl_k3"] <= result["kl_k3_bound"]
    twice = [t - 2 * (tol.atol + tol.rtol * t.abs()) for t in training]
    result = run._compare(twice, training, torch.float32)
    assert not result["within_contract"] and result["kl_k3"] > result["kl_k3_bound"]
    assert run._compare(training, training, torch.float32)["bitwise_equal"]


def test_cli_parity_of_saved_batches(tmp_path, capsys):
    from rl_kernel_core.tools import cli

    rollout, training = _batches()
    paths = [str(tmp_path / "rollout.pt"), str(tmp_path / "training.pt")]
    parity.save(rollout, paths[0])
    parity.save(training, paths[1])
    assert cli.main(["consistency", "--parity", *paths]) == 0
    assert capsys.readouterr().out.strip() == "input parity: ok"
    training.loss_mask[1, 0] = 0
    parity.save(training, paths[1])
    assert cli.main(["consistency", "--parity", *paths, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["parity"].startswith("loss mask differs at sequence 1, token 0")
    torch.save({"input_ids": training.input_ids.float(), "padding_side": "right"}, paths[1])
    assert cli.main(["consistency", "--parity", *paths]) == 2
    err = capsys.readouterr().err
    assert "training.pt: input_ids must be an integer tensor [B, L], got a torch.float32 tensor" in err, err


def test_cli_parity_of_files_that_are_not_saved_batches(tmp_path, capsys):
    """A pickled Batch is read; anything else exits 2 with one line naming the file and field,
    without unpickling arbitrary objects or materialising an expanded tensor."""
    from dataclasses import asdict

    from rl_kernel_core.tools import cli

    rollout, training = _batches()
    good, bad = str(tmp_path / "rollout.pt"), str(tmp_path / "training.pt")
    parity.save(rollout, good)
    torch.save(training, bad)
    assert cli.main(["consistency", "--parity", good, bad]) == 0
    capsys.readouterr()
    expanded = {**asdict(training), "loss_mask": torch.zeros(1, 1, dtype=torch.long).expand(10**6, 10**6)}
    cases = [
        (b"not a torch file", "training.pt: not a batch written by rl_kernel_core.tools.consistency.parity.save"),
        (
            b"",
            "training.pt: not a batch written by rl_kernel_core.tools.consistency.parity.save or rl_kernel_core.tools.multimodal.storage.save (torch.load with weights_only=True failed: EOFError)",
        ),
        (
            {"x": torch.nn.Linear(1, 1)},
            "training.pt: not a batch written by rl_kernel_core.tools.consistency.parity.save",
        ),
        (
            expanded,
            "training.pt: loss_mask must be a dense tensor, got shape (1000000, 1000000) over 1 stored elements",
        ),
        (
            {**asdict(training), "special_tokens": {"pad": torch.tensor([0, 1])}},
            "training.pt: special_tokens['pad'] must be an int token id, got Tensor",
        ),
    ]
    for content, message in cases:
        if isinstance(content, bytes):
            with open(bad, "wb") as f:
                f.write(content)
        else:
            torch.save(content, bad)
        assert cli.main(["consistency", "--parity", good, bad]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert cli.main(["consistency", "--parity", good, str(tmp_path / "missing.pt")]) == 2
    assert "--parity " + str(tmp_path / "missing.pt") + ": cannot be read: No such file" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_cli_parity_refuses_sparse_and_stride_0_tensors_and_fifos(tmp_path, capsys):
    """The text loader shares the multimodal one's refusals (rl_kernel_core.tools.consistency.parity's
    open_regular and stored_tensor_problem): a sparse or quantized tensor, a stride-0 view whose
    storage holds as many elements as the view, and a FIFO exit 2 with one line naming the file
    (a FIFO at once: the CLI runs in a subprocess with a timeout, so a hang fails the test)."""
    import os
    from dataclasses import asdict

    from rl_kernel_core.tools import cli

    rollout, training = _batches()
    good, bad = str(tmp_path / "rollout.pt"), str(tmp_path / "training.pt")
    parity.save(rollout, good)
    fields = asdict(training)
    mask = fields["loss_mask"]
    wide = torch.zeros(mask.numel(), dtype=torch.long)[: mask.shape[1]].expand_as(mask)  # storage as large as the view
    cases = [
        (
            {**fields, "loss_mask": mask.to_sparse()},
            "training.pt: loss_mask must be a dense tensor, got layout sparse_coo",
        ),
        (
            {**fields, "attention_mask": fields["attention_mask"].to_sparse_csr()},
            "training.pt: attention_mask must be a dense tensor, got layout sparse_csr",
        ),
        (
            {**fields, "loss_mask": wide},
            f"training.pt: loss_mask must be a dense tensor, got shape {tuple(mask.shape)} over ",
        ),
    ]
    for content, message in cases:
        torch.save(content, bad)
        assert cli.main(["consistency", "--parity", good, bad]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    if hasattr(os, "mkfifo"):
        fifo = str(tmp_path / "fifo.pt")
        os.mkfifo(fifo)
        proc = subprocess.run(
            [sys.executable, "-m", "rl_kernel_core.cli", "consistency", "--parity", good, fifo],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"--parity {fifo}: must be a regular file holding a saved batch, got a FIFO" in proc.stderr
        with pytest.raises(ValueError, match="fifo.pt: must be a regular file holding a saved batch, got a FIFO"):
            parity.load(fifo)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--engine", "vllm"], "--engine vllm needs --model PATH"),
        (
            ["--engine", "vllm", "--model", "m", "--engine-args", "{bad"],
            "argument --engine-args: must be a JSON object",
        ),
        (["--engine", "vllm", "--model", "m", "--engine-args", "[1]"], "argument --engine-args: must be a JSON object"),
    ],
)
def test_engine_mode_refuses_bad_input_in_one_line(argv, message, capsys):
    from rl_kernel_core.tools import cli

    pytest.importorskip("rl_kernel_vllm.consistency")
    try:
        code: object = cli.main(["consistency", *argv])
    except SystemExit as exc:  # argparse's refusal
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err.splitlines()[-1]
