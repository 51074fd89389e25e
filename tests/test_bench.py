"""The benchmark commands run and report sound figures (no timing is asserted: they only print)."""

from __future__ import annotations

import json

import pytest
import torch

from diff_transformer.bench.attention import (
    AttentionBenchSettings,
    attention_flops,
    plan,
    quadratic_bytes,
    run_attention_bench,
    visible_pairs,
)
from diff_transformer.bench.measure import peak_memory
from diff_transformer.bench.model import (
    ModelBenchSettings,
    diffllama_config,
    format_table,
    model_config,
    run_model_bench,
)
from diff_transformer.cli import main
from diff_transformer.model import LanguageModel


def test_visible_pairs():
    assert visible_pairs(4, 4, causal=False) == 16
    assert visible_pairs(4, 4, causal=True) == 10  # 1 + 2 + 3 + 4
    assert visible_pairs(2, 5, causal=True) == 4 + 5  # queries at positions 3 and 4
    assert visible_pairs(1, 7, causal=True) == 7


def test_flop_formulas_follow_spec_units():
    """The paper's FLOP count, in units of h·N²·d: standard fwd 4, bwd 10; fused DIFF fwd 6, bwd 10; causal ~halves."""
    kw = dict(batch=2, heads=8, t=128, s=128, head_dim=64, causal=False)
    unit = 2 * 8 * 128 * 128 * 64
    assert attention_flops("standard", "fwd", **kw) == 4 * unit
    assert attention_flops("standard", "fwd+bwd", **kw) == 14 * unit
    assert attention_flops("diff", "fwd", **kw) == 6 * unit
    assert attention_flops("diff", "fwd+bwd", **kw) == 16 * unit
    causal = attention_flops("diff", "fwd", **{**kw, "causal": True})
    assert causal == pytest.approx(3 * unit, rel=0.01)


def test_gda_flops_count_its_signal_and_noise_maps():
    """GDA with ratio r: H signal and H / r noise maps of DIFF's cost each, in units of the standard
    heads h = 2H: fwd 6·(1 + 1/r)/2, bwd 10·(1 + 1/r)/2; r = 1 is DIFF."""
    kw = dict(batch=1, heads=8, t=64, s=64, head_dim=32, causal=False)
    unit = 8 * 64 * 64 * 32
    assert attention_flops("gda", "fwd", gda_ratio=1, **kw) == attention_flops("diff", "fwd", **kw)
    assert attention_flops("gda", "fwd", gda_ratio=4, **kw) == pytest.approx(6 * 1.25 / 2 * unit)
    assert attention_flops("gda", "fwd+bwd", gda_ratio=2, **kw) == pytest.approx(16 * 1.5 / 2 * unit)


def test_attention_bench_measures_gda_beside_diff():
    settings = AttentionBenchSettings(lengths=(32,), heads=8, kv_heads=2, head_dim=16, repeats=1, warmup=0,
                                      kinds=("standard", "diff", "gda"), gda_ratio=2,
                                      backends=("reference", "sdpa", "sdpa_split", "math", "decode"),
                                      measure_memory=False)
    results = run_attention_bench(settings, progress=False)
    gda = {(r.mode, r.backend): r for r in results if r.kind == "gda"}
    assert {b for _, b in gda} == {"reference", "sdpa", "sdpa_split", "math", "decode"}
    assert all(r.seconds > 0 for r in gda.values())
    with pytest.raises(ValueError, match="gda_ratio=3 must divide the signal heads"):
        AttentionBenchSettings(heads=8, kinds=("gda",), gda_ratio=3)
    with pytest.raises(ValueError, match="gda_ratio applies to kind 'gda'"):
        AttentionBenchSettings(heads=8, gda_ratio=2)


def test_model_bench_measures_the_imported_architectures():
    settings = ModelBenchSettings(preset="debug", length=16, decode_tokens=3, repeats=1, warmup=0, compare_hf=False,
                                  architectures=("standard", "gda", "motif-2.6b", "motif-2-12.7b"))
    results = run_model_bench(settings, progress=False)
    assert [r.model for r in results] == ["Transformer", "GDA", "Motif-2.6B arch", "Motif-2-12.7B arch"]
    for r in results:
        assert r.train_tokens_per_s > 0 and r.prefill_tokens_per_s > 0 and r.decode_tokens_per_s > 0
    big = model_config(settings, "motif-2-12.7b")
    assert (big.attention, big.gda_ratio, big.n_heads, big.n_kv_heads, big.ffn_activation) == ("gda", 4, 4, 1,
                                                                                                "polynorm")
    assert "Motif-2-12.7B arch vs Transformer (throughput ratio), eager: train" in format_table(settings, results)
    with pytest.raises(ValueError, match="architectures must be distinct names"):
        ModelBenchSettings(architectures=("diff", "llama"))


