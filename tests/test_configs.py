"""Training configs: every shipped YAML loads; unknown keys and ill-typed values are errors naming
them; command-line overrides."""

import pytest

from diff_transformer.cli import main
from diff_transformer.model import LanguageModel
from diff_transformer.train.config import ConfigError, config_from_dict, load_config, shipped_configs


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_config_loads_and_builds_its_models(name):
    config = load_config(name)
    assert config.models
    for entry in config.models.values():
        model = LanguageModel(entry.model_config(), device="meta")
        assert model.num_parameters() > 0
    assert config_from_dict(config.to_dict()).to_dict() == config.to_dict()  # what runs save reads back


def test_the_shipped_set_holds_the_named_experiments():
    assert {"tiny", "ablation-1.4b", "paper-3b"} <= set(shipped_configs())
    tiny = load_config("tiny")
    assert tiny.compare.models == ["standard", "diff"]
    standard, diff = tiny.model("standard").model_config(), tiny.model("diff").model_config()
    assert (standard.n_heads, diff.n_heads) == (2 * diff.n_heads, diff.n_heads) and standard.head_dim == diff.head_dim
    ablation = load_config("ablation-1.4b")
    assert len(ablation.models) == 7  # the rows of Table 6
    heads = {name: (e.model_config().n_heads, e.model_config().head_dim) for name, e in ablation.models.items()}
    assert heads["transformer"] == (16, 128) and heads["transformer-8x256"] == (8, 256) and heads["diff"] == (8, 128)
    assert ablation.model("diff-lambda-0.5").model_config().lambda_init == 0.5
    assert ablation.model("diff-no-groupnorm").model_config().head_norm is False
    assert load_config("paper-3b").optim.lr == 3.2e-4


def test_matched_models_have_the_same_parameters_but_for_the_lambda_and_norm_weights():
    tiny = load_config("tiny")
    standard = LanguageModel(tiny.model("standard").model_config(), device="meta").num_parameters()
    diff_config = tiny.model("diff").model_config()
    diff = LanguageModel(diff_config, device="meta").num_parameters()
    assert diff - standard == diff_config.n_layers * 6 * diff_config.head_dim


def minimal(**sections):
    data = {"models": {"diff": {"preset": "debug"}}, "optim": {"recipe": "paper-scaling"}}
    data.update(sections)
    return data


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
    ],
)
def test_bad_keys_and_values_are_errors_naming_them(data, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config_from_dict(data)


def test_overrides_apply_dotted_keys_with_yaml_values():
    config = load_config(
        "tiny",
        ["optim.lr=1e-3", "run.compile=true", "optim.betas=[0.8, 0.9]", "models.diff.lambda_init=0.8",
         "data.mix.mqar=0.1", "models.diff.optim.lr=5e-3", "retrieval.steps=7"],
    )
    assert config.optim.lr == 1e-3 and config.run.compile is True and config.optim.betas == (0.8, 0.9)
    assert config.model("diff").model_config().lambda_init == 0.8
    assert config.data.mix == {"mqar": 0.1}
    assert config.optim_for("diff").lr == 5e-3 and config.optim_for("standard").lr == 2e-3  # each model's own lr wins
    assert config.optim_for("diff_v2").lr == 1e-3  # no lr of its own: the section's
    assert config.retrieval.steps == 7 and config.retrieval.enabled
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
