"""`prepare` on corpora as they ship: Parquet files and folders of them, Arrow files and
`datasets.save_to_disk` folders, compressed JSON Lines; every bad file answered by name; the
texts streamed; tokenizing in several processes giving the dataset of one, byte for byte."""

from __future__ import annotations

import gzip
import hashlib
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
inputs_module = importlib.import_module("diff_transformer.data.inputs")

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


def string_column(values: list[bytes]) -> pa.Array:
    """A string column holding exactly these bytes: pyarrow does not check that they are UTF-8 (a
    writer that does not check either makes such files)."""
    data = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(data), data.buffers())


def not_text_arrow(path: Path) -> None:
    with pa.ipc.new_stream(path, pa.schema([("text", pa.string())])) as writer:
        writer.write_table(pa.table({"text": string_column([b"fine", b"fine", b"a\x00b"])}))


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
     "{path}:2: not UTF-8 text (invalid byte at offset 24); give UTF-8 text"),
    # issue 43: "'utf-8' codec can't decode byte 0xff in position 4", naming no file, row or field
    ("x.parquet", lambda p: pq.write_table(pa.table({"text": string_column([b"good", b"bad \xff text"])}), p),
     "{path}:2: field 'text': not UTF-8 text (invalid byte at offset 4); give UTF-8 text"),
    ("x.parquet", lambda p: pq.write_table(pa.table({"text": string_column([b"good", b"x\x00y"])}), p),
     "{path}:2: field 'text': binary data (a NUL byte at offset 1), not text; give UTF-8 text"),
    ("x.arrow", not_text_arrow, "{path}:3: field 'text': binary data (a NUL byte at offset 1), not text"),
    ("x.jsonl", lambda p: p.write_bytes(b'{"text": "a"}\n{"text": "a\\u0000b"}\n'),
     "{path}:2: field 'text': binary data (a NUL character at byte 1), not text; give UTF-8 text"),
    ("x.jsonl", lambda p: p.write_bytes(b'{"text": "a"}\n{"t": 1, "text": "ok\x00"}\n'),
     "{path}:2: binary data (a NUL byte at offset 34), not text; give UTF-8 text"),  # 14 + 20 bytes before it
    ("x.json", lambda p: p.write_bytes(b'[{"text": "a"}, {"text": "half \\ud800 a pair"}]'),
     "{path}: record 2: field 'text': not UTF-8 text (an unpaired surrogate, U+D800, at character 5); give UTF-8 "
     "text"),
], ids=["empty-shard", "no-field", "not-a-string", "null", "corrupt-parquet", "corrupt-gzip", "corrupt-xz",
        "corrupt-zstd", "corrupt-arrow", "gzip-non-string", "gzip-not-utf8", "parquet-not-utf8", "parquet-nul",
        "arrow-nul", "jsonl-escaped-nul", "jsonl-nul-byte", "json-surrogate"])
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


# --- every input read once, as it was checked -----------------------------------------------------


