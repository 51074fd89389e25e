"""The pretrained-models study (``compare --config pretrained``): the difference and interval arithmetic
pinned against hand computations, the per-unit figures the evaluations now record against independent
computations, the checks that refuse a study before any work, and the study end to end on tiny random
transformers models of each family, imported with ``import-hf``."""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import t as student_t

from diff_transformer.cli import main
from diff_transformer.config import ConfigError, ModelConfig
from diff_transformer.evaluation import EvalText, load_model
from diff_transformer.evaluation.attention_noise import AttentionNoiseOptions
from diff_transformer.evaluation.attention_noise import run as attention_noise
from diff_transformer.evaluation.needle import NeedleOptions
from diff_transformer.evaluation.needle import run as needle
from diff_transformer.evaluation.outliers import OutlierOptions
from diff_transformer.evaluation.outliers import run as outliers
from diff_transformer.evaluation.quantization import QuantizationOptions
from diff_transformer.evaluation.quantization import run as quantization
from diff_transformer.evaluation.stats import Difference
from diff_transformer.experiments import compare, load_experiment
from diff_transformer.experiments.pretrained import (
    EFFECTS, GivenModel, ModelFigure, ModelMeasurement, PairEffect, StudyPlan, StudyText, effect_word,
    load_measurement, overall_verdict, study_effects, unit_difference,
)
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import DEFAULT_TOKENIZER_FILE, ByteTokenizer

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
        "of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families. ") * 6


# --- the arithmetic, by hand --------------------------------------------------------------------------


def test_a_paired_difference_is_the_mean_of_the_unit_differences_with_students_interval():
    ours, base = [1.0, 2.0, 4.0, None, 7.0], [0.0, 1.0, 1.0, 5.0, None]  # units 3 and 4 lack a side
    difference, units = unit_difference(ours, base, paired=True)
    # by hand: differences 1, 1, 3; mean 5/3; s² = ((1 − 5/3)² · 2 + (3 − 5/3)²) / 2 = 4/3
    half = student_t.ppf(0.975, 2) * math.sqrt(4 / 3) / math.sqrt(3)
    assert units == 3
    assert difference.delta == pytest.approx(5 / 3, abs=1e-12)
    assert (difference.low, difference.high) == pytest.approx((5 / 3 - half, 5 / 3 + half), abs=1e-12)
    with pytest.raises(ValueError, match="one to one"):
        unit_difference([1.0], [1.0, 2.0], paired=True)


def test_an_unpaired_difference_has_welchs_interval_over_the_two_models_units():
    ours, base = [1.0, 2.0, 3.0, None], [2.0, 4.0, 6.0, 8.0]
    difference, units = unit_difference(ours, base, paired=False)
    # by hand: means 2 and 5; variances of the means 1/3 and (20/3)/4 = 5/3; Welch–Satterthwaite df
    va, vb = 1 / 3, 5 / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    half = student_t.ppf(0.975, df) * math.sqrt(va + vb)
    assert units == 7 and difference.delta == pytest.approx(-3.0, abs=1e-12)
    assert (difference.low, difference.high) == pytest.approx((-3 - half, -3 + half), abs=1e-12)


def test_a_models_figure_is_its_mean_over_units_with_students_interval():
    figure = ModelFigure.of([1.0, 2.0, 3.0, None])
    half = student_t.ppf(0.975, 2) * 1.0 / math.sqrt(3)  # s = 1
    assert (figure.mean, figure.units) == (2.0, 3)
    assert (figure.low, figure.high) == pytest.approx((2 - half, 2 + half), abs=1e-12)
    assert ModelFigure.of([5.0]) == ModelFigure(5.0, None, None, 1)
    assert ModelFigure.of([None]) == ModelFigure(None, None, None, 0)


