"""Data: the embedded corpus, tokenizers, prepared token shards and training batches.

    from diff_transformer.data import TokenShards, default_dataset
    directory = default_dataset()                    # the embedded corpus, tokenized once and cached
    train = TokenShards(directory, "train")
    inputs, targets = train.get_batch(range(8), seq_len=256, seed=0)    # (8, 256) int64 each
    validation = TokenShards(directory, "val").val_batches(4, 8, 256)   # fixed (inputs, targets) list

Modules: corpus (embedded texts and the cache), bpe (tokenizers), inputs (reading user text),
prepare (text -> shards), shards (TokenShards), mixture (MixedBatches), synthetic (generators).
"""

from ..loss import IGNORE_INDEX
from .bpe import default_tokenizer, train_bpe
from .corpus import EMBEDDED_DATASETS, cache_root, corpus_documents, dataset_directory, default_dataset
from .inputs import InputError
from .mixture import MixedBatches
from .prepare import prepare, read_meta
from .shards import TokenShards

__all__ = [
    "IGNORE_INDEX",
    "InputError",
    "MixedBatches",
    "TokenShards",
    "cache_root",
    "EMBEDDED_DATASETS",
    "corpus_documents",
    "dataset_directory",
    "default_dataset",
    "default_tokenizer",
    "prepare",
    "read_meta",
    "train_bpe",
]
