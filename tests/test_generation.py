"""KV cache decoding equals a full forward; sampling and generate() behave as documented."""

import shutil

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.generation import generate, sample_next
from checks import compiled_decoding_error

KINDS = ["standard", "diff", "diff_v2", "diff_symmetric", "gated", "gated_headwise"]
# (kind, n_kv_heads): MHA and MQA for every kind but the symmetric one, whose keys are its queries
KIND_AND_KV_HEADS = [(kind, kv) for kind in KINDS for kv in (None, 1) if not (kind == "diff_symmetric" and kv)]


# GQA (MQA) cases run in the slow tier
KIND_AND_KV_HEADS_TIERED = [pytest.param(kind, kv, marks=pytest.mark.slow) if kv else (kind, kv)
                            for kind, kv in KIND_AND_KV_HEADS]


@pytest.mark.parametrize("kind, n_kv_heads", KIND_AND_KV_HEADS_TIERED)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "sdpa_split", "math"])
@pytest.mark.parametrize("static", [False, True], ids=["cache", "static-cache"])
def test_token_by_token_decoding_gives_full_forward_logits(kind, n_kv_heads, backend, static):
    config = ModelConfig.from_preset("debug", attention=kind, n_kv_heads=n_kv_heads)
    model = LanguageModel(config, attn_backend=backend).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 23))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(2, 32, static=static)
        pieces = [model(tokens[:, :7], cache=cache)[0], model(tokens[:, 7:12], cache=cache)[0]]  # chunked prefill
        pieces += [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(12, 23)]
    assert cache.length == 23
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("static", [False, True], ids=["cache", "static-cache"])
def test_diff_heads_with_values_of_width_d_decode_as_the_full_forward(static):
    """value_factor=1 (a converted Transformer): the cache holds d-wide values, "auto" decodes one token
    at a time with the "decode" backend, and the logits are the full forward's."""
    config = ModelConfig.from_preset("debug", attention="diff", n_heads=4, n_kv_heads=2, value_factor=1)
    model = LanguageModel(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 15))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(2, 16, static=static)
        pieces = [model(tokens[:, :6], cache=cache)[0]]
        pieces += [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(6, 15)]
    assert cache.values[0].shape[-1] == config.head_dim
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


def test_cache_errors():
    model = LanguageModel(ModelConfig.from_preset("debug"))
    cache = model.new_cache(1, 8)
    model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 8 tokens"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="made for batch size 1"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=model.new_cache(1, 8))


@pytest.mark.parametrize("kind", KINDS)
def test_a_static_cache_with_left_padding_decodes_each_row_as_it_would_alone(kind):
    """Rows padded on the left, prefilled and decoded through a static cache (padding flags kept by
    the cache, every step over all slots): the logits of each row's real tokens equal that row
    alone in a full forward."""
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind)).eval()
    rows = [torch.randint(0, 512, (n,)) for n in (9, 4)]
    steps = torch.randint(0, 512, (2, 5))
    prompt = torch.zeros(2, 9, dtype=torch.long)
    real = torch.zeros(2, 9, dtype=torch.bool)
    for i, row in enumerate(rows):
        prompt[i, 9 - len(row):], real[i, 9 - len(row):] = row, True
    with torch.no_grad():
        cache = model.new_cache(2, 20, static=True)
        got = [model(prompt, cache=cache, padding_mask=real)[0]]
        got += [model(steps[:, i : i + 1], cache=cache)[0] for i in range(5)]
        got = torch.cat(got, dim=1)  # (2, 14, V)
        for i, row in enumerate(rows):
            alone, _ = model(torch.cat([row, steps[i]])[None])
            torch.testing.assert_close(got[i, 9 - len(row):], alone[0], atol=1e-5, rtol=1e-5)