@pytest.mark.parametrize("difference, paper_sign, better, word", [
    (Difference(-1.0, -2.0, -0.5), -1, "lower", "agrees"),
    (Difference(-1.0, -2.0, -0.5), +1, "higher", "contradicts"),
    (Difference(-1.0, -2.0, 0.5), -1, "lower", "inconclusive"),
    (Difference(-1.0), -1, "lower", "inconclusive (too few units for an interval)"),
    (Difference(-1.0, -2.0, -0.5), 0, "lower", "DIFF family better"),
    (Difference(-1.0, -2.0, -0.5), 0, "higher", "DIFF family worse"),
    (Difference(1.0, 0.5, 2.0), 0, "higher", "DIFF family better"),
])
def test_the_verdict_words_are_the_claims_words(difference, paper_sign, better, word):
    assert effect_word(difference, paper_sign, better) == word


def test_several_pairs_share_their_word_or_say_what_it_depends_on():
    same = [PairEffect("A", "T1", None, True, 3, "agrees"), PairEffect("A", "T2", None, False, 6, "agrees")]
    assert overall_verdict(same) == "agrees"
    differing = [same[0], PairEffect("A", "T2", None, False, 6, "inconclusive")]
    assert overall_verdict(differing) == "depends on the pair: agrees for A − T1; inconclusive for A − T2"


def given(name, family, attention):
    return GivenModel(name, name.upper(), family, f"/nowhere/{name}", attention, 1, 64, "tokenizer")


def test_per_token_figures_are_compared_per_byte_and_paired_only_on_the_same_tokens():
    """NLL per token times each model's tokens per byte of the text; the DIFF model and the first
    Transformer tokenise the text alike (paired), the second otherwise (Welch)."""
    models = [given("diff", "DIFF family", "diff"), given("same", "Transformer", "standard"),
              given("other", "Transformer", "standard")]
    text = StudyText("test", ["abcd", "ef"])  # 6 bytes
    plan = StudyPlan(models, 64, {"position-nll": None}, text, {"diff": 3, "same": 3, "other": 6},
                     {"diff": "s1", "same": "s1", "other": "s2"})
    nll = {"diff": [2.0, 4.0, 6.0], "same": [3.0, 3.0, 9.0], "other": [1.0, 2.0]}  # nats per token, per window
    measurements = {name: ModelMeasurement(name, {}, {"position-nll": {"per_window": v}}, {}, {}, "cpu")
                    for name, v in nll.items()}
    (effect,) = study_effects(plan, measurements)
    assert effect.claim == "Language modelling"
    # per byte: diff 3 tokens / 6 bytes → 1, 2, 3; same → 1.5, 1.5, 4.5; other 6 / 6 → 1, 2
    assert effect.figures["DIFF"].mean == pytest.approx(2.0) and effect.figures["SAME"].mean == pytest.approx(2.5)
    assert effect.figures["OTHER"].mean == pytest.approx(1.5)
    paired, unpaired = effect.pairs
    assert paired.paired and paired.units == 3 and not unpaired.paired and unpaired.units == 5
    differences = [1 - 1.5, 2 - 1.5, 3 - 4.5]  # by hand, window by window
    assert paired.difference.delta == pytest.approx(statistics.fmean(differences), abs=1e-12)
    half = student_t.ppf(0.975, 2) * statistics.stdev(differences) / math.sqrt(3)
    assert paired.difference.high == pytest.approx(statistics.fmean(differences) + half, abs=1e-12)
    assert unpaired.difference.delta == pytest.approx(2.0 - 1.5, abs=1e-12)


