"""The long-context experiment (``compare --config long-context``): its measurements against
answers computed by hand or by another code path, its claims read from planted results, and an
end-to-end run at the debug size; position-NLL windows inside documents."""

import json

import pytest
import torch

from diff_transformer.evaluation import position_nll
from diff_transformer.evaluation.models import ModelUnderTest
from diff_transformer.evaluation.texts import EvalText
from diff_transformer.evaluation.models import load_with_context
from diff_transformer.experiments import compare, load_experiment
from diff_transformer.experiments import long_context
from diff_transformer.experiments.config import LongContextConfig, RetrievalConfig
from diff_transformer.experiments.long_context import (
    AtLength, LengthModel, LongContextMetrics, PositionNLL, RetrievalByLength, extension_config, far_nll,
    long_context_claims, measure_at_lengths, position_nll_curve,
)
from diff_transformer.experiments.results import AnswerShares
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import ByteTokenizer
from diff_transformer.train import train
from planted import lm, summary
from test_train import byte_dataset, debug_config, debug_experiment  # noqa: F401  (byte_dataset is a fixture)

MODELS = {
    "standard": {"attention": "standard", "label": "Transformer"},
    "diff": {"attention": "diff", "label": "DIFF"},
}
LONG = {"seq_len": 64, "rope_theta": 40_000.0, "steps": 2, "batch_size": 4, "warmup_steps": 1, "eval_sequences": 4,
        "position_nll_windows": 4, "retrieval_lengths": [24, 48], "retrieval_seq_len": 32,
        "retrieval_rope_theta": 20_000.0, "retrieval_steps": 3}
RETRIEVAL = {"length": 24, "keys": 8, "values": 8, "noise_tokens": 8, "d_model": 32, "steps": 4, "batch_size": 4,
             "needles": [1, 2], "pairs": [2, 4], "depths": [0.0, 1.0], "eval_samples": 2, "warmup_steps": 1}


