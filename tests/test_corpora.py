"""`prepare` on corpora as they ship: Parquet files and folders of them, Arrow files and
`datasets.save_to_disk` folders, compressed JSON Lines; every bad file answered by name; the
texts streamed; tokenizing in several processes giving the dataset of one, byte for byte."""

from __future__ import annotations

import gzip
import importlib
import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diff_transformer.cli import main
from diff_transformer.data import InputError, prepare
from diff_transformer.data.inputs import scan_documents
from diff_transformer.data.prepare import encode_texts, encoded_batches, _Batch
from diff_transformer.extras import MissingExtraError
from diff_transformer.tokenizer import ByteTokenizer

prepare_module = importlib.import_module("diff_transformer.data.prepare")  # the package's `prepare` is the function

# Documents of varied lengths, with characters a byte-level BPE splits in many ways (accents, a dash,
# a line separator that str.splitlines would cut a JSON line at, an emoji), and one record of
# whitespace only, which every format skips.
TEXTS = [f"Document {i}: naïve café — {'words, and more words. ' * (3 + 5 * i)}\u2028end {i} 🙂\n" for i in range(24)]
RECORDS = TEXTS[:5] + ["  \n"] + TEXTS[5:]
DATASET_FILES = ("train.bin", "val.bin", "train.document_ends.npy", "val.document_ends.npy")


def write_text_folder(folder: Path) -> Path:
    folder.mkdir()
    for i, text in enumerate(TEXTS):  # d00.txt, d01.txt, ...: sorted as the records are ordered
        (folder / f"d{i:02d}.txt").write_text(text, encoding="utf-8")
    return folder


def jsonl_bytes(records=RECORDS, field: str = "text") -> bytes:
    return "".join(json.dumps({"id": i, field: text}) + "\n" for i, text in enumerate(records)).encode()


def table(records=RECORDS) -> pa.Table:
    return pa.table({"id": list(range(len(records))), "text": records})


def write_save_to_disk_folder(folder: Path, records=RECORDS, shards: int = 3) -> Path:
    """The layout `datasets.save_to_disk` writes: data-0000k-of-0000n.arrow (Arrow IPC streams),
    dataset_info.json and state.json listing the data files in order."""
    folder.mkdir()
    data = table(records)
    bounds = np.linspace(0, len(records), shards + 1).astype(int)
    names = [f"data-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)]
    for name, start, end in zip(names, bounds[:-1], bounds[1:]):
        with pa.ipc.new_stream(folder / name, data.schema) as writer:
            writer.write_table(data.slice(start, end - start), max_chunksize=2)
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_split": None}))
    return folder


def corpus_forms(root: Path) -> dict[str, list[Path]]:
    """The same documents as each input form `prepare` reads."""
    root.mkdir(parents=True, exist_ok=True)
    forms = {"txt": [write_text_folder(root / "texts")]}
    (root / "c.jsonl").write_bytes(jsonl_bytes())
    (root / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes()))
    (root / "c.jsonl.xz").write_bytes(lzma.compress(jsonl_bytes()))
    with pa.output_stream(str(root / "c.jsonl.zst"), compression="zstd") as out:
        out.write(jsonl_bytes())
    pq.write_table(table(), root / "c.parquet", row_group_size=4)  # several row groups
    (root / "shards").mkdir()  # a folder of Parquet shards: read in the order of their names
    pq.write_table(table(RECORDS[:10]), root / "shards" / "part-0.parquet")
    pq.write_table(table(RECORDS[10:]), root / "shards" / "part-1.parquet")
    with pa.OSFile(str(root / "c.arrow"), "wb") as sink, pa.ipc.new_file(sink, table().schema) as writer:
        writer.write_table(table(), max_chunksize=5)  # an Arrow IPC file (Feather v2), not a stream
    write_save_to_disk_folder(root / "saved")
    forms.update({suffix: [root / f"c.{suffix}"] for suffix in ("jsonl", "jsonl.gz", "jsonl.xz", "jsonl.zst",
                                                                 "parquet", "arrow")})
    forms.update({"parquet-folder": [root / "shards"], "save_to_disk": [root / "saved"]})
    return forms


def dataset_bytes(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in DATASET_FILES}


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, list[Path]]:
    return corpus_forms(tmp_path_factory.mktemp("corpora") / "inputs")


