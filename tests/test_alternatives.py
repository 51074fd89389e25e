"""The alternatives study (configs/alternatives.yaml): every model's shape at the tiny preset and in the
small retrieval and grounded models, its parameters against a hand count, a model entry's small_model
fields and their errors, and a run of the whole study with every model at a budget of seconds."""

import json

import pytest

from diff_transformer.config import ConfigError
from diff_transformer.experiments import load_experiment
from diff_transformer.experiments.config import experiment_from_dict
from diff_transformer.experiments.grounded import check_grounded
from diff_transformer.experiments.retrieval import check_retrieval, retrieval_fields
from diff_transformer.model import LanguageModel

CONFIG = load_experiment("alternatives")
MODELS = ["standard", "diff", "diff_v2", "gated", "gda", "mta", "xsa", "standard-wide"]


def hand_count(vocab: int, d_model: int, layers: int, ffn: int, attention: int) -> int:
    """Embedding and LM head (untied), per layer its attention weights, the SwiGLU's three matrices and
    two norms, and the final norm."""
    return 2 * vocab * d_model + layers * (attention + 3 * d_model * ffn + 2 * d_model) + d_model


def gda_attention(d_model: int, signal: int, noise: int, d: int) -> int:
    """GDA's weights, written out: q (signal + noise)·d, K1/K2 and the 2d-wide value of one K/V group per
    noise head, o_proj from the signal heads' 2d outputs, DIFF's four λ vectors (d) and head norm (2d)."""
    return (d_model * (signal + noise) * d + d_model * 2 * noise * d + d_model * noise * 2 * d
            + signal * 2 * d * d_model + 4 * d + 2 * d)


def small(section, name, recipe="scaled-init"):
    return section.model_config(CONFIG.attention(name), diff_heads=CONFIG.train.model(name).diff_heads,
                                **retrieval_fields(CONFIG, name, recipe))


def test_the_study_holds_every_kind_issue_47_names_each_at_the_same_grid_and_seeds():
    assert CONFIG.compare.models == MODELS
    kinds = {CONFIG.attention(n) for n in MODELS}
    assert kinds == {"standard", "diff", "diff_v2", "gated", "gda", "mta", "xsa"}
    assert CONFIG.compare.seeds >= 3
    assert CONFIG.retrieval.enabled and CONFIG.grounded.enabled
    assert {"outliers", "attention-sink"} <= set(CONFIG.compare.evaluations)
    assert not CONFIG.compare.evaluation_models  # every model
    for name in MODELS:  # the same search: every model at its best of one grid in each experiment
        assert CONFIG.lr_for(name, "scaled-init", "lm") in (1e-3, 2e-3, 4e-3)
        assert name in CONFIG.retrieval.lr_by_model and name in CONFIG.grounded.lr_by_model
        assert {CONFIG.lr_for(name, "scaled-init", task) for task in ("retrieval", "grounded")} <= {1e-3, 2e-3}


@pytest.mark.slow  # builds every size (5 s)
def test_gda_takes_motif_2_12_7bs_proportions_at_each_size():
    """4 signal heads per noise head, the signal queries as wide as d_model, a K/V group per noise head: in
    the language models (d_model 96, 2 layers, bytes) 4 + 1 heads of 24, in the small models 4 + 1 of 16;
    parameters by hand, within 2.1% of the Transformer's (also by hand: 4·d_model² attention weights a layer)."""
    lm = CONFIG.train.model("gda").model_config()
    assert (lm.n_heads, lm.n_noise_heads, lm.n_kv_heads, lm.head_dim, lm.gda_ratio) == (4, 1, 1, 24, 4)
    assert lm.n_heads * lm.head_dim == lm.d_model
    ours = LanguageModel(lm, device="meta").num_parameters()
    assert ours == hand_count(257, 96, 2, 256, gda_attention(96, 4, 1, 24)) == 275_904
    transformer = hand_count(257, 96, 2, 256, 4 * 96 * 96)
    assert LanguageModel(CONFIG.train.model("standard").model_config(), device="meta").num_parameters() == transformer
    assert 0 < ours / transformer - 1 < 0.021
    for section, vocab, expected in ((CONFIG.retrieval, 100, 121_856), (CONFIG.grounded, 60, 116_736)):
        model = small(section, "gda")
        assert (model.n_heads, model.n_noise_heads, model.head_dim, model.d_model, model.n_layers) == (4, 1, 16, 64, 2)
        count = LanguageModel(model, device="meta").num_parameters()
        assert count == hand_count(vocab, 64, 2, 192, gda_attention(64, 4, 1, 16)) == expected
        assert 0 < count / hand_count(vocab, 64, 2, 192, 4 * 64 * 64) - 1 < 0.021


