"""A probe of malformed input (issue 53): every command, fed a value of the wrong kind for each field it
reads from a user's file (a string for a number or a boolean, null, NaN, a negative, a size beyond any
machine, the wrong file) or on its command line, ends with exit status 2 and one ``error:`` line that
names the field (and the file), writing nothing.

One row per (command, field, bad value): the tables below. A field a reader starts to take is covered
by adding it to its table (its kind picks the bad values: BAD_VALUES)."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest

from diff_transformer.cli import main
from diff_transformer.config import ModelConfig
from diff_transformer.interop.hf import save_hf
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import ByteTokenizer
from motif_fixtures import make_tiny_motif_dir

HUGE = 10**20  # beyond every limit (a seed's 2**63 - 1 included)
# The bad values of each kind of field, and the kind (the first word of the value's description).
BAD_VALUES = {
    "int": [("string", "64"), ("bool", True), ("float", 2.5), ("nan", math.nan), ("negative", -3), ("huge", HUGE)],
    "number": [("string", "1e-5"), ("bool", True), ("nan", math.nan), ("negative", -1.0), ("inf", math.inf)],
    "bool": [("string", "false"), ("number", 0)],
    "str": [("number", 5), ("list", ["silu"])],
}
NULL = ("null", None)

# --- import-hf: config.json (Llama, DiffLlama; Motif's own fields on a Motif directory) --------------------
# (field, kind, null refused: the reader has no default for it)
HF_FIELDS = [
    ("vocab_size", "int", True), ("hidden_size", "int", True), ("intermediate_size", "int", True),
    ("num_hidden_layers", "int", True), ("num_attention_heads", "int", True), ("num_key_value_heads", "int", False),
    ("head_dim", "int", False), ("max_position_embeddings", "int", False), ("rms_norm_eps", "number", True),
    ("initializer_range", "number", False), ("lambda_std_dev", "number", False), ("rope_theta", "number", False),
    ("tie_word_embeddings", "bool", False), ("attention_bias", "bool", False), ("mlp_bias", "bool", False),
    ("hidden_act", "str", False),
]
MOTIF_FIELDS = [("num_noise_heads", "int", False), ("attn_rms_norm_eps", "number", True),
                ("qkv_bias", "bool", False), ("use_bias", "bool", False)]
ROPE_FIELDS = [("rope_theta", "number"), ("factor", "number")]
# tokenizer_config.json and config.json's token ids, beside a tokenizer.json
TOKEN_FIELDS = [("tokenizer_config.json", "eos_token", [("number", 5), ("list", ["<|endoftext|>"])]),
                ("tokenizer_config.json", "bos_token", [("bool", True)]),
                ("config.json", "eos_token_id", [("string", "256"), ("negative", -1), ("bool", True)]),
                ("config.json", "bos_token_id", [("float", 2.5)])]
# --- eval scaling: a results file's run fields ---------------------------------------------------------------
RUN_FIELDS = [("loss", "number", True), ("params", "number", False), ("parameters", "number", False),
              ("tokens", "number", False), ("seed", "int", False), ("attention", "str", True),
              ("label", "str", False)]
# --- eval context-qa: a --data line's fields -----------------------------------------------------------------
QA_FIELDS = [("context", [("number", 5), NULL, ("empty", " ")]), ("question", [("list", ["q"]), NULL]),
             ("answers", [("number", 5), NULL, ("empty", [])])]


def _rows(fields):
    """(field, value) for each field of a table and each bad value of its kind (null where it is refused)."""
    for field, kind, null_refused in fields:
        for bad in BAD_VALUES[kind] + ([NULL] if null_refused else []):
            yield pytest.param(field, bad[1], id=f"{field}-{bad[0]}")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny DiffLlama directory as export-hf writes it (with the byte tokenizer), a tiny Motif-2.6B one,
    a checkpoint of this project and a context-qa data file."""
    root = tmp_path_factory.mktemp("malformed")
    save_hf(LanguageModel(ModelConfig.from_preset("debug", attention="diff", vocab_size=320)), root / "diffllama",
            ByteTokenizer())
    make_tiny_motif_dir(root / "motif", shards=1, tokenizer=False)
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257, attention="standard")).save_pretrained(
        root / "ckpt", ByteTokenizer())
    (root / "qa.jsonl").write_text(json.dumps({"context": "the cat sat", "question": "who sat", "answers": ["cat"]})
                                   + "\n")
    (root / "empty.txt").write_text(" \n")
    return {"root": root, "diffllama": root / "diffllama", "motif": root / "motif", "ckpt": root / "ckpt",
            "qa": root / "qa.jsonl", "empty": root / "empty.txt"}