def test_an_expanded_static_cache_keeps_the_padding_of_each_row():
    """A left-padded static cache expanded ×2: rows 2i and 2i + 1 continue row i, padding still hidden."""
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff")).eval()
    short, long = torch.randint(0, 512, (3,)), torch.randint(0, 512, (6,))
    prompt = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), short]), long])
    real = torch.tensor([[False] * 3 + [True] * 3, [True] * 6])
    nxt = torch.randint(0, 512, (4, 1))
    with torch.no_grad():
        cache = model.new_cache(2, 8, static=True)
        model(prompt, cache=cache, padding_mask=real)
        got, _ = model(nxt, cache=cache.expand(2))
        for row, prefix in enumerate([short, short, long, long]):
            alone, _ = model(torch.cat([prefix, nxt[row]])[None])
            torch.testing.assert_close(got[row, -1], alone[0, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # torch.compile traces the decoding step
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_decoding_with_a_static_cache_compiles_once(kind):
    """Without dynamic=True: the first one-token step compiles, every later step reuses that graph
    (a recompilation is an error here), and the logits follow a full forward."""
    assert compiled_decoding_error(LanguageModel(ModelConfig.from_preset("debug", attention=kind)).eval()) < 1e-5


def test_static_cache_errors():
    model = LanguageModel(ModelConfig.from_preset("debug"))
    with pytest.raises(ValueError, match="static KV cache of 200 tokens exceeds max_seq_len=128"):
        model.new_cache(1, 200, static=True)
    cache = model.new_cache(2, 8, static=True)
    with pytest.raises(ValueError, match=r"padding_mask flags the new tokens only: bool \(batch, 3\)"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache, padding_mask=torch.ones(2, 8, dtype=torch.bool))
    model(torch.zeros(2, 6, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 8 tokens; writing 3 more at 6"):
        model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        cache.expand(2, max_len=129)
    cache.reset()
    assert cache.length == 0 and not cache.padded


@pytest.mark.slow  # torch.compile traces prefill and steps
@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_decoding_under_torch_compile(kind):
    """The whole forward with a cache compiles into one graph per shape (no graph breaks)."""
    torch._dynamo.reset()
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind)).eval()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True, fullgraph=True)
    tokens = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(1, 16)
        pieces = [compiled(tokens[:, :8], cache=cache)[0]]
        pieces += [compiled(tokens[:, i : i + 1], cache=cache)[0] for i in range(8, 12)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


@pytest.mark.slow  # inductor compiles the decoding step
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor needs a C++ compiler on CPU")
def test_generate_with_compile_matches_eager():
    """compile=True (inductor, real-valued RoPE inside the graph): same greedy tokens, with padding, and
    a second call reuses the compiled step."""
    torch._dynamo.reset()
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff")).eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8]]  # left padding in the second row
    eager = model.generate(prompts, 10, temperature=0)
    assert model.generate(prompts, 10, temperature=0, compile=True) == eager
    assert model.generate(prompts[:1], 6, temperature=0, compile=True)[0] == eager[0][:6]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
def test_generate_with_compile_on_cuda_replays_cuda_graphs_and_matches_eager():
    """On CUDA compile=True uses mode="reduce-overhead" over a static cache: the same greedy tokens."""
    torch._dynamo.reset()
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff"), device="cuda").eval()
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    eager = model.generate(prompts, 12, temperature=0)
    assert model.generate(prompts, 12, temperature=0, compile=True) == eager


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).repeat(2000, 1)
    assert (sample_next(logits, temperature=0) == 1).all()
    g = torch.Generator().manual_seed(0)
    top2 = sample_next(logits, top_k=2, generator=g)
    assert set(top2.tolist()) == {1, 2}
    # probabilities 0.64, 0.24, 0.09, ...: top_p=0.8 keeps tokens 1 and 2 only, top_p=0.5 only token 1
    assert set(sample_next(logits, top_p=0.8, generator=g).tolist()) == {1, 2}
    assert set(sample_next(logits, top_p=0.5, generator=g).tolist()) == {1}
    a = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(5))
    b = sample_next(logits, temperature=1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and len(set(a.tolist())) > 2
    for bad in (dict(temperature=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            sample_next(logits, **bad)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_greedy_matches_repeated_full_forward(kind):
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind)).eval()
    prompt = [5, 17, 300, 42]
    new = generate(model, [prompt], 10, temperature=0)[0]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert new == seq[len(prompt) :]


def test_generate_batch_with_padding_equals_one_by_one():
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff")).eval()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    batched = generate(model, prompts, 8, temperature=0)
    assert batched == [generate(model, [p], 8, temperature=0)[0] for p in prompts]


def test_generate_stops_at_stop_tokens():
    model = LanguageModel(ModelConfig.from_preset("debug")).eval()
    free = generate(model, [[1, 2, 3]], 12, temperature=0)[0]
    stop = free[4]
    stopped = generate(model, [[1, 2, 3]], 12, temperature=0, stop_tokens=[stop])[0]
    assert stopped == free[: free.index(stop)]


def test_vocab_limit_never_draws_an_id_past_it_and_changes_nothing_below():
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=512)).eval()  # random: every id likely
    free = generate(model, [[1, 2]], 60, generator=torch.Generator().manual_seed(1))[0]
    assert max(free) >= 257  # without the limit, ids a 257-token tokenizer has no text for
    limited = generate(model, [[1, 2]], 60, generator=torch.Generator().manual_seed(1), vocab_limit=257)[0]
    assert len(limited) == 60 and max(limited) < 257
    # greedy decoding whose argmax is already below the limit is the same with it
    greedy = generate(model, [[1, 2]], 8, temperature=0)[0]
    assert generate(model, [[1, 2]], 8, temperature=0, vocab_limit=max(greedy) + 1)[0] == greedy
    for bad in (0, 513, 2.5):
        with pytest.raises(ValueError, match=r"vocab_limit must be an integer in \[1, vocab_size=512\]"):
            generate(model, [[1]], 2, vocab_limit=bad)