def test_each_effect_reads_its_units_as_the_hand_computation_does():
    by_claim = {(e.evaluation, e.measure): e for e in EFFECTS}
    read = {key: effect.values for key, effect in by_claim.items()}
    outliers_result = {"attention_logits": {"median": 2.0, "per_window_top1": [4.0, 10.0]},
                       "hidden_states": {"median": 0.5, "per_window_top1": [3.0, 1.0], "per_layer_median": [1.0, 0.25],
                                         "per_window_layer_top1": [[3.0, 0.5], [1.0, 0.75]]}}
    logit_ratio, hidden_ratio, massive = (next(v for (ev, m), v in read.items() if ev == "outliers" and word in m)
                                          for word in ("logit", "|hidden state| over the model", "layer ratio"))
    assert logit_ratio(outliers_result) == [2.0, 5.0]  # 4 / 2, 10 / 2
    assert hidden_ratio(outliers_result) == [6.0, 2.0]  # 3 / 0.5, 1 / 0.5
    assert massive(outliers_result) == [3.0, 3.0]  # max(3 / 1, 0.5 / 0.25), max(1 / 1, 0.75 / 0.25)
    rows = {"results": [{"bits": None, "per_window_loss": [1.0, 2.0], "cloze_correct": [1, 1, 0]},
                        {"bits": 8, "per_window_loss": [1.5, 2.0], "cloze_correct": [1, 1, 0]},
                        {"bits": 4, "per_window_loss": [3.0, 2.5], "cloze_correct": [0, 1, 1]}]}
    added, lost = (next(v for (ev, m), v in read.items() if ev == "quantization" and word in m)
                   for word in ("NLL added", "cloze"))
    assert added(rows) == [2.0, 0.5] and lost(rows) == [1, 0, -1]  # the 4-bit row against full precision


def test_a_saved_measurement_is_reused_only_when_asked_the_same():
    saved = {"name": "m", "asked": {"seq_len": 64}, "results": {}, "errors": {}, "seconds": {}, "device": "cpu"}
    assert load_measurement(saved, {"seq_len": 64}).name == "m"
    assert load_measurement(saved, {"seq_len": 128}) is None


# --- the per-unit figures the evaluations record, against independent computations ---------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random DIFF model of this project with the byte tokenizer, context 320."""
    config = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=2, attention="diff", ffn_hidden=64,
                         max_seq_len=320)
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny") / "diff"
    LanguageModel(config).save_pretrained(path, ByteTokenizer())
    return load_model(path, label="tiny")


def test_outliers_record_each_windows_largest_hidden_state_per_layer(tiny):
    options = OutlierOptions(tokens=4 * 64, seq_len=64, batch_size=3)  # 4 windows, batches of 3 and 1
    text = EvalText([TEXT])
    result = outliers(tiny, options, text, progress=False)
    windows = text.windows(tiny.tokenizer, 64, 4)[:, :-1]
    expected = []  # by hand: each block's output, its largest magnitude in each window
    hooks = [layer.register_forward_hook(lambda _m, _i, out: expected.append(out.abs().amax(dim=(1, 2))))
             for layer in tiny.model.layers]
    try:
        with torch.no_grad():
            tiny.model(windows)
    finally:
        for hook in hooks:
            hook.remove()
    hidden = result["hidden_states"]
    assert torch.tensor(hidden["per_window_layer_top1"]) == pytest.approx(torch.stack(expected, dim=1), abs=1e-6)
    assert hidden["per_window_top1"] == pytest.approx(torch.stack(expected, dim=1).amax(dim=1).tolist(), abs=1e-6)
    logits = result["attention_logits"]
    assert len(logits["per_window_top1"]) == 4 and max(logits["per_window_top1"]) == pytest.approx(logits["top1"])


def test_quantization_records_each_windows_loss(tiny):
    options = QuantizationOptions(bits=(4,), loss_windows=3, cloze_items=2, needle_samples=0, batch_size=2)
    text = EvalText([TEXT])
    result = quantization(tiny, options, text, progress=False)
    full = next(row for row in result["results"] if row["bits"] is None)
    windows = text.windows(tiny.tokenizer, tiny.max_seq_len, 3)
    with torch.no_grad():  # by hand: the cross-entropy of each window, unquantised
        logits, _ = tiny.model(windows[:, :-1])
        nll = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(dim=1)
    assert full["per_window_loss"] == pytest.approx(nll.tolist(), abs=1e-5)
    assert all(len(row["per_window_loss"]) == 3 for row in result["results"])