def checksums(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` (links not followed), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def left_beside(out: Path) -> list[str]:
    """What a prepare into ``out`` left beside it: the dataset, its lock, its temporary folders."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def grow(path: Path) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("a line added while prepare reads the file\n")


def add_record(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(jsonl_bytes(["a record added while prepare reads the file"]))


def rewrite_same_size_and_time(path: Path) -> None:
    """Other text of the same size, in place, with the modification time put back: only the
    content tells the change."""
    before = path.stat()
    data = path.read_bytes()
    path.write_bytes(data.replace(b"words", b"WORDS"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


def read_once_tree(root: Path) -> Path:
    """in/one.parquet, in/sub/two.txt: 24 + 1 documents."""
    folder = root / "in"
    (folder / "sub").mkdir(parents=True)
    pq.write_table(table(), folder / "one.parquet")
    (folder / "sub" / "two.txt").write_text(TEXTS[0])
    return folder


REFUSED_TWICE = [  # (case id, inputs relative to tmp_path, the error line after "error: ")
    ("same-file-twice", ["in/one.parquet", "in/one.parquet"], "in/one.parquet: given twice; give each input once"),
    ("same-file-by-dotdot", ["in/one.parquet", "in/sub/../one.parquet"],
     "in/sub/../one.parquet: the same file as in/one.parquet, given before; give each input once"),
    ("same-file-by-link", ["in/one.parquet", "link.parquet"],
     "link.parquet: the same file as in/one.parquet, given before; give each input once"),
    ("same-file-by-hard-link", ["in/one.parquet", "hard.parquet"],
     "hard.parquet: the same file as in/one.parquet, given before; give each input once"),
    ("same-folder-twice", ["in", "in/"], "in: given twice; give each input once"),
    ("folder-and-a-file-inside", ["in", "in/one.parquet"],
     "in/one.parquet: inside the input folder in, which is also given (its files would be read twice); give each "
     "input once"),
    ("file-inside-then-folder", ["in/sub/two.txt", "in"],
     "in/sub/two.txt: inside the input folder in, which is also given (its files would be read twice); give each "
     "input once"),
    ("folder-and-a-folder-inside-by-link", ["in", "sublink"],
     "sublink: inside the input folder in, which is also given (its files would be read twice); give each input "
     "once"),
]


@pytest.mark.parametrize("inputs, message", [c[1:] for c in REFUSED_TWICE], ids=[c[0] for c in REFUSED_TWICE])
def test_an_input_given_twice_is_refused_by_name(inputs, message, tmp_path, monkeypatch, capsys):
    """Issue 43: `prepare in/one.parquet in/one.parquet` stored every text twice, a document's copy
    in train and in val; a folder and a file inside it: that file twice. Each way of naming one
    file or folder twice is one error line, nothing written, the inputs as they were."""
    folder = read_once_tree(tmp_path)
    (tmp_path / "link.parquet").symlink_to(folder / "one.parquet")
    os.link(folder / "one.parquet", tmp_path / "hard.parquet")
    (tmp_path / "sublink").symlink_to(folder / "sub")
    monkeypatch.chdir(tmp_path)
    before = checksums(tmp_path)
    assert main(["prepare", *inputs, "--out", "ds", "--tokenizer", "bytes", "--quiet"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert left_beside(tmp_path / "ds") == [] and checksums(tmp_path) == before


def test_a_link_loop_or_a_second_link_in_a_folder_is_read_once_with_one_warning(tmp_path, monkeypatch, capsys):
    """Issue 43: a symbolic link loop (a/up -> ..) was followed 40 levels, one file ingested 41
    times. Within a folder a second way to what was already found (a loop, a link to a file or
    folder found before, a link to a given input) is skipped, all of them in one warning line,
    and every document is stored once."""
    folder = read_once_tree(tmp_path)
    (folder / "a").mkdir()
    (folder / "a" / "up").symlink_to("..")  # the loop
    (folder / "zz-latest.txt").symlink_to("sub/two.txt")  # a second name of a file, found after it
    (folder / "sub2").symlink_to("sub")  # a second name of a folder
    (tmp_path / "extra.txt").write_text(TEXTS[1])
    (folder / "x-extra.txt").symlink_to(tmp_path / "extra.txt")  # a link to another input
    monkeypatch.chdir(tmp_path)
    before = checksums(tmp_path)
    assert main(["prepare", "in", "extra.txt", "--out", "ds", "--tokenizer", "bytes", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err == ("warning: 4 paths lead to a file or folder already found, skipped (each is read once): in/a/up -> "
                   "in, in/sub2 -> in/sub, in/x-extra.txt -> extra.txt and 1 more\n"), err
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert [s["path"] for s in meta["sources"]] == ["in/one.parquet", "in/sub/two.txt", "extra.txt"]
    assert meta["documents"] == 24 + 1 + 1 and meta["bytes"] == sum(len(t.encode()) for t in TEXTS + TEXTS[:2])
    assert checksums(tmp_path / "in") == {k[3:]: v for k, v in before.items() if k.startswith("in/")}


def test_a_fifo_socket_device_or_broken_link_is_named_as_what_it_is(tmp_path, monkeypatch, capsys):
    """Issue 43: a FIFO named as input was "no such file or folder". Given, or in a folder under a
    name prepare reads (where a FIFO would block the read and a broken link would drop a file
    unsaid), each is refused as what it is; under other names they are left out, as any file is."""
    import socket

    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo.txt")
    server = socket.socket(socket.AF_UNIX)
    server.bind("sock.jsonl")
    Path("broken.txt").symlink_to("nowhere.txt")
    Path("loop.txt").symlink_to("loop.txt")
    try:
        for given, what in (("fifo.txt", "a FIFO"), ("sock.jsonl", "a socket"), ("/dev/null", "a character device"),
                            ("broken.txt", "a broken link (to nowhere.txt, which does not exist)"),
                            ("loop.txt", "a link loop (a symbolic link that leads back to itself)")):
            assert main(["prepare", given, "--out", "ds", "--tokenizer", "bytes"]) == 2
            assert capsys.readouterr().err == (f"error: diff-transformer prepare: argument INPUT: '{given}' is not "
                                               f"valid ({what}, not a file or directory)\n")
            folder = Path(f"in-{Path(given).name}")
            folder.mkdir()
            (folder / "good.txt").write_text(TEXTS[0])
            Path(given).rename(folder / Path(given).name) if given != "/dev/null" else \
                (folder / "null.txt").symlink_to("/dev/null")
            inside = folder / (Path(given).name if given != "/dev/null" else "null.txt")
            assert main(["prepare", str(folder), "--out", "ds", "--tokenizer", "bytes"]) == 2
            assert capsys.readouterr().err.startswith(f"error: {inside}: {what}, not a file (in the input folder "
                                                      f"{folder})\n")
            inside.rename(folder / "left-out.csv")  # a name prepare does not read: left out, like any such file
            assert main(["prepare", str(folder), "--out", f"ds-{folder}", "--tokenizer", "bytes", "--quiet"]) == 0
            assert json.loads(Path(f"ds-{folder}", "meta.json").read_text())["documents"] == 1
        assert not Path("ds").exists()
    finally:
        server.close()


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["new", "overwrite"])
def test_an_output_inside_an_input_folder_is_refused_the_first_time(overwrite, tmp_path, monkeypatch, capsys):
    """Issue 43: `prepare in --out in/shards/ds` was accepted, and the same command with --overwrite
    then refused (the dataset had become an input). Refused at once, with or without
    --overwrite, also through a link; nothing is created; and a tokenizer likewise."""
    folder = read_once_tree(tmp_path)
    (tmp_path / "in-link").symlink_to("in")
    monkeypatch.chdir(tmp_path)
    before = checksums(tmp_path)
    for out in ("in/shards/ds", "in-link/ds", "in/sub/ds"):
        assert main(["prepare", "in", "--out", out, "--tokenizer", "bytes", "--quiet", *overwrite]) == 2
        assert capsys.readouterr().err == (
            f"error: {out}: inside the input folder in, which this command reads (the next run on that folder would "
            "read the dataset as input); write the dataset outside it\n")
    assert main(["tokenizer", "train", "--input", "in", "--vocab-size", "300", "--out", "in/bpe.json",
                 *overwrite]) == 2
    assert capsys.readouterr().err.startswith("error: in/bpe.json: inside the input folder in, which this command "
                                              "reads (the next run on that folder would read the tokenizer as input)")
    assert checksums(tmp_path) == before and sorted(os.listdir(folder)) == ["one.parquet", "sub"]
    assert main(["prepare", "in", "--out", "ds", "--tokenizer", "bytes", "--quiet", *overwrite]) == 0  # outside: fine


CHANGES = [  # (case id, the input changed, the change, when: after the check, or after the tokenizing)
    ("txt-grows", "b.txt", grow, "check"),
    ("jsonl-gains-a-record", "c.jsonl", add_record, "check"),
    ("txt-rewritten-same-size-and-time", "b.txt", rewrite_same_size_and_time, "check"),
    ("jsonl-rewritten-same-size-and-time", "c.jsonl", rewrite_same_size_and_time, "check"),
    ("txt-grows-after-it-was-tokenized", "b.txt", grow, "tokenizing"),
]


@pytest.mark.parametrize("name, change, when", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_file_that_changes_while_prepare_reads_it_is_named_and_nothing_is_written(name, change, when, workers,
                                                                                     tmp_path, monkeypatch, capsys):
    """Issue 43: a .txt that grows, a .jsonl that gains a record, a file rewritten at the same size
    (and, here, the same mtime), between the check and the tokenizing or after the tokenizing:
    named, exit status 2, no dataset (meta.json never disagrees with the shards), no lock, no
    temporary folder; the other inputs untouched."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXTS[0] * 40)
    (folder / "b.txt").write_text(TEXTS[1] * 40)
    (folder / "c.jsonl").write_bytes(jsonl_bytes())
    monkeypatch.setattr(prepare_module, "ENCODE_BATCH_CHARS", 3000)  # several batches: both workers busy
    if when == "check":
        real = prepare_module.scan_documents
        monkeypatch.setattr(prepare_module, "scan_documents", lambda *a: [real(*a), change(folder / name)][0])
    else:
        real = prepare_module.write_shards
        monkeypatch.setattr(prepare_module, "write_shards", lambda *a, **k: [real(*a, **k), change(folder / name)][0])
    others = {k: v for k, v in checksums(folder).items() if k != name}
    out = tmp_path / "ds"
    code = main(["prepare", str(folder), "--out", str(out), "--tokenizer", "bytes", "--quiet", "--workers",
                 str(workers)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {folder / name}: changed while it was being read (") and \
        err.endswith("), so nothing was written; run again once it no longer changes\n") and err.count("\n") == 1, err
    assert left_beside(out) == []
    assert {k: v for k, v in checksums(folder).items() if k != name} == others


def test_a_file_that_changes_during_the_check_itself_is_named(tmp_path, monkeypatch):
    """The state taken before the first read and after it differ: named by the check."""
    (tmp_path / "a.txt").write_text(TEXTS[0])
    real = inputs_module.decode_text
    monkeypatch.setattr(inputs_module, "decode_text", lambda data, where, *a: [grow(tmp_path / "a.txt"),
                                                                               real(data, where, *a)][1])
    with pytest.raises(InputError, match=r"a\.txt: changed while it was being read \(size \d[\d,]* -> \d[\d,]* bytes"):
        scan_documents([tmp_path / "a.txt"])


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
