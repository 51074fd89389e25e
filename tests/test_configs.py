"""Training configs: every shipped YAML loads; unknown keys and ill-typed values are errors naming
them; command-line overrides."""

import pytest

from diff_transformer.cli import main
from diff_transformer.experiments import load_experiment
from diff_transformer.experiments.config import experiment_from_dict
from diff_transformer.model import LanguageModel
from diff_transformer.train.config import ConfigError, config_from_dict, load_config, shipped_configs


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_config_loads_and_builds_its_models(name):
    config = load_experiment(name)
    assert config.train.models
    for entry in config.train.models.values():
        model = LanguageModel(entry.model_config(), device="meta")
        assert model.num_parameters() > 0
    assert experiment_from_dict(config.to_dict()).to_dict() == config.to_dict()  # what a comparison saves
    train = load_config(name)  # the trainer's part alone, as a run's config.yaml holds it
    assert train.to_dict() == config.train.to_dict() and config_from_dict(train.to_dict()).to_dict() == train.to_dict()


def test_the_shipped_set_holds_the_named_experiments():
    assert {"tiny", "ablation-1.4b", "paper-3b"} <= set(shipped_configs())
    experiment = load_experiment("tiny")
    assert experiment.compare.models == ["standard", "diff"]
    assert experiment.compare.recipes == experiment.compare.language_model_recipes == ["scaled-init"]
    tiny = experiment.train
    standard, diff = tiny.model("standard").model_config(), tiny.model("diff").model_config()
    assert (standard.n_heads, diff.n_heads) == (2 * diff.n_heads, diff.n_heads) and standard.head_dim == diff.head_dim
    ablation = load_config("ablation-1.4b")
    assert len(ablation.models) == 7  # the rows of Table 6
    heads = {name: (e.model_config().n_heads, e.model_config().head_dim) for name, e in ablation.models.items()}
    assert heads["transformer"] == (16, 128) and heads["transformer-8x256"] == (8, 256) and heads["diff"] == (8, 128)
    assert ablation.model("diff-lambda-0.5").model_config().lambda_init == 0.5
    assert ablation.model("diff-no-groupnorm").model_config().head_norm is False
    assert load_config("paper-3b").optim.lr == 3.2e-4


def test_paper_3b_64k_is_the_papers_extension_of_the_paper_3b_models():
    """The paper's long-context recipe (§3.3): RoPE θ 640,000, 64K tokens, lr 8e-5, 1.5B tokens,
    from the paper-3b models, which it changes only where a run started from a checkpoint may."""
    from diff_transformer.train.state import INIT_CHANGEABLE

    extension, base = load_config("paper-3b-64k"), load_config("paper-3b")
    assert set(extension.models) == set(base.models) == {"transformer", "diff"}
    for name in extension.models:
        longer, short = extension.model(name).model_config(), base.model(name).model_config()
        assert (longer.rope_theta, longer.max_seq_len) == (640_000.0, 65_536)
        assert (short.rope_theta, short.max_seq_len) == (10_000.0, 4_096)
        ours, theirs = longer.to_dict(), short.to_dict()
        assert ({key for key in ours if ours[key] != theirs[key]} == set(INIT_CHANGEABLE)
                == {"max_seq_len", "rope_theta"})
        assert extension.optim_for(name).lr == 8e-5
    assert extension.data.seq_len == 65_536
    tokens = extension.run.steps * extension.data.batch_size * extension.data.seq_len
    assert tokens == 358 * 64 * 65_536 and abs(tokens - 1.5e9) / 1.5e9 < 0.002


def test_matched_models_have_the_same_parameters_but_for_the_lambda_and_norm_weights():
    tiny = load_config("tiny")
    standard = LanguageModel(tiny.model("standard").model_config(), device="meta").num_parameters()
    diff_config = tiny.model("diff").model_config()
    diff = LanguageModel(diff_config, device="meta").num_parameters()
    assert diff - standard == diff_config.n_layers * 6 * diff_config.head_dim