def one_error_line(capsys, argv: list[str]) -> str:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, captured.err)
    assert "Traceback" not in captured.err and "unexpected" not in lines[0]
    return lines[0]


def _edited(source: Path, tmp_path: Path, file: str, edit) -> Path:
    directory = tmp_path / "in"
    shutil.copytree(source, directory)
    data = json.loads((directory / file).read_text())
    edit(data)
    (directory / file).write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    return directory


def _import_refused(capsys, directory: Path, tmp_path: Path, *flags: str) -> str:
    out = tmp_path / "out"
    line = one_error_line(capsys, ["import-hf", directory, out, *flags])
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # no output, no lock, no temporary folder
    return line


@pytest.mark.parametrize("field, value", list(_rows(HF_FIELDS)))
def test_import_hf_config_field(field, value, hf_dirs, tmp_path, capsys):
    directory = _edited(hf_dirs["diffllama"], tmp_path, "config.json", lambda c: c.update({field: value}))
    line = _import_refused(capsys, directory, tmp_path)
    assert f"config.json: {field} is " in line


@pytest.mark.parametrize("field, value", list(_rows(MOTIF_FIELDS)))
def test_import_hf_motif_config_field(field, value, hf_dirs, tmp_path, capsys):
    directory = _edited(hf_dirs["motif"], tmp_path, "config.json", lambda c: c.update({field: value}))
    line = _import_refused(capsys, directory, tmp_path)
    assert f"config.json: {field} is " in line


@pytest.mark.parametrize("section", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("field, value", [pytest.param(f, v, id=f"{f}-{k}") for f, kind in ROPE_FIELDS
                                          for k, v in BAD_VALUES[kind]])
def test_import_hf_rope_field(section, field, value, hf_dirs, tmp_path, capsys):
    def edit(config):
        config.pop("rope_parameters")
        config[section] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, field: value}

    line = _import_refused(capsys, _edited(hf_dirs["diffllama"], tmp_path, "config.json", edit), tmp_path)
    assert f"config.json: {section}: {field} is " in line


@pytest.mark.parametrize("file, field, value", [pytest.param(f, field, v, id=f"{field}-{k}")
                                                for f, field, bads in TOKEN_FIELDS for k, v in bads])
def test_import_hf_token_field(file, field, value, hf_dirs, tmp_path, capsys):
    line = _import_refused(capsys, _edited(hf_dirs["diffllama"], tmp_path, file, lambda c: c.update({field: value})),
                           tmp_path)
    assert f"{file}: {field} is " in line


@pytest.mark.parametrize("edit, words", [pytest.param(edit, words, id=case) for case, edit, words in [
    ("layers-beyond-the-files", {"num_hidden_layers": 3},
     "num_hidden_layers is 3 but the weights in {dir} hold 2 layers (model.layers.0 to model.layers.1): the config "
     "and the files disagree"),
    ("layers-beyond-any-model", {"num_hidden_layers": 10_000},
     "num_hidden_layers is 10000; an integer from 1 to 1,000"),
    ("width-against-the-embedding", {"hidden_size": 96, "head_dim": 24},
     "vocab_size 320 and hidden_size 96 but model.embed_tokens.weight is (320, 64)"),
    ("legacy-rope-scaling-beside-v5", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling (kind 'yarn') and rope_parameters (kind 'default') disagree"),
    ("rope-parameters-not-an-object", {"rope_parameters": "default"}, "rope_parameters must be a JSON object"),
]])
def test_import_hf_config_against_the_files(edit, words, hf_dirs, tmp_path, capsys):
    """The config and the tensors beside it: one line saying which disagree, never a list of every tensor."""
    directory = _edited(hf_dirs["diffllama"], tmp_path, "config.json", lambda c: c.update(edit))
    line = _import_refused(capsys, directory, tmp_path)
    assert words.format(dir=directory) in line and len(line) < 400


def test_import_hf_index_entry_not_a_shard_name(hf_dirs, tmp_path, capsys):
    directory = tmp_path / "in"
    shutil.copytree(hf_dirs["diffllama"], directory)
    (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(directory / "model-00001-of-00001.safetensors"), "pt") as f:
        weight_map = {name: "model-00001-of-00001.safetensors" for name in f.keys()}
    weight_map["lm_head.weight"] = 7
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    line = _import_refused(capsys, directory, tmp_path)
    assert "model.safetensors.index.json: weight_map entries must name a shard file, got 'lm_head.weight': 7" in line


# --- eval scaling --results ------------------------------------------------------------------------------------


def _results(tmp_path: Path, runs: list[dict]) -> Path:
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))
    return path