def test_motif_12_7b_proportions_at_its_own_size():
    """At d_model 4096 and d 128 the rule gives Motif-2-12.7B's heads: 32 signal, 8 noise, 8 K/V groups."""
    from diff_transformer.bench.model import architecture_fields

    settings = ModelBenchSettings(preset="6.8b", length=16, decode_tokens=3)  # d_model 4096, 16 DIFF heads of 128
    fields = architecture_fields(settings, "motif-2-12.7b")
    assert (fields["n_heads"], fields["n_kv_heads"], fields["attn_head_dim"]) == (32, 8, 128)


def test_reference_maps_are_counted_and_skipped_over_budget():
    cpu = torch.device("cpu")
    # one fp32 map over 8 DIFF heads at 16K tokens: 8 GiB; the reference keeps about six
    need = quadratic_bytes("diff", "reference", "fwd", cpu, batch=1, heads=16, t=16384, s=16384)
    assert need == 6 * 8 * 16384**2 * 4
    assert quadratic_bytes("diff", "sdpa_split", "fwd", cpu, batch=1, heads=16, t=16384, s=16384) == 0
    # "math" keeps its two fp32 maps per DIFF head for the backward only
    assert quadratic_bytes("diff", "math", "fwd+bwd", cpu, batch=2, heads=16, t=4096, s=4096) == 2 * 2 * 8 * 4096**2 * 4
    assert quadratic_bytes("diff", "math", "fwd", cpu, batch=2, heads=16, t=4096, s=4096) == 0
    settings = AttentionBenchSettings(
        lengths=(64,), heads=4, head_dim=16, backends=("reference", "sdpa_split"), modes=("fwd",),
        repeats=1, warmup=0, measure_memory=False, memory_budget_gib=1e-6,
    )
    results = {r.backend: r for r in run_attention_bench(settings, progress=False) if r.kind == "diff"}
    assert results["reference"].seconds is None and "skipped" in results["reference"].note
    assert results["sdpa_split"].seconds > 0


def test_attention_bench_measures_every_case():
    settings = AttentionBenchSettings(lengths=(48,), heads=4, kv_heads=2, head_dim=16, repeats=1, warmup=0)
    results = run_attention_bench(settings, progress=False)
    assert len(results) == len(plan(settings))
    cases = {(r.mode, r.kind, r.backend) for r in results}
    assert ("decode", "diff", "decode") in cases and ("fwd", "diff", "decode") not in cases
    for r in results:
        if r.backend == "triton":  # no GPU here: noted, not measured
            assert r.seconds is None and "CUDA" in r.note
            continue
        assert r.seconds > 0 and r.tflops > 0 and r.peak_bytes >= 0, r


def test_cpu_peak_memory_sees_a_large_temporary():
    """The profiler-based CPU peak counts a 64 MiB temporary freed inside the call."""

    def make_and_drop():
        x = torch.ones(16 * 2**20)  # 64 MiB of fp32
        return float(x[0])

    assert 64 * 2**20 <= peak_memory(make_and_drop, torch.device("cpu")) < 70 * 2**20


@pytest.mark.slow  # builds transformers' DiffLlama (2 s)
def test_diffllama_has_the_same_shape():
    """Built from our DIFF config, DiffLlama holds our parameters minus the head-norm weights
    (2d per layer: HF's head norm has no weight)."""
    pytest.importorskip("transformers")
    from transformers import DiffLlamaForCausalLM

    config = model_config(ModelBenchSettings(preset="debug", length=16, decode_tokens=4), "diff")
    ours = LanguageModel(config, device="meta").num_parameters()
    theirs = sum(p.numel() for p in DiffLlamaForCausalLM(diffllama_config(config)).parameters())
    assert theirs == ours - 2 * config.head_dim * config.n_layers


def test_model_bench_runs():
    settings = ModelBenchSettings(preset="debug", length=16, decode_tokens=3, repeats=1, warmup=0)
    results = run_model_bench(settings, progress=False)
    names = [r.model for r in results]
    assert names[:2] == ["DIFF", "Transformer"]
    for r in results:
        assert r.train_tokens_per_s > 0 and r.prefill_tokens_per_s > 0 and r.decode_tokens_per_s > 0