def long_config(dataset, out, **sections):
    base = {"run": {"steps": 2, "eval_every": 2}, "long_context": LONG, "retrieval": RETRIEVAL,
            "compare": {"seeds": 2, "evaluations": []}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return debug_experiment(dataset, out, models=MODELS, **base)


def test_far_nll_is_the_mean_nll_of_the_positions_past_the_short_length():
    nll = [4.0, 2.0, 3.0, 1.0, 5.0, 3.0]  # positions 1..6
    cumulative = position_nll.cumulative_average(nll)
    assert far_nll(cumulative, 2) == pytest.approx((3 + 1 + 5 + 3) / 4)
    assert far_nll(cumulative, 5) == pytest.approx(3.0)


def test_the_extension_config_sets_context_theta_data_and_budget(byte_dataset, tmp_path):  # noqa: F811
    config = long_config(byte_dataset, tmp_path)
    extended = extension_config(config)
    for entry in extended.models.values():
        assert entry.model_config().max_seq_len == 64 and entry.model_config().rope_theta == 40_000.0
    assert extended.data.seq_len == 64 and extended.data.batch_size == 4 and extended.data.within_documents
    assert extended.optim.warmup_steps == 1 and extended.run.steps == 2 and extended.run.eval_every == 2
    assert load_experiment("long-context").long_context.enabled  # the shipped experiment


def test_the_context_is_raised_without_changing_what_the_short_model_computes(byte_dataset, tmp_path):  # noqa: F811
    """The "before" model: the short weights at the long context, θ unchanged, give the short model's
    logits on the positions it was trained on (causal attention: a prefix sees only itself)."""
    result = train(debug_config(byte_dataset, tmp_path, run={"steps": 1}))
    short = LanguageModel.from_pretrained(result.checkpoint).eval()
    longer = load_with_context(result.checkpoint, 256)
    assert longer.config.max_seq_len == 256 and longer.config.rope_theta == short.config.rope_theta
    tokens = torch.randint(0, 257, (2, 200))
    with torch.no_grad():
        assert torch.allclose(longer(tokens)[0][:, :128], short(tokens[:, :128])[0], atol=1e-5)
    other = load_with_context(result.checkpoint, 256, rope_theta=40_000.0)
    with torch.no_grad():
        assert not torch.allclose(other(tokens)[0][:, :128], short(tokens[:, :128])[0], atol=1e-3)


def test_retrieval_is_measured_on_examples_of_each_test_length(monkeypatch):
    seen = []

    def recording_accuracy(model, examples):
        seen.append(len(examples[0].tokens))
        return 0.5

    monkeypatch.setattr(long_context, "accuracy", recording_accuracy)
    settings = RetrievalConfig(**RETRIEVAL)
    model = LanguageModel(RetrievalConfig(**{**RETRIEVAL, "length": 48}).model_config("diff"))  # context 48
    result = measure_at_lengths(model, settings, [24, 48])
    cells = len(settings.needles) * len(settings.depths) + len(settings.pairs)
    assert seen == [25] * cells + [49] * cells  # length + 1 tokens: inputs and the last target
    assert set(result) == {24, 48} and result[48].mean_accuracy == {"needle": 0.5, "mqar": 0.5}
    assert len(result[48].attention) == settings.n_layers


def planted_metrics() -> LongContextMetrics:
    """Results of a study, planted: two seeds each; position-NLL curves of 4 positions (short
    length 2); retrieval at lengths 24 and 48 before and after the extension."""
    def curve(values):
        return position_nll.cumulative_average(values)

    def at_lengths(needle48, mqar48, answer, noise):
        return {24: AtLength({}, {"needle": 0.9, "mqar": 0.9}, [AnswerShares(0.0, 1.0, 0.0)] * 2),
                48: AtLength({}, {"needle": needle48, "mqar": mqar48},
                             [AnswerShares(0.5, 0.5, 0.0), AnswerShares(answer, noise, 1 - answer - noise)])}

    def length_model(after):
        return LengthModel(1e-3, 1e-3, {1e-3: 0.0}, [at_lengths(0.0, 0.0, 0.0, 0.0)] * 2, after)

    short = lm({n: summary(n, [3.0, 3.0]) for n in ("standard", "diff")})
    short.budget.seq_len = 2
    by_length = RetrievalByLength([24, 48], 24, 32, 20_000.0, 3, 0.125, {
        "standard": length_model([at_lengths(0.4, 0.3, 0.1, 0.8), at_lengths(0.5, 0.3, 0.2, 0.7)]),
        "diff": length_model([at_lengths(0.8, 0.7, 0.6, 0.2), at_lengths(0.9, 0.9, 0.7, 0.1)]),
    })
    return LongContextMetrics(
        config="long", description="", budget_note="", settings=LongContextConfig(seq_len=4), short=short,
        short_rope_theta=10_000.0, extension=short,
        position_nll={
            "standard": PositionNLL([curve([9, 9, 9, 9])] * 2, [curve([4, 4, 3, 3]), curve([4, 4, 3, 5])]),
            "diff": PositionNLL([curve([9, 9, 9, 9])] * 2, [curve([4, 4, 2, 2]), curve([4, 4, 1, 1])]),
        },
        retrieval_by_length=by_length, seeds=[0, 1], labels={"standard": "Transformer", "diff": "DIFF"},
        attention={"standard": "standard", "diff": "diff"}, device="cpu")


def test_the_claims_read_the_extended_models_at_the_longest_length():
    rows = {row.claim + " " + row.measure.split()[0]: row for row in long_context_claims(planted_metrics())}
    lm_row = rows["Long-context language modelling cumulative"]
    # C(4) of each seed's extended curve: (4+4+2+2)/4 = 3, (4+4+1+1)/4 = 2.5 against 3.5 and 4.
    assert lm_row.ours.per_seed == (3.0, 2.5) and lm_row.base.per_seed == (3.5, 4.0)
    # Welch: se = √(0.125/2 + 0.125/2) = 0.354 on 2 degrees of freedom, half-width 4.303 · 0.354 = 1.52 > 1.
    assert lm_row.difference.delta == pytest.approx(-1.0) and lm_row.verdict == "inconclusive"
    far = rows["Use of the longer context mean"]  # positions 3..4 only
    assert far.ours.per_seed == (2.0, 1.0) and far.base.per_seed == (3.0, 4.0)
    needle, mqar = rows["Retrieval at length needle"], rows["Retrieval at length mqar"]
    assert needle.ours.per_seed == (0.8, 0.9) and needle.base.per_seed == (0.4, 0.5)
    assert mqar.ours.per_seed == (0.7, 0.9) and mqar.base.per_seed == (0.3, 0.3)
    answer = rows["Attention to the answer share"]  # the last layer at 48 tokens
    assert answer.ours.per_seed == (0.6, 0.7) and answer.base.per_seed == (0.1, 0.2)
    noise = rows["Attention noise share"]
    # −0.6 with half-width 4.303 · √(0.005/2 + 0.005/2) = 0.30: below zero, the paper's side.
    assert noise.ours.per_seed == (0.2, 0.1) and noise.verdict == "agrees"


def test_position_nll_windows_can_lie_inside_documents():
    """Byte tokens: each document is its bytes and one end-of-text token (256)."""
    texts = ["a" * 10, "b" * 100, "c" * 5, "d" * 60]
    tokenizer = ByteTokenizer()
    windows = EvalText(texts).document_windows(tokenizer, 40, 6)
    assert windows.shape == (6, 41)
    assert not (windows[:, :-1] == tokenizer.eos_id).any()  # never an end of text inside the context
    # Only the documents of at least 41 tokens (101 and 61) give windows; both are used.
    letters = {chr(int(w[0])) for w in windows}
    assert letters == {"b", "d"} and all(len({int(t) for t in w[:-1]}) == 1 for w in windows)
    with pytest.raises(ValueError, match="no document .* the longest has 101 tokens"):
        EvalText(texts).document_windows(tokenizer, 200, 2)


def test_the_position_nll_evaluation_reads_windows_inside_documents_when_asked():
    torch.manual_seed(0)
    from diff_transformer.config import ModelConfig

    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257, max_seq_len=40)).eval()
    mut = ModelUnderTest("m", model, ByteTokenizer())
    texts = ["x" * 30, "y" * 80, "z" * 30]
    inside = position_nll.run(mut, position_nll.PositionNLLOptions(windows=3, within_documents=True), EvalText(texts))
    across = position_nll.run(mut, position_nll.PositionNLLOptions(windows=3), EvalText(texts))
    assert inside["windows_fingerprint"] != across["windows_fingerprint"] and len(inside["cumulative"]) == 40