def test_attention_noise_records_each_document_as_the_pooled_figure_of_a_lone_document(tiny):
    """With one document per depth, a document's figure is its depth's (pooled over its rows and layers)."""
    options = AttentionNoiseOptions(depths=(0.0, 0.5, 1.0), samples=1, length=150, batch_size=1)
    result = attention_noise(tiny, options, EvalText([TEXT]), progress=False)
    for group in ("answer", "noise", "other"):
        assert result["per_document"][group] == pytest.approx(result[group], abs=1e-6)
    options = AttentionNoiseOptions(depths=(0.0, 1.0), samples=3, length=150, batch_size=2)
    several = attention_noise(tiny, options, EvalText([TEXT]), progress=False)
    assert len(several["per_document"]["answer"]) == 6


def test_needle_records_each_documents_share_of_its_queries_in_cell_order(tiny, monkeypatch):
    """A planted decoder answers a query right when the number asked for is even, else wrong: each
    document's share must average, cell by cell, to the accuracies the evaluation pools."""
    import diff_transformer.evaluation.needle as module

    def decode(model, prompts, max_new):
        answers = []
        for prompt in prompts:
            text = ByteTokenizer().decode(prompt)
            city = text.rsplit("The magic number of ", 1)[1].removesuffix(" is")  # the prompt ends "... of CITY is"
            number = re.search(rf" The magic number of {re.escape(city)} is (\d+)\.", text)[1]
            answers.append(list(f" {number}".encode()) if int(number) % 2 == 0 else list(b" x"))
        return answers

    monkeypatch.setattr(module, "greedy_decode", decode)
    options = NeedleOptions(settings=("3:2",), heatmap="1:1", depths=(0.0, 1.0), lengths=(300,), samples=3)
    result = needle(tiny, options, EvalText([TEXT]), progress=False)
    cells = [tuple(c) for c in result["cells"]]
    assert cells == [("3:2", 0.0, 300), ("3:2", 1.0, 300), ("1:1", 0.0, 300), ("1:1", 1.0, 300)]
    per_document = result["per_document"]
    assert len(per_document) == 12 and set(per_document[:6]) <= {0.0, 0.5, 1.0} and len(set(per_document)) > 1
    table, heat = result["table"]["3:2"]["by_depth"], result["heatmap"]["accuracy"][0]
    for i, pooled in enumerate([*table, *heat]):  # every document of a cell asks as many queries
        assert statistics.fmean(per_document[3 * i : 3 * i + 3]) == pytest.approx(pooled, abs=1e-12)


# --- the checks, before any work -------------------------------------------------------------------------


def checkpoint(path, attention="diff", context=128, tokenizer=None, vocab_size=257):
    """A tiny random model of this project saved at ``path`` with ``tokenizer`` (None: the byte
    tokenizer; False: none)."""
    config = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2 if attention == "diff" else 4,
                         attention=attention, ffn_hidden=64, max_seq_len=context)
    LanguageModel(config).save_pretrained(path, ByteTokenizer() if tokenizer is None else tokenizer or None)
    return str(path)