def test_the_generate_command_draws_only_ids_its_tokenizer_has(tmp_path, capsys, monkeypatch):
    from diff_transformer import generation
    from diff_transformer.cli import main
    from diff_transformer.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=512, max_seq_len=64))
    checkpoint = model.save_pretrained(tmp_path / "ckpt", ByteTokenizer())  # 257 ids for a 512-id model
    drawn, real = [], generation.stream

    def recording(*args, **kwargs):
        for step in real(*args, **kwargs):
            drawn.append(int(step[0]))
            yield step

    monkeypatch.setattr(generation, "stream", recording)
    assert main(["generate", str(checkpoint), "--max-new-tokens", "50", "--device", "cpu", "--seed", "1"]) == 0
    assert drawn and max(drawn) < 257


def test_generate_errors():
    model = LanguageModel(ModelConfig.from_preset("debug"))
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        generate(model, [[1] * 100], 40)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], 4)


@pytest.mark.parametrize("kind", ["standard", "diff", "diff_v2"])
@pytest.mark.parametrize("static", [False, True], ids=["cache", "static-cache"])
def test_an_expanded_cache_continues_every_row_as_the_whole_sequence_would(kind, static):
    """expand(r): row i of the source becomes rows i·r … i·r + r − 1; continuing each with its own
    tokens gives the logits of one full forward over prefix + continuation."""
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind)).eval()
    prefix = torch.randint(0, 512, (2, 7))
    continuations = torch.randint(0, 512, (6, 4))  # 3 per prefix row
    with torch.no_grad():
        cache = model.new_cache(2, 16, static=static)
        model(prefix, cache=cache)
        branched = cache.expand(3, max_len=11)
        assert (branched.batch_size, branched.length, branched.max_len) == (6, 7, 11)
        got, _ = model(continuations, cache=branched)
        full, _ = model(torch.cat([prefix.repeat_interleave(3, dim=0), continuations], dim=1))
    torch.testing.assert_close(got, full[:, 7:], atol=1e-5, rtol=1e-5)
    assert cache.length == 7  # the source is untouched
    with pytest.raises(ValueError, match="max_len >= 7"):
        cache.expand(2, max_len=5)