def test_every_form_of_the_same_text_gives_the_same_dataset_token_for_token(forms, tmp_path):
    """The done-when of issue 40: Parquet (a file, a folder of shards), Arrow (a file, a
    save_to_disk folder), JSON Lines plain and gzip-, xz- and zstd-compressed give the dataset the
    .txt files give, id for id, with the shipped BPE."""
    prepared = {}
    for name, inputs in forms.items():
        meta = prepare(inputs, tmp_path / name, val_fraction=0.2, progress=False)
        assert meta["documents"] == len(TEXTS), name
        prepared[name] = dataset_bytes(tmp_path / name)
    reference = prepared.pop("txt")
    assert 0 < len(reference["val.bin"]) < len(reference["train.bin"])  # both splits hold documents
    assert {name: files == reference for name, files in prepared.items()} == dict.fromkeys(prepared, True)
    # the texts themselves, decoded back: the ids are those of the documents, not only equal to each other
    ids = np.frombuffer(reference["train.bin"] + reference["val.bin"], dtype=np.uint16)
    eos = json.loads((tmp_path / "parquet" / "meta.json").read_text())["eos_id"]
    assert len(ids[ids == eos]) == len(TEXTS)


def test_meta_names_each_source_by_its_kind_and_each_document_by_its_record(forms, tmp_path):
    meta = prepare([*forms["parquet-folder"], *forms["jsonl.gz"], *forms["save_to_disk"]], tmp_path / "out",
                   tokenizer="bytes", val_fraction=0.2, progress=False)
    saved = forms["save_to_disk"][0]
    assert [(Path(s["path"]).name, s["kind"], s["documents"]) for s in meta["sources"]] == [
        ("part-0.parquet", "parquet", 9), ("part-1.parquet", "parquet", 15), ("c.jsonl.gz", "jsonl.gz", 24),
        *[(f"data-{k:05d}-of-00003.arrow", "arrow", n) for k, n in enumerate((7, 8, 9))],
    ]
    assert meta["bytes"] == 3 * sum(len(t.encode()) for t in TEXTS)
    names = meta["split"]["val_documents"]
    assert names and all(n.rsplit(":", 1)[1].isdigit() for n in names)
    # the record numbers are the rows (1-based): the whitespace-only record 6 is never one of them
    assert f"{forms['jsonl.gz'][0]}:6" not in names and str(saved / "data-00000-of-00003.arrow:6") not in names


def test_a_dataset_dict_folder_gives_each_split_in_its_order(tmp_path):
    folder = tmp_path / "dict"
    folder.mkdir()
    write_save_to_disk_folder(folder / "train", RECORDS[:12], shards=2)
    write_save_to_disk_folder(folder / "test", RECORDS[12:], shards=1)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    documents = scan_documents([folder])
    expected = [t for t in RECORDS[:12] + RECORDS[12:] if t.strip()]
    assert list(documents.texts()) == expected
    assert [Path(s["path"]).parent.name for s in documents.describe_sources()] == ["train", "train", "test"]


def test_a_folder_mixing_formats_is_read_file_by_file_in_sorted_order(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXTS[0])
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(TEXTS[1:3])))
    pq.write_table(table(TEXTS[3:5]), folder / "c.parquet")
    (folder / "d").mkdir()
    (folder / "d" / "e.md").write_text(TEXTS[5])
    (folder / "notes.csv").write_text("not,read\n")  # no suffix of a text file or a file of records
    documents = scan_documents([folder])
    assert list(documents.texts()) == TEXTS[:6]
    assert [s["kind"] for s in documents.describe_sources()] == ["text", "jsonl.gz", "parquet", "text"]


@pytest.mark.slow
def test_what_datasets_save_to_disk_writes_is_read_in_its_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"id": list(range(len(RECORDS))), "text": RECORDS}).save_to_disk(
        str(tmp_path / "saved"), num_shards=3)
    assert len(list((tmp_path / "saved").glob("data-*.arrow"))) == 3
    assert list(scan_documents([tmp_path / "saved"]).texts()) == [t for t in RECORDS if t.strip()]


# --- bad files, each answered by name -------------------------------------------------------------


