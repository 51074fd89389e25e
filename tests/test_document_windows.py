"""Long-context data: prepared datasets record where each document ends; windows taken within
documents never cross a boundary; long documents are up-sampled in the proportions asked for;
the draw depends on (seed, sample index) alone; datasets prepared without document ends keep
working, and say what to do when asked for windows within documents."""

import json
import math

import numpy as np
import pytest
import torch

from diff_transformer.data import TokenShards, prepare
from diff_transformer.train import ConfigError, train
from diff_transformer.train.config import DataConfig
from diff_transformer.train.distributed import Environment
from diff_transformer.train.trainer import DataPlan
from diff_transformer.checkpoint import CheckpointError
from test_train import byte_dataset, debug_config, losses  # noqa: F401  (byte_dataset is a fixture)

EOS = 256  # the byte tokenizer's end-of-text id: never a byte of the text
SEQ_LEN = 32
# Documents of these many bytes; each becomes that many byte tokens plus its end-of-text token.
DOCUMENT_BYTES = [9, 40, 100, 300, 1000, 20]


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Six text files (one document each) of DOCUMENT_BYTES bytes, all in the training split, in order."""
    root = tmp_path_factory.mktemp("documents")
    folder = root / "text"
    folder.mkdir()
    for i, size in enumerate(DOCUMENT_BYTES):
        (folder / f"{i}.txt").write_text("".join(chr(ord("a") + (i + j) % 26) for j in range(size)))
    prepare([folder], root / "shards", tokenizer="bytes", val_fraction=0.0, progress=False)
    return root / "shards"


def by_hand_ends() -> list[int]:
    """Document ends computed from the byte counts: each document is its bytes and one end-of-text token."""
    return list(np.cumsum([size + 1 for size in DOCUMENT_BYTES]))


def test_prepare_records_where_each_document_ends(documents):
    meta = json.loads((documents / "meta.json").read_text())
    assert meta["train"]["document_ends"] == "train.document_ends.npy"
    ends = np.load(documents / "train.document_ends.npy")
    assert ends.dtype == np.uint64 and ends.tolist() == by_hand_ends()
    shards = TokenShards(documents, "train")
    assert shards.document_ends.tolist() == by_hand_ends()
    assert (shards.tokens[shards.document_ends - 1] == EOS).all()  # each end follows an end-of-text token
    assert TokenShards(documents, "val").document_ends.tolist() == []


def test_windows_within_documents_never_cross_a_boundary(documents):
    shards = TokenShards(documents, "train", within_documents=True)
    inputs, targets = shards.get_batch(range(4000), SEQ_LEN, seed=3)
    assert not (inputs == EOS).any()  # an end-of-text token may only be a window's last target
    starts = shards.window_starts(range(4000), SEQ_LEN, seed=3)
    ends = np.array(by_hand_ends())
    firsts = np.concatenate([[0], ends[:-1]])
    document = np.searchsorted(ends, starts, side="right")
    assert (starts + SEQ_LEN + 1 <= ends[document]).all() and (starts >= firsts[document]).all()
    # Only documents of at least SEQ_LEN + 1 tokens give windows: 41, 101, 301 and 1001 tokens here.
    assert set(document.tolist()) == {1, 2, 3, 4}
    # Every start of the 41-token document is reachable: 41 − 32 = 9 of them.
    assert set(starts[document == 1].tolist()) == set(range(firsts[1], firsts[1] + 9))
    # Validation windows within documents: fixed, inside one document each, spread over all of them.
    for start in TokenShards(documents, "train", within_documents=True).val_batches(1, 12, SEQ_LEN)[0][0]:
        assert not (start == EOS).any()


def test_long_documents_are_up_sampled_in_the_proportions_asked(documents):
    """P(document d) = w_d · (L_d − T) / Σ w · (L − T), computed by hand for the documents that fit."""
    shards = TokenShards(documents, "train", within_documents=True, long_document_tokens=300, long_document_weight=3)
    n = 40_000
    starts = shards.window_starts(range(n), SEQ_LEN, seed=0)
    document = np.searchsorted(np.array(by_hand_ends()), starts, side="right")
    # Lengths 41, 101, 301, 1001: 9, 69, 269, 969 window starts; the last two (≥ 300 tokens) weigh 3.
    weighted = {1: 9 * 1, 2: 69 * 1, 3: 269 * 3, 4: 969 * 3}
    total = sum(weighted.values())  # 3,792
    for d, weight in weighted.items():
        p = weight / total
        observed = float((document == d).mean())
        assert abs(observed - p) < 4 * math.sqrt(p * (1 - p) / n), (d, observed, p)
    # Within a document the start is uniform: its mean offset is (starts − 1) / 2.
    offsets = starts[document == 4] - by_hand_ends()[3]
    assert abs(offsets.mean() - 968 / 2) < 4 * (969 / math.sqrt(12)) / math.sqrt(len(offsets))
    plain = TokenShards(documents, "train", within_documents=True)
    document = np.searchsorted(np.array(by_hand_ends()), plain.window_starts(range(n), SEQ_LEN, seed=0), side="right")
    assert abs(float((document == 4).mean()) - 969 / 1316) < 4 * math.sqrt(0.25 / n)  # weight 1: by window starts


def test_long_documents_are_up_sampled_across_documents_too(documents):
    """Windows across documents (packed), long documents up-sampled: a window starts anywhere it fits in
    the split (start ≤ N − T − 1), in document d with probability w_d · (its starts) / Σ, by hand."""
    shards = TokenShards(documents, "train", long_document_tokens=300, long_document_weight=3)
    n = 40_000
    starts = shards.window_starts(range(n), SEQ_LEN, seed=0)
    ends = np.array(by_hand_ends())  # 10, 51, 152, 453, 1454, 1475
    assert starts.max() <= 1475 - SEQ_LEN - 1
    document = np.searchsorted(ends, starts, side="right")
    # Starts per document: 10, 41, 101, 301, 1443 − 453 = 990 (the rest would run past the split's end),
    # none in the last; the documents of 301 and 1001 tokens weigh 3.
    weighted = {0: 10, 1: 41, 2: 101, 3: 301 * 3, 4: 990 * 3}
    total = sum(weighted.values())  # 4,025
    for d, weight in weighted.items():
        p = weight / total
        assert abs(float((document == d).mean()) - p) < 4 * math.sqrt(p * (1 - p) / n), d
    assert (shards.get_batch(range(200), SEQ_LEN, seed=0)[0] == EOS).any()  # windows run across documents


def test_the_draw_depends_on_the_seed_and_the_sample_index_alone(documents):
    shards = TokenShards(documents, "train", within_documents=True, long_document_tokens=300, long_document_weight=2)
    whole = shards.get_batch(range(100, 116), SEQ_LEN, seed=1)[0]
    parts = torch.cat([shards.get_batch(range(a, a + 4), SEQ_LEN, seed=1)[0] for a in range(100, 116, 4)])
    assert torch.equal(whole, parts)
    again = TokenShards(documents, "train", within_documents=True, long_document_tokens=300, long_document_weight=2)
    assert torch.equal(again.get_batch(range(100, 116), SEQ_LEN, seed=1)[0], whole)
    assert not torch.equal(shards.get_batch(range(100, 116), SEQ_LEN, seed=2)[0], whole)


def test_no_document_long_enough_is_a_clear_error(documents):
    shards = TokenShards(documents, "train", within_documents=True)
    with pytest.raises(ValueError, match="no document .* seq_len 2000 .* the longest has 1001 tokens"):
        shards.get_batch(range(2), 2000, seed=0)


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(long_document_weight=2.0), "long_document_tokens"),
        (dict(within_documents=True, long_document_weight=2.0), "long_document_tokens"),
        (dict(long_document_tokens=0), "long_document_tokens"),
        (dict(within_documents=True, long_document_tokens=10, long_document_weight=0.0), "long_document_weight"),
    ],
)
def test_bad_options_are_errors_naming_them(documents, options, named):
    with pytest.raises(ConfigError, match=f"data.{named}"):
        DataConfig(**options)
    with pytest.raises(ValueError, match=named):
        TokenShards(documents, "train", **options)


def test_a_dataset_prepared_without_document_ends_keeps_working(byte_dataset, tmp_path):  # noqa: F811
    """Older datasets have no document_ends: plain windows are unchanged; within documents is refused by name."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(byte_dataset, old)
    meta = json.loads((old / "meta.json").read_text())
    for split in ("train", "val"):
        del meta[split]["document_ends"]
        (old / f"{split}.document_ends.npy").unlink()
    (old / "meta.json").write_text(json.dumps(meta))
    new, legacy = TokenShards(byte_dataset, "train"), TokenShards(old, "train")
    assert legacy.document_ends is None
    assert torch.equal(new.get_batch(range(8), 32, seed=0)[0], legacy.get_batch(range(8), 32, seed=0)[0])
    with pytest.raises(ValueError, match="no document boundaries .* prepare it again"):
        TokenShards(old, "train", within_documents=True)
    config = debug_config(old, tmp_path / "run", data={"within_documents": True})
    with pytest.raises(ConfigError, match=r"data\.dataset: .*prepare it again"):
        DataPlan(config, 32, Environment(0, 1, 0, torch.device("cpu")))