def test_mta_has_its_convolutions_on_one_layer_at_every_size():
    """mta_conv_every 2 in every model of the study, all of 2 layers (layer 1 of 2), where the authors'
    rule (l % 4 == 2) would leave none."""
    lm = CONFIG.train.model("mta").model_config()
    assert [lm.mta_conv_layer(i) for i in range(lm.n_layers)] == [False, True]
    for section in (CONFIG.retrieval, CONFIG.grounded):
        model = small(section, "mta")
        assert [model.mta_conv_layer(i) for i in range(model.n_layers)] == [False, True]
        assert (model.mta_query_kernel, model.mta_key_kernel) == (6, 11)


def test_every_model_builds_in_every_experiment_and_the_others_keep_their_shapes():
    check_retrieval(CONFIG, MODELS)
    check_grounded(CONFIG, MODELS)
    shapes = {n: (small(CONFIG.retrieval, n).n_heads, small(CONFIG.retrieval, n).head_dim) for n in MODELS}
    assert shapes["diff"] == (1, 32) and shapes["standard-wide"] == (1, 64)
    for name in ("standard", "diff_v2", "gated", "mta", "xsa"):
        assert shapes[name] == (2, 32), name


def test_the_gpu_config_is_the_same_study_at_a_larger_size_with_more_seeds_and_steps():
    gpu = load_experiment("alternatives-gpu")
    assert gpu.compare.models == MODELS and gpu.compare.seeds > CONFIG.compare.seeds
    tokens = lambda c: c.train.run.steps * c.train.data.batch_size * c.train.data.seq_len  # noqa: E731
    assert len(gpu.compare.lr_grid) >= 2 and tokens(gpu) > 100 * tokens(CONFIG)
    assert gpu.train.run.steps * gpu.train.data.batch_size * gpu.train.data.seq_len == 1_000 * 256 * 1_024
    for name in MODELS:  # the same models, the same design decisions
        ours, theirs = gpu.train.model(name), CONFIG.train.model(name)
        assert (ours.attention, ours.diff_heads) == (theirs.attention, theirs.diff_heads), name
        for section, theirs_section in ((gpu.retrieval, CONFIG.retrieval), (gpu.grounded, CONFIG.grounded)):
            mine, cpu = small(section, name), small(theirs_section, name)
            assert ((mine.n_heads, mine.head_dim, [mine.mta_conv_layer(i) for i in range(mine.n_layers)])
                    == (cpu.n_heads, cpu.head_dim, [cpu.mta_conv_layer(i) for i in range(cpu.n_layers)])), name
    gda = gpu.train.model("gda").model_config()
    assert (gda.n_heads * gda.head_dim, gda.n_noise_heads, gda.n_kv_heads) == (gda.d_model, 2, 2)
    assert gpu.retrieval.steps > CONFIG.retrieval.steps and gpu.grounded.steps > CONFIG.grounded.steps
    check_retrieval(gpu, MODELS)
    check_grounded(gpu, MODELS)


def _with(**entry):
    data = CONFIG.to_dict()
    data["models"]["gda"] = {**data["models"]["gda"], **entry}
    return data