def bad_parquet(kind: str):
    def write(path: Path) -> None:
        if kind == "empty":
            pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
        elif kind == "no-field":
            pq.write_table(pa.table({"body": ["a"], "id": [1]}), path)
        elif kind == "not-a-string":
            pq.write_table(pa.table({"text": [1, 2]}), path)
        elif kind == "null":
            pq.write_table(pa.table({"text": ["a", "b", None]}), path)
        elif kind == "corrupt":
            pq.write_table(table(), path)
            path.write_bytes(path.read_bytes()[:200])  # truncated: no footer
    return write


def corrupt_gzip(path: Path) -> None:
    path.write_bytes(gzip.compress(jsonl_bytes())[:60])


def corrupt_arrow(path: Path) -> None:
    path.write_bytes(b"\xff\xff\xff\xff" + os.urandom(40))


@pytest.mark.parametrize("name, write, message", [
    ("empty.parquet", bad_parquet("empty"), "{path}: empty input (no record with a non-empty 'text' field)"),
    ("x.parquet", bad_parquet("no-field"), "{path}: no field 'text' (fields: body, id); choose one with --text-field"),
    ("x.parquet", bad_parquet("not-a-string"), "{path}: field 'text' is int64, not a string"),
    ("x.parquet", bad_parquet("null"), "{path}:3: field 'text' is null, not a string"),
    ("x.parquet", bad_parquet("corrupt"), "{path}: not a readable Parquet file ("),
    ("x.jsonl.gz", corrupt_gzip, "{path}: not a readable .jsonl.gz file (Compressed file ended before the "
                                 "end-of-stream marker was reached)"),
    ("x.jsonl.xz", lambda p: p.write_bytes(b"not xz at all"), "{path}: not a readable .jsonl.xz file ("),
    ("x.jsonl.zst", lambda p: p.write_bytes(b"not zstd at all"), "{path}: not a readable .jsonl.zst file (ZSTD "),
    ("x.arrow", corrupt_arrow, "{path}: not a readable Arrow file ("),
    ("x.jsonl.gz", lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n{"text": 3}\n')),
     "{path}:2: field 'text' is int, not a string"),
    ("x.jsonl.gz", lambda p: p.write_bytes(gzip.compress(b'{"text": "a"}\n{"text": "\xe9"}\n')),
     "{path}: not UTF-8 text (invalid byte at offset 24); give UTF-8 text"),
], ids=["empty-shard", "no-field", "not-a-string", "null", "corrupt-parquet", "corrupt-gzip", "corrupt-xz",
        "corrupt-zstd", "corrupt-arrow", "gzip-non-string", "gzip-not-utf8"])
def test_a_bad_file_in_a_folder_of_good_ones_is_one_error_line_naming_it(name, write, message, tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    pq.write_table(table(), folder / "a-good.parquet")
    (folder / "b-good.jsonl").write_bytes(jsonl_bytes())
    write(folder / f"c-{name}")
    out = tmp_path / "out"
    assert main(["prepare", str(folder), "--out", str(out), "--tokenizer", "bytes", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.format(path=folder / f"c-{name}")) and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]  # nothing created


def test_a_save_to_disk_folder_whose_state_lists_no_files_is_named(tmp_path, capsys):
    folder = write_save_to_disk_folder(tmp_path / "saved")
    (folder / "state.json").write_text(json.dumps({"_data_files": ["data-00000-of-00003.arrow"]}))
    assert main(["prepare", str(folder), "--out", str(tmp_path / "out"), "--tokenizer", "bytes"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {folder / 'state.json'}: _data_files is not a list of")


def test_zstd_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "c.jsonl.zst").write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MissingExtraError, match=r"reading c\.jsonl\.zst \(zstd\) needs pyarrow, which the train extra "
                                                r"installs: pip install 'diff-transformer\[train\]'"):
        scan_documents([tmp_path / "c.jsonl.zst"])
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes()))  # gzip and xz need nothing beyond Python
    assert len(scan_documents([tmp_path / "c.jsonl.gz"])) == len(TEXTS)


def test_a_file_changed_between_the_check_and_the_tokenizing_is_named(tmp_path):
    (tmp_path / "c.jsonl").write_bytes(jsonl_bytes())
    documents = scan_documents([tmp_path / "c.jsonl"])
    (tmp_path / "c.jsonl").write_bytes(jsonl_bytes(RECORDS[:7]))
    with pytest.raises(InputError, match=r"c\.jsonl: changed while it was being prepared \(24 documents when it was "
                                         r"checked, 6 now\)"):
        list(documents.texts())