@pytest.mark.slow
def test_the_experiment_extends_every_model_and_seed_and_reports_at_length(byte_dataset, tmp_path, capsys):  # noqa: F811
    config = long_config(byte_dataset, tmp_path / "unused", long_context={"lr_grid": [1e-3, 3e-3]})
    out = tmp_path / "long"
    metrics = compare(config, out, progress=False)  # compare dispatches on the long_context section

    short_runs = out / "short" / "runs"
    for name in MODELS:
        sweep = metrics.extension.sweeps[name]
        assert set(sweep.scores[None]) == {1e-3, 3e-3}
        losses = {lr: s.mean for lr, s in sweep.scores[None].items()}
        assert sweep.lr == min(losses, key=losses.get)  # its own best extension lr
        for seed, run in zip((0, 1), sweep.chosen):
            saved = json.loads((out / "extend" / "runs" / name / f"lr-{sweep.lr:g}" / f"seed-{seed}"
                                / "summary.json").read_text())
            assert saved["init_from"] == str(short_runs / name / "lr-0.003" / f"seed-{seed}" / "checkpoint")
            assert saved["tokens"] == 2 * 4 * 64
            model = LanguageModel.from_pretrained(run.checkpoint_dir)
            assert model.config.max_seq_len == 64 and model.config.rope_theta == 40_000.0
            # C(T) over the position-NLL windows is the run's final validation loss: the same windows inside
            # documents (4 of 64 tokens), scored by another code path (the trainer's fused loss).
            curve = metrics.position_nll[name].after[seed]
            assert len(curve) == 64 and curve[-1] == pytest.approx(run.final_val_loss, abs=1e-4)
            assert position_nll_curve(run.checkpoint_dir, config, 64) == pytest.approx(curve)
        by_length = metrics.retrieval_by_length.models[name]
        assert len(by_length.before) == len(by_length.after) == 2 and set(by_length.after[0]) == {24, 48}
    claims = [row.claim for row in metrics.claims]
    assert claims[:2] == ["Long-context language modelling", "Use of the longer context"]
    assert all(row.verdict for row in metrics.claims)
    report = (out / "report.md").read_text()
    for heading in ("The paper's claims at this scale", "## Training", "Extension learning rates",
                    "Cumulative average NLL by position", "Retrieval by length"):
        assert heading in report
    assert (out / "position_nll.png").stat().st_size > 0 and (out / "retrieval_length.png").stat().st_size > 0
    assert (out / "short" / "report.md").is_file()

    capsys.readouterr()
    again = compare(config, out, resume=True)  # every run finished: reused, nothing trained again
    err = capsys.readouterr().err
    assert "training ->" not in err and "already done, reusing" in err
    assert again.extension.sweeps["diff"].lr == metrics.extension.sweeps["diff"].lr