@pytest.mark.parametrize("entry, message", [
    ({"small_model": {"d_model": 32}}, "models.gda.small_model.d_model: the small models' experiments set d_model"),
    ({"small_model": {"attention": "diff"}}, "models.gda.small_model.attention"),
    ({"small_model": {"n_hedas": 4}}, "models.gda.small_model: unknown ModelConfig field 'n_hedas'"),
    ({"small_model": {"n_heads": "four"}}, "models.gda.small_model.n_heads"),
    ({"small_model": [4]}, "models.gda.small_model must be a mapping of ModelConfig fields"),
    ({"small_model": {"scale_residual_init": False}}, "models.gda.small_model.scale_residual_init: an init recipe"),
])
def test_a_bad_small_model_field_is_refused_by_name(entry, message):
    with pytest.raises(ConfigError, match=message):
        experiment_from_dict(_with(**entry))


def test_diff_heads_and_a_small_models_own_head_count_are_refused_together():
    data = CONFIG.to_dict()
    data["models"]["standard-wide"]["small_model"] = {"n_heads": 2}
    with pytest.raises(ConfigError, match="models.standard-wide.small_model.n_heads: models.standard-wide.diff_heads"):
        experiment_from_dict(data)


def test_a_model_the_small_size_cannot_hold_is_refused_naming_the_experiment_and_the_model():
    """Without its small_model, GDA 4:1 would get the experiments' 1 DIFF head: refused before any work."""
    config = experiment_from_dict(_with(small_model={}))
    with pytest.raises(ConfigError, match=r"retrieval: models.gda at the retrieval experiment's size: n_heads=1 "
                                          r"\(signal heads\) must be a multiple of gda_ratio=4"):
        check_retrieval(config, ["gda"])
    with pytest.raises(ConfigError, match="grounded: models.gda at the grounded experiment's size"):
        check_grounded(config, ["gda"])


def test_small_model_fields_round_trip_and_apply_over_the_entrys_own():
    config = experiment_from_dict(CONFIG.to_dict())
    assert config.train.model("gda").small_model == {"n_heads": 4, "attn_head_dim": 16}
    fields = retrieval_fields(config, "gda", "scaled-init")
    assert fields["n_heads"] == 4 and fields["attn_head_dim"] == 16 and fields["gda_ratio"] == 4
    assert retrieval_fields(config, "diff", None) == {}  # a model without small_model: as before
    overridden = load_experiment("alternatives", ["models.mta.small_model.mta_conv_every=1"])
    assert retrieval_fields(overridden, "mta", None) == {"mta_conv_every": 1}


