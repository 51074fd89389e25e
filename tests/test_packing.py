"""Packed documents (``data.packing: documents``): every sequence holds whole and split documents,
attention confined to each and RoPE positions restarting at each, so that each document's outputs
and gradients are those it has computed alone, on every backend that takes a mask; the trainer's
loss with packing is the sum of each document's own; the KV-cache paths refuse document ids."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.config import ConfigError
from diff_transformer.data import TokenShards, prepare
from diff_transformer.model import document_attention_mask, document_ids, positions_in_documents
from diff_transformer.ops import attention, diff_attention, document_block_mask, reference_diff_attention
from diff_transformer.tokenizer import ByteTokenizer
from diff_transformer.train import train
from diff_transformer.train.config import DataConfig
from diff_transformer.train.state import read_train_config
from diff_transformer.train.step import CPU, forward_backward
from diff_transformer.train.trainer import backend_problem, evaluate, read_metrics

from test_train import debug_config

KINDS = ["diff", "standard", "diff_v2", "diff_symmetric", "gated", "gated_headwise"]
CPU_MASK_BACKENDS = ["reference", "sdpa", "sdpa_split", "math", "auto"]
SEPARATOR = 0


def packed_rows(vocab: int, lengths: list[list[int]], generator: torch.Generator) -> tuple[torch.Tensor, list]:
    """Rows of documents of the given lengths, each after the first opened by the separator (as
    an end-of-text token opens the next document); (tokens (B, T), [[document, ...] per row])."""
    rows = []
    for row in lengths:
        documents = [torch.randint(1, vocab, (n,), generator=generator) for n in row]
        for document in documents[1:]:
            document[0] = SEPARATOR
        rows.append(documents)
    return torch.stack([torch.cat(documents) for documents in rows]), rows


# Row 0: a split document, whole ones, a one-token document, a document split at the end; row 1: one document.
LENGTHS = [[5, 9, 1, 3, 6], [24]]


def test_document_ids_and_positions_by_hand():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 3], [0, 4, 4, 4, 4, 4, 4]])
    ids = document_ids(tokens, 0)
    assert ids.tolist() == [[0, 1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1]]
    assert positions_in_documents(ids).tolist() == [[0, 0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    mask = document_attention_mask(ids)[0, 0]
    blocks = [[0], [1, 2, 3], [4], [5, 6]]  # query i sees key j when both lie in one document
    assert mask.tolist() == [[any(i in b and j in b for b in blocks) for j in range(7)] for i in range(7)]
    # a document is a run of equal ids: an id seen again later is another document
    assert positions_in_documents(torch.tensor([[3, 3, 1, 3]])).tolist() == [[0, 1, 0, 0]]


# Every CPU backend of the DIFF kinds; the kinds without DIFF heads call SDPA under any name but "reference".
CASES = [(kind, backend) for kind in KINDS for backend in CPU_MASK_BACKENDS
         if kind in ("diff", "diff_symmetric") or backend in ("reference", "auto")]


@pytest.mark.parametrize("kind, backend", CASES)
def test_packed_documents_give_each_document_its_own_outputs_and_gradients(kind, backend):
    """Logits of the packed rows equal each document's alone, and the gradient of any function
    of them (here a fixed random weighting) equals the sum of the documents' own gradients."""
    config = ModelConfig.from_preset("debug", attention=kind)
    model = LanguageModel(config, attn_backend=backend)
    generator = torch.Generator().manual_seed(1)
    tokens, rows = packed_rows(config.vocab_size, LENGTHS, generator)
    weights = torch.randn(*tokens.shape, config.vocab_size, generator=generator)
    logits = model(tokens, document_ids=document_ids(tokens, SEPARATOR))[0]
    (logits * weights).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone_total = 0.0
    for r, documents in enumerate(rows):
        start = 0
        for document in documents:
            alone = model(document[None])[0]
            span = slice(start, start + len(document))
            assert (logits[r, span] - alone[0]).abs().max().item() < 2e-5, (r, start)
            alone_total = alone_total + (alone[0] * weights[r, span]).sum()
            start += len(document)
    alone_total.backward()
    for name, p in model.named_parameters():
        scale = max(1.0, p.grad.abs().max().item())
        assert (packed_grads[name] - p.grad).abs().max().item() < 2e-5 * scale, name