@pytest.mark.slow  # trains and resumes (4 s)
def test_training_within_documents_resumes_exactly_and_refuses_a_change_of_the_sampling(byte_dataset, tmp_path):  # noqa: F811
    data = {"within_documents": True, "long_document_tokens": 300, "long_document_weight": 2.0}
    straight = train(debug_config(byte_dataset, tmp_path / "straight", data=data))
    train(debug_config(byte_dataset, tmp_path / "split", data=data, run={"stop_at_step": 3}))
    with pytest.raises(CheckpointError, match=r"data\.long_document_weight: 2\.0 -> 3\.0"):
        train(debug_config(byte_dataset, tmp_path / "split", data={**data, "long_document_weight": 3.0}), resume=True)
    second = train(debug_config(byte_dataset, tmp_path / "split", data=data), resume=True)
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(abs(a[s] - b[s]) <= 1e-6 for s in a)
    assert abs(straight.final_val_loss - second.final_val_loss) <= 1e-6


@pytest.mark.slow  # trains and resumes
def test_a_run_saved_before_the_sampling_options_existed_resumes(byte_dataset, tmp_path):  # noqa: F811
    """A train_config.yaml without the data options means the defaults (windows across documents)."""
    import yaml

    train(debug_config(byte_dataset, tmp_path, run={"stop_at_step": 3}))
    path = tmp_path / "checkpoint" / "train_config.yaml"
    saved = yaml.safe_load(path.read_text())
    for key in ("within_documents", "long_document_tokens", "long_document_weight"):
        del saved["data"][key]
    path.write_text(yaml.safe_dump(saved))
    assert train(debug_config(byte_dataset, tmp_path), resume=True).status == "completed"