def test_the_wide_head_transformer_and_gated_attention_beside_the_matched_transformer():
    """standard-wide: DIFF's head count and value width (2d), the Transformer's parameters exactly; the
    elementwise gate adds one d_model² matrix per layer, the head-wise one d_model × heads; none of the
    three is in the default comparison (the demo's budget)."""
    tiny = load_config("tiny")
    configs = {name: tiny.model(name).model_config() for name in ("standard", "diff", "standard-wide", "gated",
                                                                  "gated_headwise")}
    count = {name: LanguageModel(c, device="meta").num_parameters() for name, c in configs.items()}
    standard, diff, wide = configs["standard"], configs["diff"], configs["standard-wide"]
    assert wide.attention == "standard" and (wide.n_heads, wide.head_dim) == (diff.n_heads, 2 * diff.head_dim)
    assert count["standard-wide"] == count["standard"] == 271_008
    assert count["gated"] - count["standard"] == standard.n_layers * standard.d_model ** 2 == 18_432
    headwise = standard.n_layers * standard.d_model * standard.n_heads
    assert count["gated_headwise"] - count["standard"] == headwise == 1_152
    assert {configs["gated"].attention, configs["gated_headwise"].attention} == {"gated", "gated_headwise"}
    assert not {"standard-wide", "gated", "gated_headwise"} & set(load_experiment("tiny").compare.models)


def test_diff_heads_keeps_the_presets_diff_head_count_at_any_size():
    """The wide-head entry follows the preset (tiny shrunk to debug: 2 heads of 32), the retrieval
    models likewise; without a preset, or beside its own n_heads, it is an error naming it."""
    small = load_config("tiny", ["model.preset=debug", "model.d_model=64"])  # tiny.yaml sets its own width
    wide, diff = small.model("standard-wide").model_config(), small.model("diff").model_config()
    assert (wide.n_heads, wide.head_dim) == (diff.n_heads, 2 * diff.head_dim) == (2, 32)
    assert small.model("standard-wide").to_dict()["diff_heads"] is True
    retrieval = load_experiment("tiny").retrieval
    wide, standard = retrieval.model_config("standard", diff_heads=True), retrieval.model_config("standard")
    assert (wide.n_heads, standard.n_heads) == (retrieval.n_heads, 2 * retrieval.n_heads)
    for models in ({"w": {"attention": "standard", "diff_heads": True, "d_model": 64, "n_heads": 2}},
                   {"w": {"attention": "standard", "diff_heads": True, "preset": "debug", "n_heads": 2}}):
        with pytest.raises(ConfigError, match=r"models\.w\.diff_heads keeps a preset's DIFF head count"):
            config_from_dict(minimal(models=models))
    with pytest.raises(ConfigError, match=r"models\.w\.diff_heads must be bool"):
        config_from_dict(minimal(models={"w": {"attention": "standard", "preset": "debug", "diff_heads": "yes"}}))


def minimal(**sections):
    data = {"models": {"diff": {"preset": "debug"}}, "optim": {"recipe": "paper-scaling"}}
    data.update(sections)
    return data


def test_the_grounded_task_takes_its_own_lr_else_the_retrieval_lr():
    """grounded.lr_by_model under every recipe; a model it does not name: its retrieval lr (by recipe)."""
    config = experiment_from_dict({
        "models": {"standard": {"preset": "debug", "attention": "standard"}, "diff": {"preset": "debug"}},
        "optim": {"recipe": "paper-scaling"},
        "retrieval": {"lr_by_model": {"standard": 1e-3, "diff": 1e-3},
                      "lr_by_recipe": {"plain-init": {"standard": 3e-3}}},
        "grounded": {"lr_by_model": {"diff": 2e-3}},
    })
    assert [config.lr_for("diff", r, "grounded") for r in ("scaled-init", "plain-init", None)] == [2e-3] * 3
    assert [config.lr_for("standard", r, "grounded") for r in ("scaled-init", "plain-init")] == [1e-3, 3e-3]
    assert config.lr_for("diff", "scaled-init", "retrieval") == 1e-3