# --- several processes, bounded memory ------------------------------------------------------------


def test_several_tokenizing_processes_give_the_dataset_of_one_byte_for_byte(forms, tmp_path, monkeypatch):
    """With batches of 2,000 characters the 24 documents make about 12 batches: two processes
    encode them, and every file but meta.json's timing is the one process's, byte for byte."""
    monkeypatch.setattr(prepare_module, "ENCODE_BATCH_CHARS", 2000)
    used = []
    real = prepare_module.encoded_batches
    monkeypatch.setattr(prepare_module, "encoded_batches", lambda *a: used.append(a[-1]) or real(*a))
    for workers in (1, 2):
        prepare(forms["parquet"], tmp_path / f"w{workers}", val_fraction=0.2, progress=False, workers=workers)
    assert used == [1, 2]
    assert dataset_bytes(tmp_path / "w1") == dataset_bytes(tmp_path / "w2")
    metas = [json.loads((tmp_path / f"w{w}" / "meta.json").read_text()) for w in (1, 2)]
    assert [{k: v for k, v in m.items() if k != "seconds"} for m in metas][0] == {
        k: v for k, v in metas[1].items() if k != "seconds"}
    assert (tmp_path / "w1" / "tokenizer.json").read_bytes() == (tmp_path / "w2" / "tokenizer.json").read_bytes()


def test_the_processes_hold_a_few_batches_in_flight_whatever_the_corpus_size():
    """encoded_batches reads at most two batches per process ahead of the one it hands back, and
    hands back what one process computes, in order."""
    tokenizer = ByteTokenizer()
    texts = [f"text {i} " * (i + 1) for i in range(40)]
    taken = []

    def batches():
        for i, text in enumerate(texts):
            taken.append(i)
            yield _Batch(["train"], [text], len(text), len(text))

    results = encoded_batches(batches(), tokenizer, np.dtype(np.uint16), workers=2)
    first = next(results)
    assert len(taken) <= 2 * 2
    rest = list(results)
    assert len(taken) == len(texts)
    for batch, ids, lengths in [first, *rest]:
        expected_ids, expected_lengths = encode_texts(tokenizer, batch.texts, np.dtype(np.uint16))
        assert np.array_equal(ids, expected_ids) and np.array_equal(lengths, expected_lengths)
    assert [b.texts[0] for b, _, _ in [first, *rest]] == texts


def test_the_progress_counts_bytes_and_tokens(forms, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFF_TRANSFORMER_PROGRESS", "lines")
    meta = prepare(forms["jsonl"], tmp_path / "out", tokenizer="bytes", progress=True)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    assert last.startswith(f"tokenizing: {meta['bytes'] / 1000:.3g} kB/{meta['bytes'] / 1000:.3g} kB (100%)"), last
    assert f"; {tokens:,} tokens, " in last and last.endswith(" tokens/s")


MEMORY_SCRIPT = """
import resource, sys
from diff_transformer.data.inputs import scan_documents
import pyarrow.parquet  # imported before the baseline, as the reader imports it
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
documents = scan_documents([sys.argv[1]])
total = sum(len(t) for t in documents.texts())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, total)
"""


@pytest.mark.slow
def test_reading_a_parquet_corpus_holds_a_few_batches_whatever_its_size(tmp_path):
    """Checked and read again, a 9 MB and a 92 MB Parquet file leave the reading process's peak
    memory (maxrss, KiB) within a few MB of each other: the texts are streamed, not held."""
    text = "a line of text for a large corpus, repeated. " * 200  # 9,200 bytes a row
    growth = {}
    for rows in (1_000, 10_000):
        path = tmp_path / f"{rows}.parquet"
        pq.write_table(pa.table({"text": [text] * rows}), path, row_group_size=512)
        result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path)],
                                capture_output=True, text=True, timeout=300, check=True)
        kib, total = map(int, result.stdout.split())
        assert total == rows * len(text)
        growth[rows] = kib
    assert growth[10_000] - growth[1_000] < 16 * 1024, growth  # the corpus grew by 83 MB