def study(models, *, evaluations=("position-nll",), options=None, **pretrained):
    """A pretrained-models study config: ``models`` {name: (checkpoint, family)}."""
    from diff_transformer.experiments.config import experiment_from_dict

    return experiment_from_dict({
        "name": "study",
        "compare": {"evaluations": list(evaluations),
                    "evaluation_options": options or {"position-nll": {"windows": 2}}},
        "pretrained": {"models": {name: {"checkpoint": c, "family": f} for name, (c, f) in models.items()},
                       "texts": pretrained.pop("texts", "default"), **pretrained},
    })


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A DIFF and a Transformer of this project (byte tokenizer, context 128), and a text file."""
    root = tmp_path_factory.mktemp("pair")
    (root / "text.txt").write_text(TEXT)
    return {"diff": (checkpoint(root / "diff"), "DIFF family"),
            "standard": (checkpoint(root / "standard", "standard"), "Transformer")}, root / "text.txt"


@pytest.mark.parametrize("change, message", [
    (lambda m, root: {**m, "diff": (str(root / "absent"), "DIFF family")},
     r"pretrained\.models\.diff\.checkpoint: .*absent does not exist.*import-hf"),
    (lambda m, root: {**m, "diff": (m["standard"][0], "DIFF family")},
     r"pretrained\.models\.diff\.family: 'DIFF family', but .* attention 'standard'"),
    (lambda m, root: {**m, "bare": (checkpoint(root / "bare", tokenizer=False), "Transformer")},
     r"pretrained\.models\.bare\.checkpoint: .* holds no tokenizer"),
])
def test_a_checkpoint_that_cannot_serve_is_refused_by_name_before_anything_is_created(pair, tmp_path, change, message):
    models, _ = pair
    config = study(change(models, tmp_path))
    with pytest.raises(ConfigError, match=message):
        compare(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_weights_that_do_not_fit_the_config_are_refused_from_their_header(pair, tmp_path):
    models, _ = pair
    broken = tmp_path / "broken"
    shutil.copytree(models["diff"][0], broken)
    shutil.copy(models["standard"][0] + "/model.safetensors", broken / "model.safetensors")  # another model's
    with pytest.raises(ConfigError, match=r"pretrained\.models\.diff\.checkpoint: .*do not fit the model"):
        compare(study({**models, "diff": (str(broken), "DIFF family")}), tmp_path / "out", progress=False)


def test_contexts_too_short_are_refused_before_any_work(pair, tmp_path):
    models, _ = pair
    with pytest.raises(ConfigError, match=r"pretrained\.seq_len=256 is longer than the context of diff \(128\)"):
        compare(study(models, seq_len=256), tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match=r"compare\.evaluation_options\.outliers: 512 tokens of context"):
        compare(study(models, evaluations=["outliers"], options={"outliers": {"seq_len": 512}}), tmp_path / "out")
    with pytest.raises(ConfigError, match=r"evaluation_options\.attention-noise: for diff \(ByteTokenizer of 257 "
                                          r"tokens\), a needle document .* needs at least"):
        compare(study(models, evaluations=["attention-noise"], options={"attention-noise": {"length": 64}}),
                tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_text_too_short_or_that_a_tokenizer_cannot_give_back_is_refused(pair, tmp_path):
    from tokenizers import Tokenizer, models as token_models, pre_tokenizers

    models, text = pair
    tokens, needed = len(TEXT.encode()) + 1, 100 * (128 + 1)  # bytes and an end-of-text; 100 windows of 128 + 1
    with pytest.raises(ConfigError, match=rf"pretrained\.texts: .* is {tokens:,} tokens for diff; position-nll needs "
                                          rf"{needed:,} with its options"):
        compare(study(models, texts=str(text), options={"position-nll": {"windows": 100}}), tmp_path / "out")
    words = Tokenizer(token_models.WordLevel({"<|endoftext|>": 0, "It": 1, "[UNK]": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    from diff_transformer.tokenizer import BPETokenizer

    lossy = checkpoint(tmp_path / "lossy", "standard", tokenizer=BPETokenizer(tmp_path / "words.json"), vocab_size=3)
    with pytest.raises(ConfigError, match=r"the tokenizer of lossy .* does not give document 0 of .* back: character"):
        compare(study({**models, "lossy": (lossy, "Transformer")}, texts=str(text)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_texts_come_from_a_file_of_records_or_a_prepared_datasets_validation_documents(tmp_path):
    from diff_transformer.data import prepare
    from diff_transformer.experiments.config import PretrainedConfig
    from diff_transformer.experiments.pretrained import read_texts

    records = ["First record, with a café.", "Second record."]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps({"body": r}) + "\n" for r in records))
    settings = PretrainedConfig(enabled=False, texts=str(tmp_path / "records.jsonl"), text_field="body")
    assert read_texts(settings).documents == records
    assert read_texts(PretrainedConfig(enabled=False, texts=str(tmp_path / "records.jsonl"), text_field="body",
                                       max_chars=20)).documents == [records[0][:20]]
    documents = [f"Document {i}: " + "word " * (50 + i) for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    meta = prepare([tmp_path / "docs.jsonl"], tmp_path / "dataset", tokenizer="default", val_fraction=0.2,
                   progress=False)
    read = read_texts(PretrainedConfig(enabled=False, texts=str(tmp_path / "dataset"))).documents
    assert len(read) == meta["val"]["documents"] > 0 and set(read) <= set(documents)
    with pytest.raises(ConfigError, match=r"pretrained\.texts: .*nowhere does not exist"):
        read_texts(PretrainedConfig(enabled=False, texts=str(tmp_path / "nowhere")))


@pytest.mark.parametrize("section, message", [
    ({"models": {"a": {"checkpoint": "x", "family": "Transformer"}}}, r"give at least one model of each \(got a "
                                                                        r"\(Transformer\)\)"),
    ({"models": {"a": {"checkpoint": "x", "family": "DIFF"}}}, r"pretrained\.models\.a\.family must be one of"),
    ({"models": {"a/b": {"checkpoint": "x", "family": "DIFF family"}}}, r"pretrained\.models\.a/b: a model's name"),
    ({"models": {"a": {"checkpoint": "x", "family": "Transformer", "path": "y"}}}, r"unknown key pretrained\.models\.a"
                                                                                    r"\.path"),
    ({"device": "tpu"}, r"pretrained\.device must be one of"),
])
def test_a_bad_pretrained_section_is_an_error_naming_it(section, message):
    from diff_transformer.experiments.config import experiment_from_dict

    with pytest.raises(ConfigError, match=message):
        experiment_from_dict({"pretrained": {"models": {"a": {"checkpoint": "x", "family": "Transformer"},
                                                        "b": {"checkpoint": "y", "family": "DIFF family"}},
                                             **section}})


@pytest.mark.parametrize("argv, named", [
    (["--steps", "3"], "--steps"), (["--seeds", "2"], "--seeds"), (["--no-eval"], "--no-eval"),
    (["--lr-grid", "1e-3"], "--lr-grid"), (["--nproc", "2"], "--nproc"),
])
def test_the_command_refuses_what_a_study_without_training_does_not_take_in_one_line(argv, named, tmp_path, capsys):
    assert main(["compare", "--config", "pretrained", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err and "trains nothing" in err
    assert main(["train", "--config", "pretrained"]) == 2
    assert "not a model to train" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- the study end to end, on tiny random transformers models imported with import-hf --------------------


def llama_directory(path, vocab_size: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))


def diffllama_directory(path, vocab_size: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.DiffLlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                          max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
    transformers.DiffLlamaForCausalLM(config).save_pretrained(str(path))


# Every family the study is tested on: how to build a tiny random directory of it as released (what
# `import-hf` reads, a tokenizer of ``vocab_size`` tokens beside it) and its family. A new family
# (Motif) is one more entry; each is read with the shipped BPE, and the Llama with raw bytes as well
# (different tokenizers: unpaired units).
def motif_directory(layout: str):
    """Motif-2.6B's layout (DIFF) or Motif-2-12.7B's (grouped differential attention), tiny and random."""
    from motif_fixtures import make_tiny_motif_dir

    return lambda path, vocab_size: make_tiny_motif_dir(
        path, layout, gqa=True, tokenizer=False,
        config_overrides={"vocab_size": vocab_size, "max_position_embeddings": 256})


FAMILIES = {
    "diffllama": (diffllama_directory, "DIFF family"),
    "motif": (motif_directory("2.6b"), "DIFF family"),
    "motif-gda": (motif_directory("12.7b"), "DIFF family"),
    "llama": (llama_directory, "Transformer"),
}
TOKENIZERS = {"bpe": 8192, "bytes": 257}
MODELS = {**{name: (name, "bpe") for name in FAMILIES}, "llama-bytes": ("llama", "bytes")}
BUDGET = ("compare.evaluation_options={needle: {settings: ['1:1'], heatmap: '1:1', lengths: [192, 256], depths: [0.0, "
          "1.0], samples: 2}, attention-noise: {depths: [0.0, 1.0], samples: 2}, outliers: {tokens: 1024}, "
          "attention-sink: {windows: 4}, position-nll: {windows: 4}, quantization: {bits: [4], loss_windows: 4, "
          "cloze_items: 8, needle_samples: 0}, context-qa: {max_new_tokens: 4, resamples: 50}}")


def imported(root, name):
    """Model ``name`` of MODELS built as released and imported with the import-hf command."""
    family, tokenizer = MODELS[name]
    source = root / f"hf-{name}"
    torch.manual_seed(len(name))
    FAMILIES[family][0](source, TOKENIZERS[tokenizer])
    if tokenizer == "bpe":
        shutil.copy(DEFAULT_TOKENIZER_FILE, source / "tokenizer.json")
    else:
        from diff_transformer.interop.hf import byte_tokenizer_json

        byte_tokenizer_json().save(str(source / "tokenizer.json"))
    assert main(["import-hf", str(source), str(root / name)]) == 0
    return root / name


@pytest.mark.slow  # three tiny models through six evaluations at a context of 256 (about half a minute)
def test_the_study_runs_on_imported_models_of_each_family_and_reports_every_effect_with_its_interval(tmp_path,
                                                                                                    capsys):
    entries = {name: {"checkpoint": str(imported(tmp_path, name)), "family": FAMILIES[MODELS[name][0]][1]}
               for name in MODELS}
    flags = ["--set", f"pretrained.models={json.dumps(entries)}"]  # JSON is YAML
    out = tmp_path / "out"
    assert main(["compare", "--config", "pretrained", "--out", str(out), "--set", BUDGET, *flags]) == 0, \
        capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    report = (out / "report.md").read_text()
    assert "## The effects: DIFF family − Transformer" in report and "differ in more than attention" in report
    assert {p.name for p in (out / "eval").glob("*.json")} == {f"{n}.json" for n in load_experiment(
        "pretrained").compare.evaluations}
    assert metrics["seq_len"] == 256 and not metrics["not_run"]
    diff_models = [n for n in MODELS if FAMILIES[MODELS[n][0]][1] == "DIFF family"]
    baselines = [n for n in MODELS if n not in diff_models]
    for effect in metrics["effects"]:
        assert len(effect["pairs"]) == len(diff_models) * len(baselines)
        for figure in effect["figures"].values():
            assert all(math.isfinite(figure[k]) for k in ("mean", "low", "high")), effect["measure"]
        for pair in effect["pairs"]:
            difference = pair["difference"]
            assert all(math.isfinite(difference[k]) for k in ("delta", "low", "high")), effect["measure"]
            assert pair["paired"] == (pair["baseline"] != "llama-bytes")  # the same tokens: the shipped BPE
    assert {row["tokenizer"] for row in metrics["models"]} == {"BPETokenizer of 8,192 tokens",
                                                               "ByteTokenizer of 257 tokens"}
    marks = {p.name: p.stat().st_mtime_ns for p in (out / "models").iterdir()}
    assert main(["compare", "--config", "pretrained", "--out", str(out), "--resume", "--set", BUDGET, *flags]) == 0
    assert "already done, reusing" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in (out / "models").iterdir()} == marks  # nothing measured again
    # A second study into the folder is refused, as every study's: without --resume, and with --resume
    # under other settings; the finished study stays as it was.
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    other = ["--set", BUDGET, *flags, "--set", "pretrained.max_chars=3000000"]
    assert main(["compare", "--config", "pretrained", "--out", str(out), *other]) == 2
    assert "already holds a diff-transformer comparison" in capsys.readouterr().err
    assert main(["compare", "--config", "pretrained", "--out", str(out), "--resume", *other]) == 2
    assert "this one differs: pretrained.max_chars" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"} == files