def test_without_the_mask_a_document_sees_the_one_before():
    """The comparison above is not vacuous: without document ids the second document's outputs
    are not its own."""
    config = ModelConfig.from_preset("debug", attention="diff")
    model = LanguageModel(config)
    tokens, rows = packed_rows(config.vocab_size, [[6, 10]], torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = model(rows[0][1][None])[0][0]
        assert (model(tokens)[0][0, 6:] - alone).abs().max() > 1e-2
        assert (model(tokens, document_ids=document_ids(tokens, SEPARATOR))[0][0, 6:] - alone).abs().max() < 2e-5


@pytest.mark.slow  # flex attention compiled (4 s)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", KINDS)
def test_flex_backend_forward_equals_each_document_alone(kind):
    """The "flex" backend (FlexAttention, unfused and forward only on the CPU) with the model's
    document block mask gives each document's own logits."""
    config = ModelConfig.from_preset("debug", attention=kind)
    model = LanguageModel(config, attn_backend="flex")
    tokens, rows = packed_rows(config.vocab_size, LENGTHS, torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens, document_ids=document_ids(tokens, SEPARATOR))[0]
    model.set_attention_backend("reference")
    with torch.no_grad():
        for r, documents in enumerate(rows):
            start = 0
            for document in documents:
                alone = model(document[None])[0][0]
                assert (logits[r, start:start + len(document)] - alone).abs().max().item() < 2e-5
                start += len(document)


@pytest.mark.slow  # flex attention compiled (5 s)
@pytest.mark.parametrize("kind", KINDS)
def test_flex_backend_with_gradients_on_the_cpu_equals_the_reference_forward_and_backward(kind):
    """The issue's case: a model in eval mode called without torch.no_grad() on the CPU, where
    FlexAttention has no backward: the same attention by SDPA on the block mask's dense mask, its
    logits and gradients the reference backend's (fp32, 1e-5 / 1e-4)."""
    config = ModelConfig.from_preset("debug", attention=kind)
    flex = LanguageModel(config, attn_backend="flex").eval()
    reference = LanguageModel(config, attn_backend="reference").eval()
    reference.load_state_dict(flex.state_dict())
    tokens, _ = packed_rows(config.vocab_size, LENGTHS, torch.Generator().manual_seed(5))
    for ids in (None, document_ids(tokens, SEPARATOR)):
        got, want = flex(tokens, document_ids=ids)[0], reference(tokens, document_ids=ids)[0]
        assert (got - want).abs().max().item() < 1e-5
        weights = torch.randn_like(want)
        grads = [torch.autograd.grad((out * weights).sum(), [m.embed.weight, m.layers[0].attn.v_proj.weight])
                 for m, out in ((flex, got), (reference, want))]
        for a, b in zip(*grads):
            assert (a - b).abs().max().item() < 1e-4


@pytest.mark.slow  # flex attention compiled (2 s)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mask", ["causal", "dense", "documents"])
def test_flex_op_equals_the_reference(mask):
    """diff_attention and attention on backend "flex": the causal mask, a bool mask (made a block
    mask per call), and a document block mask; GQA (4 heads, 2 KV heads); forward on the CPU."""
    g = torch.Generator().manual_seed(4)
    b, h, hkv, t, d = 2, 4, 2, 20, 8
    q1, q2 = (torch.randn(b, h, t, d, generator=g) for _ in range(2))
    k1, k2 = (torch.randn(b, hkv, t, d, generator=g) for _ in range(2))
    v = torch.randn(b, hkv, t, 2 * d, generator=g)
    lam = torch.tensor(0.6)
    ids = torch.tensor([[0] * 7 + [1] * 9 + [2] * 4, [5] * 20])
    dense = {"causal": None, "dense": (torch.rand(b, 1, t, t, generator=g) > 0.3) | torch.eye(t, dtype=torch.bool),
             "documents": document_attention_mask(ids)}[mask]
    given = document_block_mask(ids) if mask == "documents" else dense
    want = reference_diff_attention(q1, q2, k1, k2, v, lam, attn_mask=dense)[0]
    got = diff_attention(q1, q2, k1, k2, v, lam, attn_mask=given, backend="flex")
    assert (got - want).abs().max().item() < 1e-5
    want = attention(q1, k1, v, attn_mask=dense, backend="reference")
    assert (attention(q1, k1, v, attn_mask=given, backend="flex") - want).abs().max().item() < 1e-5


def test_a_block_mask_is_for_the_flex_backend_only():
    q = torch.randn(1, 2, 8, 4)
    mask = document_block_mask(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="BlockMask, which only backend 'flex' takes, not 'math'"):
        diff_attention(q, q, q, q, torch.randn(1, 2, 8, 8), torch.tensor(0.5), attn_mask=mask, backend="math")


def test_document_ids_are_refused_with_a_cache_or_a_padding_mask_or_the_wrong_shape():
    model = LanguageModel(ModelConfig.from_preset("debug"))
    tokens = torch.randint(1, 100, (2, 6))
    ids = document_ids(tokens, SEPARATOR)
    with pytest.raises(ValueError, match="not with a cache or a padding_mask"):
        model(tokens, cache=model.new_cache(2), document_ids=ids)
    with pytest.raises(ValueError, match="not with a cache or a padding_mask"):
        model(tokens, padding_mask=torch.ones(2, 6, dtype=torch.bool), document_ids=ids)
    with pytest.raises(ValueError, match=r"document_ids must be integers of the tokens' shape \(2, 6\), got "
                                         r"torch.int64 \(2, 5\)"):
        model(tokens, document_ids=ids[:, :5])


# --- the trainer ----------------------------------------------------------------------------------


def per_document_loss_sum(model: LanguageModel, inputs: torch.Tensor, targets: torch.Tensor,
                          separator: int) -> tuple[float, int]:
    """The cross-entropy summed over every target, each document of each row computed alone (a
    document starts at each separator token): the oracle of packed training."""
    total, count = 0.0, 0
    for row_inputs, row_targets in zip(inputs, targets):
        starts = [0] + [i for i in range(1, len(row_inputs)) if row_inputs[i] == separator]
        for start, end in zip(starts, starts[1:] + [len(row_inputs)]):
            logits = model(row_inputs[None, start:end])[0][0]
            total += F.cross_entropy(logits.double(), row_targets[start:end], reduction="sum").item()
            count += end - start
    return total, count


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> Path:
    """80 documents of 3 to 21 bytes, byte-tokenized: a window of 32 tokens holds several."""
    root = tmp_path_factory.mktemp("short")
    lines = [json.dumps({"text": f"d{i}:" + "abcdefg"[: i % 7] * (1 + i % 3)}) for i in range(80)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare([root / "docs.jsonl"], root / "data", tokenizer="bytes", val_fraction=0.2, progress=False)
    return root / "data"


def test_the_training_step_and_the_validation_loss_are_each_documents_own(short_documents):
    torch.manual_seed(5)
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff", vocab_size=257))
    shards = TokenShards(short_documents, "train")
    eos = shards.eos_id
    inputs, targets = shards.get_batch(range(4), 32, seed=0)
    assert (inputs == eos).sum() >= 8  # several documents a row
    want, count = per_document_loss_sum(model, inputs, targets, eos)
    loss_sum, global_count = forward_backward(model, model, [(inputs, targets)], CPU, separator=eos)
    assert global_count == count and abs(loss_sum - want) < 1e-4 * want
    validation = evaluate(model, [(inputs[:2], targets[:2]), (inputs[2:], targets[2:])], CPU,
                          contextlib.nullcontext(), eos)
    assert abs(validation - want / count) < 1e-5
    unpacked, _ = forward_backward(model, model, [(inputs, targets)], CPU)
    assert abs(unpacked - want) > 1e-2 * want  # packing changes the loss: the test above sees it


@pytest.mark.slow  # a training run
def test_packed_training_runs_on_the_cpu_and_logs_each_documents_own_loss(short_documents, tmp_path):
    """A run with data.packing=documents started from a model of ours: its first step's logged loss
    is that model's loss on the first batch, each document alone."""
    torch.manual_seed(6)
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff", vocab_size=257))
    model.save_pretrained(tmp_path / "init", ByteTokenizer())
    config = debug_config(short_documents, tmp_path / "run", model={"preset": "debug", "vocab_size": 257},
                          data={"packing": "documents"},
                          run={"steps": 2, "eval_every": 2, "init_from": str(tmp_path / "init")})
    result = train(config)
    assert result.status == "completed"
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    logged = next(r["loss"] for r in records if r["kind"] == "train" and r["step"] == 1)
    shards = TokenShards(short_documents, "train")
    inputs, targets = shards.get_batch(range(8), 32, seed=0)
    with torch.no_grad():
        want, count = per_document_loss_sum(model, inputs, targets, shards.eos_id)
    assert abs(logged - want / count) < 1e-4
    assert read_train_config(tmp_path / "run" / "checkpoint")["data"]["packing"] == "documents"


@pytest.mark.parametrize("options, message", [
    ({"packing": "sequences"}, "data.packing must be one of none, documents, got 'sequences'"),
    ({"packing": "documents", "within_documents": True}, "data.within_documents takes windows that run across none"),
    ({"packing": "documents", "mix": {"needle": 0.1}}, "the examples data.mix generates hold them inside"),
])
def test_packing_settings_that_cannot_work_are_refused_by_name(options, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**options)


def test_backends_that_cannot_train_packed_documents_are_named():
    diff = ModelConfig.from_preset("debug", attention="diff")
    assert "takes no attention mask" in backend_problem("triton", torch.device("cpu"), diff, 32, packing="documents")
    standard = ModelConfig.from_preset("debug", attention="standard")
    assert "no backward on the cpu" in backend_problem("flex", torch.device("cpu"), standard, 32)
    assert backend_problem("math", torch.device("cpu"), diff, 32, packing="documents") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_flex_on_cuda_trains_packed_documents_as_the_dense_mask_does(kind):
    """On CUDA the "flex" backend (compiled FlexAttention, block masks) gives the outputs and the
    gradients of "sdpa" with the dense document mask, in fp32."""
    torch._dynamo.reset()
    config = ModelConfig.from_preset("debug", attention=kind)
    tokens, _ = packed_rows(config.vocab_size, [[40, 70, 18], [128]], torch.Generator().manual_seed(7))
    tokens = tokens.cuda()
    ids = document_ids(tokens, SEPARATOR)
    results = []
    for backend in ("sdpa", "flex"):
        torch.manual_seed(8)
        model = LanguageModel(config, device="cuda", attn_backend=backend)
        loss = model(tokens[:, :-1], tokens[:, 1:], document_ids=ids[:, :-1])[1]
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_sdpa, grads_sdpa), (loss_flex, grads_flex) = results
    assert abs(loss_sdpa - loss_flex) < 1e-4
    for name, grad in grads_sdpa.items():
        assert (grad - grads_flex[name]).abs().max().item() < 1e-3 * max(1.0, grad.abs().max().item()), name