GOOD_RUNS = [{"attention": kind, "params": params, "tokens": 1e6, "loss": loss, "seed": 0}
             for kind in ("standard", "diff") for params, loss in ((1e4, 4.0), (2e4, 3.8), (4e4, 3.7))]


@pytest.mark.parametrize("field, value", list(_rows(RUN_FIELDS)))
def test_eval_scaling_results_field(field, value, tmp_path, capsys):
    runs = [dict(run) for run in GOOD_RUNS]
    runs[1][field] = value
    out = tmp_path / "eval"
    line = one_error_line(capsys, ["eval", "scaling", "--results", _results(tmp_path, runs), "--out", out])
    assert f"runs.json: run 1: {field} is " in line and not out.exists()


@pytest.mark.parametrize("case, words", [
    ("given-twice", "runs.json: results file given twice"), ("not-utf8", "runs.json: not UTF-8 text"),
])
def test_eval_scaling_results_file(case, words, tmp_path, capsys):
    path = _results(tmp_path, GOOD_RUNS)
    files = [path, tmp_path / ".." / tmp_path.name / "runs.json"]
    if case == "not-utf8":
        path.write_bytes(b"\xff\xfe[]")
        files = [path]
    out = tmp_path / "eval"
    line = one_error_line(capsys, ["eval", "scaling", "--results", *files, "--out", out])
    assert words in line and not out.exists()


# --- eval context-qa --data ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [pytest.param(f, v, id=f"{f}-{k}") for f, bads in QA_FIELDS
                                          for k, v in bads])
def test_eval_context_qa_data_field(field, value, hf_dirs, tmp_path, capsys):
    record = {"context": "the cat sat", "question": "who sat", "answers": ["cat"], field: value}
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps(record) + "\n")
    line = one_error_line(capsys, ["eval", "context-qa", "--checkpoint", hf_dirs["ckpt"], "--data", data,
                                   "--out", tmp_path / "eval"])
    assert "qa.jsonl:1: " in line and f"'{field}'" in line


# --- options: a value beyond any machine, or an option that cannot apply -----------------------------------


OPTIONS = [
    ("eval-max-seq-len-huge", ["eval", "context-qa", "--checkpoint", "{ckpt}", "--data", "{qa}", "--max-seq-len",
                               "100000000"], "argument --max-seq-len: '100000000' is not valid (must be in [1, "),
    ("eval-text-not-read", ["eval", "context-qa", "--checkpoint", "{ckpt}", "--data", "{qa}", "--text", "{empty}"],
     "--text is not read by context-qa"),
    ("eval-text-empty", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--text", "{empty}", "--out", "{out}"],
     "--text {empty}: empty"),
    ("convert-text-empty", ["convert", "{ckpt}", "{out}", "--text", "{empty}"], "--text {empty}: empty"),
    ("import-no-tokenizer-eos", ["import-hf", "{diffllama}", "{out}", "--no-tokenizer", "--eos-token", "<|nope|>"],
     "--eos-token / --bos-token name the tokenizer's tokens, and --no-tokenizer imports none"),
    ("bench-gda-ratio-without-gda", ["bench", "model", "--gda-ratio", "2"],
     "--gda-ratio applies to the gda architecture, which --architectures does not list"),
    ("compare-budget-flops-huge", ["compare", "--budget", "flops=1e30", "--out", "{out}"],
     "run.budget.amount=1e+30 flops is "),
    ("compare-budget-seconds-huge", ["compare", "--budget", "seconds=1e30", "--out", "{out}"],
     "run.budget.amount=1e+30 seconds is more than a year"),
    ("pretrained-budget-quoted-as-typed", ["compare", "--config", "pretrained", "--budget", "flops=1e15", "--out",
                                           "{out}"], "error: --budget flops=1e+15: run.budget: the pretrained study"),
    ("train-layers-huge", ["train", "--config", "tiny", "--set", "model.n_layers=1000000", "--set",
                           "run.out_dir={out}"], "n_layers=1,000,000 is beyond any model"),
    ("train-seq-len-huge", ["train", "--config", "tiny", "--set", "model.max_seq_len=100000000", "--set",
                            "run.out_dir={out}"], "max_seq_len=100,000,000 is beyond any model"),
    ("train-steps-huge", ["train", "--config", "tiny", "--set", "run.steps=100000000000", "--set",
                          "run.out_dir={out}"], "run.steps=100,000,000,000 is beyond any run"),
    ("train-steps-string", ["train", "--config", "tiny", "--set", 'run.steps="5"', "--set", "run.out_dir={out}"],
     "run.steps must be int, got '5'"),
    ("train-lr-nan", ["train", "--config", "tiny", "--set", "optim.lr=.nan", "--set", "run.out_dir={out}"],
     "optim.lr must be a finite number"),
    ("train-batch-bool", ["train", "--config", "tiny", "--set", "data.batch_size=true", "--set", "run.out_dir={out}"],
     "data.batch_size must be int, got True"),
]