@pytest.mark.slow  # the whole study, every model, at a budget of seconds
def test_the_alternatives_study_runs_every_model_into_every_table_with_its_parameters(tmp_path):
    from diff_transformer.cli import main

    out = tmp_path / "alternatives"
    code = main(["compare", "--config", "alternatives", "--steps", "4", "--seeds", "2", "--retrieval-steps", "4",
                 "--lr-grid", "2e-3", "--retrieval-lr-grid", "1e-3", "--quick-eval", "--out", str(out),
                 "--set", "run.eval_every=2", "--set", "data.eval_sequences=2", "--set", "grounded.steps=4",
                 "--set", "retrieval.eval_samples=2", "--set", "grounded.eval_episodes=2",
                 "--set", "compare.evaluation_options={outliers: {tokens: 256}, attention-sink: {windows: 2}}"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    report = (out / "report.md").read_text()
    labels = [CONFIG.model_name(n) for n in MODELS]
    parameters = {n: LanguageModel(CONFIG.train.model(n).model_config(), device="meta").num_parameters()
                  for n in MODELS}
    small_parameters = {n: [LanguageModel(small(s, n), device="meta").num_parameters()
                            for s in (CONFIG.retrieval, CONFIG.grounded)] for n in MODELS}
    assert [m["label"] for m in metrics["lm"]["models"].values()] == labels
    # The language-modelling table: every model with its parameters.
    for name, label in zip(MODELS, labels):
        assert f"| {label} | {CONFIG.attention(name)} | {parameters[name]:,} |" in report
    # The retrieval and grounded tables: a parameters row, every model's small-model count.
    rows = [line for line in report.splitlines() if line.startswith("| parameters |")]
    assert len(rows) == 2
    for row, index in zip(rows, (0, 1)):
        assert all(f" {small_parameters[n][index]:,} |" in row for n in MODELS)
    # The verdicts at equal cost: every model but DIFF a row of each table with its three counts, and the
    # equal-FLOPs table present with its readings.
    section = report.split("## Verdicts at equal cost")[1].split("\n## ")[0]
    tables = {heading: part for heading, part in
              (chunk.split("\n", 1) for chunk in section.split("### ")[1:])}
    assert set(tables) == {"At equal tokens", "At equal training FLOPs", "At equal training time"}
    for heading in ("At equal tokens", "At equal training FLOPs"):
        for name, label in zip(MODELS, labels):
            counts = " · ".join(f"{c:,}" for c in [parameters[name], *small_parameters[name]])
            assert f"| {label} | {counts} |" in tables[heading], (heading, label)
    flops_header = next(line for line in tables["At equal training FLOPs"].splitlines() if line.startswith("| Model"))
    for task in ("Language modelling", "Retrieval: needle", "Retrieval: mqar", "Contextual hallucination"):
        assert task in flops_header
    assert "read at" in tables["At equal training FLOPs"]
    assert "Attention sink (lower)" in tables["At equal tokens"].split("\n\n")[0]  # an evaluation at the budget's
    rows = metrics["equal_cost"]["rows"]
    assert {r["model"] for r in rows} == set(labels) - {"DIFF"}
    assert all(r["parameters"][0] and r["parameters"][1] for r in rows)
    # The claims and the other kinds' comparisons: the parameters of both models on every row.
    for claim in metrics["claims"] + metrics["variant_comparisons"]:
        assert None not in claim["parameters"], claim["claim"]


def test_the_small_models_tables_give_each_models_own_parameters():
    """Planted counts (the Transformer's retrieval model 10, DIFF's 11; grounded 20 and 21): the parameters
    row of the retrieval and grounded tables, and a column of the tables with a row per model."""
    from planted import grounded, grounded_run, retrieval, retrieval_run

    from diff_transformer.experiments.report import grounded_lines, retrieval_lines

    def planted(make, counts):
        runs = {}
        for name, count in counts.items():
            runs[name] = [make(), make()]
            for run in runs[name]:
                run.parameters = count
        return runs

    def run():
        made = retrieval_run(0.5, 0.4)
        made.accuracy = {"needle": {"N=1,depth=0": 0.5}, "mqar": {"D=2": 0.4}}
        return made

    found = retrieval(planted(run, {"standard": 10, "diff": 11}), needles=[1], depths=[0.0], pairs=[2])
    text = "\n".join(retrieval_lines(found))
    assert "| Task | Difficulty | Transformer | DIFF |\n|---|---|---:|---:|\n| parameters | | 10 | 11 |" in text
    assert "| Transformer | 10 | 0 | 0.000" in text and "| DIFF | 11 | 1 | 0.5000" in text  # the answer rows
    assert "| mqar | DIFF (as configured, lr 0.001) | 11 |" in text  # the learning curves
    answered = grounded(planted(lambda: grounded_run(0.5), {"standard": 20, "diff": 21}))
    text = "\n".join(grounded_lines(answered))
    assert "| parameters | 20 | 21 | |" in text  # and an empty cell under DIFF − Transformer
    assert "| DIFF | 21 | counterfactual |" in text and "| Transformer | 20 | 0.000" in text


def test_a_study_resumed_with_another_small_model_shape_is_refused_by_name():
    from diff_transformer.experiments.comparison import study_record
    from diff_transformer.experiments.output import study_differences

    config = load_experiment("alternatives")
    before = study_record(config)
    after = study_record(config)
    after["models"]["gda"]["small_model"] = {"n_heads": 4, "attn_head_dim": 8}
    assert [d for d in study_differences(before, after) if "small_model" in d]
    after["models"]["gda"]["small_model"] = before["models"]["gda"]["small_model"]
    after["models"]["gda"]["label"] = "renamed"  # a name in reports: free
    assert study_differences(before, after) == []