@pytest.mark.slow  # torch.compile traces every phase
def test_model_bench_measures_eager_and_compiled_in_one_run(monkeypatch):
    """With compile, both of our models are measured eager and compiled (training, prefill and
    decoding), DiffLlama once, and both ratio lines are printed. torch.compile is given the
    aot_eager backend here: the same tracing, without inductor's minutes of C++ compilation."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, backend="aot_eager"))
    settings = ModelBenchSettings(preset="debug", length=16, decode_tokens=3, repeats=1, compile=True)
    results = run_model_bench(settings, progress=False)
    rows = [(r.model, r.compiled) for r in results]
    assert (rows[:2] == [("DIFF", False), ("Transformer", False)]
            and rows[-2:] == [("DIFF", True), ("Transformer", True)])
    assert ("DiffLlama (transformers)", True) not in rows
    for r in results:
        assert r.train_tokens_per_s > 0 and r.prefill_tokens_per_s > 0 and r.decode_tokens_per_s > 0
    table = format_table(settings, results)
    assert "DIFF vs Transformer (throughput ratio), eager: train" in table
    assert "DIFF vs Transformer (throughput ratio), compiled: train" in table
    if ("DiffLlama (transformers)", False) in rows:
        assert "DIFF vs DiffLlama (throughput ratio; DiffLlama eager), compiled DIFF: train" in table


def test_model_bench_settings_errors():
    with pytest.raises(ValueError, match="compile needs warmup >= 1"):
        ModelBenchSettings(compile=True, warmup=0)
    with pytest.raises(ValueError, match="decode_tokens must be >= 2"):
        ModelBenchSettings(decode_tokens=1)
    with pytest.raises(ValueError, match=r"length 100,000 is beyond the context of preset 'tiny' \(256 tokens"):
        ModelBenchSettings(length=100_000)  # ran for hours before
    ModelBenchSettings(preset="small", length=1024, decode_tokens=32)  # bench gpu's: the decoded tokens run past it
    with pytest.raises(ValueError, match="backend 'decode' takes one query per sequence"):
        ModelBenchSettings(backend="decode")
    with pytest.raises(ValueError, match="backend 'triton' \\(the fused kernel\\) needs a CUDA device, not 'cpu'"):
        ModelBenchSettings(backend="triton")


def test_model_bench_refuses_what_would_not_fit_in_memory_before_building_it(monkeypatch):
    from diff_transformer.bench import model as bench_model

    settings = ModelBenchSettings(preset="debug", length=16, decode_tokens=3, compare_hf=False)
    need = bench_model.planned_bytes(settings)
    # a floor counted by hand from the models themselves: weights, gradients and two AdamW states of both
    floor = sum(4 * 4 * LanguageModel(model_config(settings, kind), device="meta").num_parameters()
                for kind in ("diff", "standard"))
    assert floor <= need < 2 * floor + 16 * 512 * 4 * 3 * 2
    monkeypatch.setattr(bench_model, "memory_budget", lambda device: need - 1)
    built = []  # the devices models were built on: "meta" (counted, no memory) only

    def spy(config, **kwargs):
        built.append(str(kwargs.get("device")))
        return LanguageModel(config, **kwargs)

    monkeypatch.setattr(bench_model, "LanguageModel", spy)
    with pytest.raises(ValueError,
                       match=r"bench model --preset debug --length 16 --batch 1 needs about 0\.0 GiB on cpu"):
        bench_model.run_model_bench(settings, progress=False)
    assert built and set(built) == {"meta"}


def test_cli_json(capsys):
    args = ["bench", "attention", "--device", "cpu", "--lengths", "32", "--heads", "4", "--head-dim", "16",
            "--backends", "sdpa_split", "decode", "--modes", "fwd", "decode", "--repeats", "1", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "attention" and out["machine"]["device"] == "cpu"
    rows = {(r["mode"], r["kind"], r["backend"]) for r in out["results"]}
    assert rows == {("fwd", "standard", "sdpa"), ("fwd", "diff", "sdpa_split"), ("decode", "standard", "sdpa"),
                    ("decode", "diff", "sdpa_split"), ("decode", "diff", "decode")}


def test_cli_table(capsys):
    args = ["bench", "model", "--preset", "debug", "--length", "16", "--decode-tokens", "3", "--repeats", "1",
            "--warmup", "0", "--no-hf"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "DIFF vs Transformer" in out and "DiffLlama" not in out


@pytest.mark.slow  # flex attention compiled (4 s)
def test_flex_in_every_mode_is_a_table_with_the_cells_it_cannot_run_marked(capsys):
    """FlexAttention has no CPU backward: its fwd+bwd cell says so; the others are measured (exit 0)."""
    args = ["bench", "attention", "--device", "cpu", "--lengths", "32", "--heads", "4", "--head-dim", "16",
            "--backends", "flex", "--modes", "fwd", "fwd+bwd", "decode", "--repeats", "1", "--no-memory"]
    assert main(args) == 0
    rows = {tuple(line.split()[:3]): line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("fwd", "decode"))}
    assert rows[("fwd+bwd", "diff", "flex")].endswith("FlexAttention has no backward on the cpu")
    for mode in ("fwd", "decode"):
        assert rows[(mode, "diff", "flex")].split()[5] != "-"  # measured


def test_mta_and_xsa_flops_by_hand():
    """XSA counts as standard attention; MTA adds per visible pair and head 2·(2·6·11) for its convolutions
    and 2·(2h) for its head mixings, three times that with the backward."""
    kw = dict(batch=2, heads=8, t=128, s=128, head_dim=64, causal=False)
    pairs = 2 * 8 * 128 * 128
    assert attention_flops("xsa", "fwd+bwd", **kw) == attention_flops("standard", "fwd+bwd", **kw)
    assert attention_flops("mta", "fwd", **kw) == pairs * (4 * 64 + 264 + 32)
    assert attention_flops("mta", "fwd+bwd", **kw) == pairs * (14 * 64 + 3 * (264 + 32))
    cpu = torch.device("cpu")
    assert quadratic_bytes("mta", "fast", "fwd+bwd", cpu, batch=1, heads=8, t=64, s=64) == 10 * 8 * 64**2 * 4


def test_attention_bench_measures_mta_and_xsa():
    """MTA's decoding step computes the new row and the 10 rows its convolutions read."""
    settings = AttentionBenchSettings(lengths=(48,), heads=4, kv_heads=2, head_dim=16, repeats=1, warmup=0,
                                      kinds=("standard", "mta", "xsa"), backends=())
    results = run_attention_bench(settings, progress=False)
    cases = {(r.mode, r.kind, r.backend): r for r in results}
    assert set(cases) == {(m, k, b) for m in ("fwd", "fwd+bwd", "decode")
                          for k, b in (("standard", "sdpa"), ("mta", "fast"), ("xsa", "sdpa"))}
    assert cases[("decode", "mta", "fast")].queries == 11 and cases[("decode", "xsa", "sdpa")].queries == 1
    assert all(r.seconds > 0 and r.tflops > 0 for r in results)
    with pytest.raises(ValueError, match=r"unknown kind\(s\) \['linear'\]"):
        AttentionBenchSettings(kinds=("linear",))