@pytest.mark.parametrize("argv, words", [pytest.param(argv, words, id=case) for case, argv, words in OPTIONS])
def test_option(argv, words, hf_dirs, tmp_path, capsys):
    fill = {**hf_dirs, "out": tmp_path / "out"}
    line = one_error_line(capsys, [a.format(**fill) for a in argv])
    assert words.format(**fill) in line and not (tmp_path / "out").exists()


# --- signals: nothing left behind, the exit status true --------------------------------------------------------


@pytest.mark.parametrize("point, signum, code", [
    ("written", "SIGHUP", 129), ("written", "SIGTERM", 143), ("written", "SIGINT", 130),  # before the swap: stopped
    ("swapped", "SIGINT", 0), ("swapped", "SIGHUP", 0),  # mid-swap: the import completes and says so
], ids=lambda v: str(v))
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_import_hf_stopped_by_a_signal(point, signum, code, overwrite, hf_dirs, tmp_path, monkeypatch, capsys):
    """A signal that lands while import-hf writes its checkpoint (in the temporary folder, or between
    the renames that put it in place) leaves no lock, temporary folder or ``.old`` copy: stopped before
    the swap, the exit status is the signal's and OUT is as it was; landing in the swap, the new
    checkpoint is whole and the command exits 0 saying so."""
    import os
    import signal

    from diff_transformer import checkpoint

    out = tmp_path / "out"
    if overwrite:
        assert main(["import-hf", str(hf_dirs["diffllama"]), str(out), "--no-tokenizer"]) == 0
    before = sorted(p.name for p in out.iterdir()) if overwrite else None
    capsys.readouterr()

    def deliver(here: str) -> None:
        if here == point:
            os.kill(os.getpid(), getattr(signal, signum))

    monkeypatch.setattr(checkpoint, "fault_point", deliver)
    argv = ["import-hf", str(hf_dirs["diffllama"]), str(out)] + ["--overwrite"] * overwrite
    assert main(argv) == code
    err, outs = capsys.readouterr()[::-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if code == 0 or overwrite else [])
    if code == 0:
        assert outs.strip() == f"wrote {out}" and err == ""
        LanguageModel.from_pretrained(out)  # whole
    else:
        assert err.strip() == f"interrupted by {signum}"
        assert before is None or sorted(p.name for p in out.iterdir()) == before  # the earlier import, whole


def test_prepare_a_save_to_disk_folder_whose_state_is_damaged(tmp_path, capsys):
    """Read as a plain folder, its error named dataset_info.json's fields; now the damaged file."""
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "state.json").write_text("{broken")
    (folder / "dataset_info.json").write_text('{"features": {}}')
    (folder / "data-00000-of-00001.arrow").write_bytes(b"x")
    line = one_error_line(capsys, ["prepare", folder, "--out", tmp_path / "out"])
    assert f"{folder / 'state.json'}: not a JSON object with _data_files" in line and not (tmp_path / "out").exists()


def test_an_mta_model_without_a_convolution_layer_says_so():
    """mta_conv_every=4 puts the convolutions on layers 2, 6, ...: a 2-layer model has none."""
    from diff_transformer.config import MTAWithoutConvolution

    with pytest.warns(MTAWithoutConvolution, match="mta_conv_every=4 and n_layers=2 has no convolution layer"):
        ModelConfig.from_preset("debug", attention="mta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MTAWithoutConvolution)
        ModelConfig.from_preset("debug", attention="mta", mta_conv_every=2)  # layer 1 convolves
        ModelConfig.from_preset("debug", attention="mta", mta_conv_every=3)