@pytest.mark.parametrize(
    "data, named",
    [
        (minimal(bogus=1), "bogus"),
        (minimal(run={"stepz": 3}), "run.stepz"),
        (minimal(optim={"recipe": "paper-scaling", "learning_rate": 1}), "optim.learning_rate"),
        (minimal(models={"diff": {"preset": "debug", "n_head": 2}}), "n_head"),
        (minimal(run={"steps": "many"}), "run.steps"),
        (minimal(optim={"recipe": "paper-4b"}), "optim.recipe"),
        (minimal(models={"diff": {"preset": "debug", "attention": "linear"}}), "models.diff.attention"),
        (minimal(data={"mix": {"needle": 1.5}}), "data.mix.needle"),
        (minimal(compare={"models": ["transformer"]}), "compare.models"),
        (minimal(compare={"evaluations": ["needles"]}), "compare.evaluations"),
        (minimal(compare={"lr_grid": [1e-3, -1e-3]}), "compare.lr_grid"),
        (minimal(compare={"evaluation_options": {"outliers": {"tokenz": 1}}}), "compare.evaluation_options.outliers"),
        (minimal(models={"diff": {"optim": {"lr": -1.0}}}), "lr"),
        (minimal(models={"diff": {"optim": {"lrr": 1.0}}}), r"models.diff.optim.lrr"),
        (minimal(retrieval={"length": 8}), "retrieval.length"),
        (minimal(retrieval={"bogus": 1}), "retrieval.bogus"),
        (minimal(run={"attn_backend": "flash9"}), "run.attn_backend"),
        (minimal(models={"diff": {"preset": "debug", "attn_backend": "sdpa"}}), "attn_backend is a runtime setting"),
        (minimal(retrieval={"lr_by_model": {"transformer": 1e-3}}), "retrieval.lr_by_model: no model named"),
        (minimal(grounded={"lr_by_model": {"transformer": 1e-3}}), "grounded.lr_by_model: no model named"),
        (minimal(grounded={"lr_by_model": {"diff": 0.0}}), "grounded.lr_by_model.diff must be a positive"),
        (minimal(compare={"lr_by_recipe": {"xavier": {"diff": 1e-3}}}), "compare.lr_by_recipe.xavier: no such"),
        (minimal(models={"diff": {"preset": "debug", "paper_row": "gpt"}}), "models.diff.paper_row"),
    ],
)
def test_bad_keys_and_values_are_errors_naming_them(data, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        experiment_from_dict(data)


@pytest.mark.parametrize("key, moved", [
    ("retrieval_lr", "retrieval.lr_by_model.diff"),
    ("lr_by_recipe", "compare.lr_by_recipe.RECIPE.diff"),
])
def test_a_model_key_that_moved_to_an_experiment_section_names_where_it_went(key, moved):
    with pytest.raises(ConfigError, match=f"models.diff.{key} has moved: set {moved}"):
        load_config("tiny", [f"models.diff.{key}=1.0e-3"])


def test_overrides_apply_dotted_keys_with_yaml_values():
    experiment = load_experiment(
        "tiny",
        ["optim.lr=1e-3", "run.compile=true", "optim.betas=[0.8, 0.9]", "models.diff.lambda_init=0.8",
         "data.mix.mqar=0.1", "models.diff.optim.lr=5e-3", "retrieval.steps=7"],
    )
    config = experiment.train
    assert config.optim.lr == 1e-3 and config.run.compile is True and config.optim.betas == (0.8, 0.9)
    assert config.model("diff").model_config().lambda_init == 0.8
    assert config.data.mix == {"mqar": 0.1}
    # optim.lr reaches every model, replacing its own; a later models.diff.optim.lr sets diff's alone
    assert config.optim_for("diff").lr == 5e-3 and config.optim_for("standard").lr == 1e-3
    assert config.optim_for("standard").min_lr == 4e-4  # the fields not overridden stay each model's own
    assert config.optim_for("diff_v2").lr == 1e-3  # no lr of its own: the section's
    assert experiment.retrieval.steps == 7 and experiment.retrieval.enabled
    with pytest.raises(ConfigError, match=r"run\.bogus"):
        load_config("tiny", ["run.bogus=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config("tiny", ["run.steps"])


def test_a_config_with_several_models_needs_a_model_name():
    config = load_config("tiny")
    with pytest.raises(ConfigError, match="standard, diff, diff_v2"):
        config.model()
    assert config.model("diff").attention == "diff"


def test_the_train_command_reports_config_errors_by_name(capsys):
    assert main(["train", "--config", "tiny", "--model", "diff", "--set", "run.bogus=1"]) == 2
    assert "run.bogus" in capsys.readouterr().err
    assert main(["train", "--config", "no-such-config"]) == 2
    assert "no-such-config" in capsys.readouterr().err


# --- overrides that take effect; numbers that are finite and in range ---------------------------------


@pytest.mark.parametrize(
    "overrides",
    [["optim.lr=1e-3"],
     ["optim={lr: 1.0e-3, min_lr: 2.0e-4, warmup_steps: 10, betas: [0.9, 0.95], weight_decay: 0.1}"]],
    ids=["field", "section"],
)
def test_an_optim_override_applies_to_every_model_over_its_own_value(overrides):
    """The tiny config gives standard and diff their own lr (4e-3, 2e-3): --set optim.lr reaches them too."""
    tiny = load_config("tiny")
    assert [tiny.optim_for(name).lr for name in ("standard", "diff")] == [4e-3, 2e-3]
    config = load_config("tiny", overrides)
    assert {name: config.optim_for(name).lr for name in config.models} == dict.fromkeys(config.models, 1e-3)
    # what the override does not name stays each model's own (the whole section names min_lr)
    assert config.optim_for("standard").min_lr == (4e-4 if overrides == ["optim.lr=1e-3"] else 2e-4)
    later = load_config("tiny", [*overrides, "models.diff.optim.lr=5e-3"])  # a later one for one model wins
    assert later.optim_for("diff").lr == 5e-3 and later.optim_for("standard").lr == 1e-3


@pytest.mark.parametrize(
    "override, named",
    [("optim.lr=nan", "optim.lr must be a finite number, got nan"),
     ("optim.min_lr=.inf", "optim.min_lr must be a finite number, got inf"),
     ("optim.eps=nan", "optim.eps must be a finite number, got nan"),
     ("optim.eps=0", "optim.eps must be positive, got 0.0"),
     ("optim.grad_clip=.inf", "optim.grad_clip must be a finite number"),
     ("optim.weight_decay=-.inf", "optim.weight_decay must be a finite number, got -inf"),
     ("optim.betas=[.nan, 0.9]", "optim.betas[0] must be a finite number"),
     ("models.diff.optim.lr=nan", "models.diff.optim.lr must be a finite number, got nan"),
     ("retrieval.lr_by_model.diff=.inf", "retrieval.lr_by_model.diff must be a finite number, got inf"),
     ("data.mix.needle=nan", "data.mix.needle must be a finite number, got nan"),
     ("retrieval.lr=nan", "retrieval.lr must be a finite number, got nan"),
     ("retrieval.depths=[0.5, .nan]", "retrieval.depths[1] must be a finite number"),
     ("compare.lr_grid=[1.0e-3, .inf]", "compare.lr_grid[1] must be a finite number, got inf"),
     ("model.init_std=nan", "models.standard.init_std must be a finite number, got nan"),
     ("model.rope_theta=0", "models.standard: rope_theta must be a positive finite number, got 0.0"),
     ("models.diff.norm_eps=-1e-5", "models.diff: norm_eps must be a positive finite number"),
     ("models.diff.lambda_std=.inf", "models.diff.lambda_std must be a finite number, got inf"),
     ("models.diff.lambda_init=nan", "models.diff.lambda_init must be a finite number, got nan"),
     ("models.diff.lambda_init=1.0", "models.diff: lambda_init must be a number in [0, 1) or null"),
     ("models.diff.tie_embeddings=maybe", "models.diff.tie_embeddings must be bool, got 'maybe'")],
)
def test_every_number_is_checked_finite_and_in_range_wherever_it_is_set(override, named):
    with pytest.raises(ConfigError) as caught:
        load_experiment("tiny", [override])
    assert named in str(caught.value)


def test_numbers_are_checked_when_the_dataclasses_are_built_directly():
    from diff_transformer.config import ModelConfig
    from diff_transformer.experiments.config import RetrievalConfig
    from diff_transformer.train.config import DataConfig, OptimConfig

    nan = float("nan")
    with pytest.raises(ConfigError, match=r"optim\.lr must be a finite number, got nan"):
        OptimConfig(lr=nan, min_lr=0.0, warmup_steps=0, betas=(0.9, 0.95), weight_decay=0.0)
    with pytest.raises(ConfigError, match=r"data\.mix\.needle must be a finite number"):
        DataConfig(mix={"needle": nan})
    with pytest.raises(ConfigError, match=r"retrieval\.lr must be a finite number, got inf"):
        RetrievalConfig(lr=float("inf"))
    for field in ("init_std", "rope_theta", "norm_eps", "lambda_std"):
        for value in (nan, float("inf"), -1.0):
            with pytest.raises(ConfigError, match=f"{field} must be a positive finite number, got {value}"):
                ModelConfig(**{field: value})
    with pytest.raises(ConfigError, match=r"lambda_init must be a number in \[0, 1\)"):
        ModelConfig(lambda_init=-0.1)
    with pytest.raises(ConfigError, match="head_norm must be true or false, got 'yes'"):
        ModelConfig(head_norm="yes")


def test_a_model_field_written_as_1e_3_is_a_number():
    """PyYAML reads 1e-3 (no dot) as a string; a model field typed float takes it as the number."""
    config = load_config("tiny", ["models.diff.init_std=1e-3"])
    assert config.model("diff").model_config().init_std == 1e-3


def test_an_empty_config_and_one_without_a_model_are_refused(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: an empty config"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "run-only.yaml").write_text("run: {steps: 3}\n")
    with pytest.raises(ConfigError, match=r"run-only\.yaml: no model"):
        load_config(tmp_path / "run-only.yaml")
    assert load_config(tmp_path / "run-only.yaml", ["model.preset=debug"]).model().preset == "debug"
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: expected a mapping at the top level, got list"):
        load_config(tmp_path / "list.yaml", ["run.steps=3"])


def _recipe_config(**compare):
    return experiment_from_dict({
        "model": {"preset": "debug"},
        "models": {"standard": {"attention": "standard", "optim": {"lr": 2e-3}}, "diff": {"attention": "diff"}},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "compare": {"lr_by_recipe": {"plain-init": {"standard": 4e-3}}, **compare},
        "retrieval": {"lr": 3e-3, "lr_by_recipe": {"plain-init": {"standard": 5e-4}}},
    })


def test_init_recipes_set_the_model_fields_and_each_model_its_lr_under_each():
    config = _recipe_config(recipes=["scaled-init", "plain-init"], lm_recipes=["scaled-init"])
    assert config.entry_fields("diff", "plain-init") == {"scale_residual_init": False}
    assert config.entry_fields("diff", "scaled-init") == {"scale_residual_init": True}
    assert config.entry_fields("diff", None) == {}
    # lr_by_recipe first, then the model's own lr, then the section's.
    assert config.lr_for("standard", "plain-init") == 4e-3 and config.lr_for("standard", "scaled-init") == 2e-3
    assert config.lr_for("standard", "plain-init", "retrieval") == 5e-4
    assert config.lr_for("diff", "plain-init") == 1e-3 and config.lr_for("diff", "plain-init", "retrieval") == 3e-3
    assert config.compare.language_model_recipes == ["scaled-init"]
    assert _recipe_config(recipes=["plain-init"]).compare.language_model_recipes == ["plain-init"]
    assert experiment_from_dict(config.to_dict()).to_dict() == config.to_dict()


@pytest.mark.parametrize("compare, message", [
    ({"recipes": ["scaled-init", "xavier"]}, "compare.recipes: no init recipe 'xavier'"),
    ({"recipes": ["plain-init", "plain-init"]}, "names a recipe twice"),
    ({"recipes": ["plain-init"], "lm_recipes": ["scaled-init"]}, "must be among compare.recipes"),
    ({"jobs": 0}, "compare.jobs must be positive"),
])
def test_bad_recipe_settings_are_named(compare, message):
    with pytest.raises(ConfigError, match=message):
        _recipe_config(**compare)


@pytest.mark.parametrize("lr_by_recipe, message", [
    ({"xavier": {"standard": 1e-3}}, "compare.lr_by_recipe.xavier: no such init recipe"),
    ({"plain-init": {"transformer": 1e-3}}, "compare.lr_by_recipe.plain-init: no model named 'transformer'"),
    ({"plain-init": {"standard": -1e-3}}, "compare.lr_by_recipe.plain-init.standard must be a positive learning rate"),
    ({"plain-init": {"standard": "fast"}}, "compare.lr_by_recipe.plain-init.standard must be a number"),
])
def test_bad_lr_by_recipe_entries_are_named(lr_by_recipe, message):
    with pytest.raises(ConfigError, match=message):
        _recipe_config(lr_by_recipe=lr_by_recipe)


def test_a_model_that_pins_a_recipe_field_is_refused_under_another_recipe():
    data = _recipe_config(recipes=["scaled-init", "plain-init"]).to_dict()
    data["models"]["diff"]["scale_residual_init"] = False
    config = experiment_from_dict(data)
    assert config.entry_fields("diff", "plain-init")["scale_residual_init"] is False  # agrees: fine
    with pytest.raises(ConfigError,
                       match="models.diff.scale_residual_init=False disagrees with init recipe 'scaled-init'"):
        config.entry_fields("diff", "scaled-init")


@pytest.mark.parametrize("config, overrides, label", [
    ("alternatives", [], "Transformer 3×32"),
    ("alternatives", ["model.preset=debug", "model.d_model=64"], "Transformer 2×32"),
    ("tiny", ["model.preset=small"], None),
])
def test_the_wide_transformers_label_is_its_real_shape(config, overrides, label):
    """The issue's "Transformer 3×64" at the debug size (2 heads × 32): the label is filled from the
    model's own config (its DIFF head count, head dim 2d), whatever the preset."""
    from diff_transformer.experiments import load_experiment

    experiment = load_experiment(config, overrides)
    shape = experiment.train.model("standard-wide").model_config()
    assert experiment.model_name("standard-wide") == (label or f"Transformer {shape.n_heads}×{shape.head_dim}")
    assert shape.n_heads * shape.head_dim == shape.d_model


def test_a_label_naming_no_model_field_is_refused_by_name():
    from diff_transformer.experiments import load_experiment
    from diff_transformer.train import ConfigError

    with pytest.raises(ConfigError, match=r"models.standard.label 'Transformer \{heads\}': each \{...\} must name a "
                                          "ModelConfig field or head_dim"):
        load_experiment("tiny", ["models.standard.label='Transformer {heads}'"])