def test_model_bench_measures_further_kinds_with_their_ratios(capsys):
    settings = ModelBenchSettings(preset="debug", length=16, decode_tokens=3, repeats=1, warmup=0, compare_hf=False,
                                  architectures=("diff", "standard", "mta", "xsa"))
    results = run_model_bench(settings, progress=False)
    assert [r.model for r in results] == ["DIFF", "Transformer", "MTA", "XSA"]
    assert results[2].parameters == LanguageModel(model_config(settings, "mta"), device="meta").num_parameters()
    table = format_table(settings, results)
    assert "MTA vs Transformer (throughput ratio), eager: train" in table
    assert "XSA vs Transformer (throughput ratio), eager: train" in table
    with pytest.raises(ValueError, match="architectures must be distinct names among"):
        ModelBenchSettings(architectures=("mta", "mta"))
    assert main(["bench", "model", "--architectures", "mta", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "invalid choice: 'bogus'" in err


@pytest.mark.slow  # torch.compile of every model
def test_model_bench_lets_every_compiled_model_keep_its_graphs(monkeypatch):
    """Four models compiled share LanguageModel.forward's graph cache: while measuring, dynamo's recompile
    limit leaves room for each model's training, prefill and decoding graphs (at 8, the fourth model's
    prefill ran eager). torch.compile is replaced here by a model that records the limit when called."""
    seen = []

    def recording(model, **kw):
        def call(*args, **kwargs):
            seen.append(torch._dynamo.config.recompile_limit)
            return model(*args, **kwargs)
        return call

    monkeypatch.setattr(torch, "compile", recording)
    settings = ModelBenchSettings(preset="debug", length=16, decode_tokens=3, repeats=1, compile=True,
                                  compare_hf=False, architectures=("diff", "standard", "mta", "xsa"))
    run_model_bench(settings, progress=False)
    assert seen and min(seen) >= 3 * 4
    assert torch._dynamo.config.recompile_limit == 8  # restored


def test_train_bench_measures_the_trainers_step_at_each_batch():
    from diff_transformer.experiments.train_bench import TrainBenchSettings, format_table, parse_model, run_train_bench

    settings = TrainBenchSettings(models=("scaling:diff@w8", "scaling:standard@w8"), batches=(2, 4), steps=1,
                                  repeats=1, warmup=1, previous=True)
    results = run_train_bench(settings, progress=False)
    assert {(r.model, r.mode, r.batch) for r in results} == {
        (m, mode, b) for m in settings.models for mode in ("eager", "previous") for b in (2, 4)}
    assert all(r.tokens_per_s > 0 and r.seq_len == 128 for r in results)
    table = format_table(settings, results)
    assert "eager / previous step (throughput ratio):" in table and "scaling:diff@w8" in table
    assert parse_model("scaling:diff_v2@l") == ("scaling", "diff_v2", "l")
    assert parse_model("tiny:diff") == ("tiny", "diff", None)
    with pytest.raises(ValueError, match="CONFIG:MODEL"):
        TrainBenchSettings(models=("diff",))
