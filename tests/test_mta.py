"""Multi-token attention (attention="mta", Golovneva et al. 2025): the module and every gradient against
a float64 statement of the authors' forward, the fast path against the reference, KV-cache and compiled
decoding against the full forward, padding and packed documents, its parameters counted by hand, its
init, its config and what it refuses.

The authors' module (facebookresearch/RAM, projects/mta/mta_transformer.py) imports its training stack
(lingua, xformers, a Triton submodule) and calls .cuda() in its constructor, so it cannot run here: the
statement below is their ``Attention.forward`` (the non-Triton path, with the released configs'
``pre_sm_linear_head``, ``head_kernel_size``, ``group_norm``, ``add_gating`` and ``gate_1d``) and their
``_mta_convolution`` and ``_head_convolution`` written out line by line in float64.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from diff_transformer import AttentionTap, LanguageModel, ModelConfig
from diff_transformer.checkpoint import CheckpointError
from diff_transformer.cli import main as cli_main
from diff_transformer.config import PRESETS, ConfigError
from diff_transformer.generation import generate
from diff_transformer.model import document_ids
from diff_transformer.ops.mta import MTAWeights, _depthwise, mta_attention, reference_mta_attention
from diff_transformer.train import train
from test_model import rope_complex
from test_train import byte_dataset, debug_config  # noqa: F401  (byte_dataset: a fixture)
from checks import assert_matches_float64, compiled_decoding_error


def authors_convolution(scores, kernel, mask):
    """Their _mta_convolution, pad_key="both", one chunk: masked scores 0, c_q − 1 rows of zeros above,
    (c_k − 1)/2 columns either side, conv2d with one (1, c_q, c_k) kernel per head."""
    scores = scores.masked_fill(mask == float("-inf"), 0.0)
    qdim, kdim = kernel.shape[-2:]
    padded = F.pad(scores, ((kdim - 1) // 2, (kdim - 1) // 2, qdim - 1, 0), value=0.0)
    return F.conv2d(padded, kernel, padding=0, groups=scores.shape[1] // kernel.shape[1])


def authors_module(m, x, w=None):
    """(output (B, T, E), the map A that multiplies V (B, H, T, T)) of the authors' forward in float64 on
    the module's weights (``w``: float64 leaves by parameter name, for the gradients)."""
    cfg, d = m.config, m.head_dim
    w = w or {name: p.double() for name, p in m.named_parameters()}
    b, t, _ = x.shape
    h, hkv = cfg.n_heads, cfg.n_kv_heads
    x = x.double()
    xq = rope_complex((x @ w["q_proj.weight"].T).view(b, t, h, d), cfg.rope_theta)  # B S H D
    xk = rope_complex((x @ w["k_proj.weight"].T).view(b, t, hkv, d), cfg.rope_theta)
    xv = (x @ w["v_proj.weight"].T).view(b, t, hkv, d)
    xk, xv = xk.repeat_interleave(h // hkv, dim=2), xv.repeat_interleave(h // hkv, dim=2)  # repeat_kv
    xq, xk, xv = (e.transpose(1, 2) for e in (xq, xk, xv))  # B H S D
    mask = torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), diagonal=1).repeat(b, h, 1, 1)
    scores = xq @ xk.transpose(2, 3) / math.sqrt(d)
    if m.convolved:
        scores = authors_convolution(scores, w["kq_conv_pre"].unsqueeze(1), mask)
    scores = (scores.transpose(1, -1) @ w["head_mix_pre"].T).transpose(1, -1)  # wpsm, a Linear over the heads
    scores = torch.softmax(scores + mask, dim=-1)
    if m.convolved:
        scores = authors_convolution(scores, w["kq_conv_post"].unsqueeze(1), mask)
        scores = torch.where(mask == float("-inf"), 0.0, scores)
    kernel = w["head_mix_post"]  # their head_kernel (H / c_h, c_h, c_h)
    group = kernel.shape[1]
    grouped = scores.reshape(b, h // group, group, t, t)
    scores = torch.stack([(grouped[:, i].transpose(1, -1) @ kernel[i]).transpose(1, -1) for i in range(h // group)],
                         dim=1).reshape(b, h, t, t)
    out = (scores @ xv).transpose(1, 2)  # B S H D
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * w["head_norm.weight"]  # subln
    out = out * torch.sigmoid(out @ w["gate_proj.weight"].T + w["gate_proj.bias"])  # gate_1d
    return out.reshape(b, t, h * d) @ w["o_proj.weight"].T, scores


def mta_model(*, seed=0, backend="auto", **fields):
    """A debug-size MTA model (4 heads of width 16) whose mixing is far from the identity it starts at:
    kernels, head mixing, gate and norm weights drawn at random. Every layer convolves unless told."""
    torch.manual_seed(seed)
    config = ModelConfig.from_preset("debug", attention="mta", **{"mta_conv_every": 1, **fields})
    model = LanguageModel(config, attn_backend=backend)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "kq_conv" in name or "head_mix" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "gate_proj" in name:
                p.normal_(0.0, 0.5)
            elif "head_norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("convolved", [True, False], ids=["conv-layer", "mixing-layer"])
@pytest.mark.parametrize("n_kv_heads", [None, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("backend", ["reference", "auto", "sdpa"])  # "reference": the readable path; others: fast
def test_module_and_every_gradient_match_the_authors_forward_in_float64(convolved, n_kv_heads, backend):
    model = mta_model(n_kv_heads=n_kv_heads, mta_conv_every=1 if convolved else 4, backend=backend)
    module = model.layers[1].attn
    assert module.convolved == convolved
    x = torch.randn(2, 19, model.config.d_model, requires_grad=True)
    out = module(x)
    weights = {name: p.detach().double().requires_grad_() for name, p in module.named_parameters()}
    assert {"head_mix_pre", "head_mix_post", "gate_proj.weight", "gate_proj.bias", "head_norm.weight"} <= set(weights)
    x64 = x.detach().double().requires_grad_()
    expected, _ = authors_module(module, x64, weights)
    assert_matches_float64(module, x, out, x64, expected, weights)


def test_the_convolutions_and_the_mixing_change_the_output():
    """The comparison above is not vacuous: the same model with the identity kernels and mixing (what
    init sets) computes something else, and with them it is softmax attention, normed and gated."""
    model = mta_model()
    module = model.layers[0].attn
    x = torch.randn(2, 19, model.config.d_model)
    with torch.no_grad():
        mixed = module(x)
        module.init_weights(0.02, 0.02)  # identities again (and new projections)
        plain = module(x)
        q = rope_complex((x.double() @ module.q_proj.weight.double().T).view(2, 19, 4, 16), 10_000.0)
        k = rope_complex((x.double() @ module.k_proj.weight.double().T).view(2, 19, 4, 16), 10_000.0)
        v = (x.double() @ module.v_proj.weight.double().T).view(2, 19, 4, 16)
        mask = torch.ones(19, 19, dtype=torch.bool).tril()
        p = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / 4).masked_fill(~mask, float("-inf")).softmax(-1)
        heads = (p @ v.transpose(1, 2)).transpose(1, 2)  # B T H d
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-5)
        heads = heads * torch.sigmoid(heads @ module.gate_proj.weight.double().T)  # the bias is 0 at init
        softmax_attention = heads.reshape(2, 19, 64) @ module.o_proj.weight.double().T
    assert (plain.double() - softmax_attention).abs().max().item() < 1e-6
    assert (mixed.double() - plain.double()).abs().max().item() > 1e-3


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "padded"])
def test_fast_path_and_its_gradients_equal_the_reference(masked):
    """mta_attention against reference_mta_attention on the op's inputs: GQA (4 heads on 2), rows that
    start after position 0 (a cache's halo: R < S), and a mask with padding, forward and gradients."""
    g = torch.Generator().manual_seed(3)
    b, h, hkv, r, s, d = 2, 4, 2, 13, 17, 8
    q = torch.randn(b, h, r, d, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, 12, generator=g, requires_grad=True)
    params = [torch.randn(h, 4, 5, generator=g), torch.randn(h, 4, 5, generator=g), torch.randn(h, h, generator=g),
              torch.randn(2, 2, 2, generator=g)]
    params = [p.requires_grad_() for p in params]
    weights = MTAWeights(*params)
    visible = None
    if masked:  # row 1's first five keys are padding; every row keeps its own key
        real = torch.ones(b, s, dtype=torch.bool)
        real[1, :5] = False
        own = torch.arange(s)[None, :] == torch.arange(s - r, s)[:, None]
        visible = ((real[:, None, None, :] | own) & torch.ones(r, s, dtype=torch.bool).tril(s - r))
    fast = mta_attention(q, k, v, weights, visible=visible)
    slow, maps = reference_mta_attention(q, k, v, weights, visible=visible)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(maps.combined @ v.repeat_interleave(2, 1), slow, atol=1e-5, rtol=1e-5)
    grad = torch.randn(fast.shape, generator=g)
    inputs = [q, k, v, *params]
    fast_grads = torch.autograd.grad(fast, inputs, grad)
    slow_grads = torch.autograd.grad(slow, inputs, grad)
    for name, a, c in zip(["q", "k", "v", "kq_pre", "kq_post", "head_pre", "head_post"], fast_grads, slow_grads):
        torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("multiplier", [1, 3], ids=["one-kernel-a-channel", "three-kernels-a-channel"])
def test_the_depthwise_convolution_and_its_gradients_are_the_sums_written_out(multiplier):
    """_depthwise (its CPU weight gradient is a grouped convolution by the output gradient) against the
    convolution written as the sum of shifted products in float64, forward and both gradients: the
    oracle is autograd through that sum, not through any convolution."""
    g = torch.Generator().manual_seed(5)
    b, c, h, w, kh, kw = 3, 4, 9, 13, 3, 5
    x = torch.randn(b, c, h, w, generator=g).contiguous(memory_format=torch.channels_last).requires_grad_()
    weight = torch.randn(c * multiplier, 1, kh, kw, generator=g, requires_grad=True)
    out = _depthwise(x, weight, c)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    source = x64.repeat_interleave(multiplier, dim=1)  # output channel o reads input channel o // multiplier
    expected = sum(w64[:, 0, a, e].view(1, -1, 1, 1) * source[:, :, a:a + h - kh + 1, e:e + w - kw + 1]
                   for a in range(kh) for e in range(kw))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (x, weight), grad)
    want = torch.autograd.grad(expected, (x64, w64), grad.double())
    for name, a, e in zip(("input", "weight"), got, want):
        torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-5, msg=name)


def test_a_tap_sees_the_map_that_multiplies_the_values():
    """Under a tap the output is the model's, and maps.combined is the authors' A (convolved and mixed
    after the softmax; its rows need not sum to 1), maps.probs the softmax it came from."""

    class Maps(AttentionTap):
        def __init__(self):
            self.maps = {}

        def record(self, layer_index, maps):
            self.maps[layer_index] = maps

    model = mta_model().eval()
    tokens = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        plain, _ = model(tokens)
        with model.tap_attention(Maps()) as tap:
            tapped, _ = model(tokens)
        x = torch.randn(2, 17, model.config.d_model)
        module = model.layers[1].attn
        with model.tap_attention(Maps()) as one:
            out = module(x)
    torch.testing.assert_close(tapped, plain, atol=1e-5, rtol=1e-5)
    expected, a = authors_module(module, x)
    assert (out.double() - expected).abs().max().item() < 1e-5
    assert (one.maps[1].combined.double() - a).abs().max().item() < 1e-5
    assert (one.maps[1].combined.sum(-1) - 1).abs().max().item() > 1e-2
    torch.testing.assert_close(one.maps[1].probs[0].sum(-1), torch.ones(2, 4, 17))
    assert len(tap.maps) == model.config.n_layers


# the fast path with MHA in the fast tier; the readable path and MQA in the slow one
CACHE_CASES = [(kv, backend) if (kv, backend) == (None, "auto") else pytest.param(kv, backend, marks=pytest.mark.slow)
               for kv in (None, 1) for backend in ("auto", "reference")]


@pytest.mark.slow  # decodes token by token (5 s)
@pytest.mark.parametrize("n_kv_heads, backend", CACHE_CASES)
@pytest.mark.parametrize("static", [False, True], ids=["cache", "static-cache"])
def test_cached_decoding_gives_the_full_forward_logits(n_kv_heads, backend, static):
    """Chunked prefill (7, then 5 tokens: chunks shorter than the 2(c_q − 1) = 10 rows of halo) and one
    token at a time: the rows above each new one come from the queries the cache keeps."""
    model = mta_model(n_kv_heads=n_kv_heads, backend=backend).eval()
    tokens = torch.randint(0, 512, (2, 23))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(2, 32, static=static)
        pieces = [model(tokens[:, :7], cache=cache)[0], model(tokens[:, 7:12], cache=cache)[0]]
        pieces += [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(12, 23)]
    assert [q is None for q in cache.queries] == [False, False]
    assert cache.queries[0].shape == (2, 4, 32, 16)
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


def test_the_cache_keeps_queries_only_where_a_convolution_reads_them():
    """Layers 2, 6, ... of the authors' every-4th rule convolve; the others (head mixing only) and a
    one-row query kernel keep no queries."""
    config = ModelConfig.from_preset("tiny", attention="mta", n_layers=8)
    cache = LanguageModel(config, device="meta").new_cache(1, 8)
    assert [q is not None for q in cache.queries] == [i in (2, 6) for i in range(8)]
    one_row = ModelConfig.from_preset("debug", attention="mta", mta_conv_every=1, mta_query_kernel=1)
    assert LanguageModel(one_row, device="meta").new_cache(1, 8).queries == [None, None]


def test_left_padding_and_packed_documents_give_each_sequence_its_own_outputs():
    """A query never reads the rows of padding or of another document: a left-padded row's logits are
    its own, in a full forward, through a static cache and through a growing one; packed documents'
    logits and gradients are each document's own (the convolutions see each document's start as a
    sequence's start)."""
    model = mta_model().eval()
    rows = [torch.randint(0, 512, (n,)) for n in (9, 4)]
    steps = torch.randint(0, 512, (2, 5))
    prompt, real = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.bool)
    for i, row in enumerate(rows):
        prompt[i, 9 - len(row):], real[i, 9 - len(row):] = row, True
    with torch.no_grad():
        alone = [model(torch.cat([row, steps[i]])[None])[0][0] for i, row in enumerate(rows)]
        full, _ = model(torch.cat([prompt, steps], 1), padding_mask=torch.cat([real, torch.ones(2, 5, dtype=bool)], 1))
        for static in (False, True):
            cache, mask = model.new_cache(2, 20, static=static), real
            got = [model(prompt, cache=cache, padding_mask=real)[0]]
            for i in range(5):
                mask = None if static else torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1)
                got.append(model(steps[:, i : i + 1], cache=cache, padding_mask=mask)[0])
            for logits in (full, torch.cat(got, 1)):
                for i, row in enumerate(rows):
                    torch.testing.assert_close(logits[i, 9 - len(row):], alone[i], atol=1e-5, rtol=1e-5)
    model.train()
    documents = [torch.randint(1, 512, (n,)) for n in (5, 9, 1, 3, 6)]
    for document in documents[1:]:
        document[0] = 0
    tokens = torch.cat(documents)[None]
    weights = torch.randn(1, len(tokens[0]), 512)
    logits = model(tokens, document_ids=document_ids(tokens, 0))[0]
    (logits * weights).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    start, total = 0, 0.0
    for document in documents:
        alone = model(document[None])[0][0]
        assert (logits[0, start:start + len(document)] - alone).abs().max().item() < 2e-5
        total = total + (alone * weights[0, start:start + len(document)]).sum()
        start += len(document)
    total.backward()
    for name, p in model.named_parameters():
        assert (packed[name] - p.grad).abs().max().item() < 2e-5 * max(1.0, p.grad.abs().max().item()), name
    with torch.no_grad():  # the flex backend name runs the same materialised path (no BlockMask)
        model.set_attention_backend("flex")
        torch.testing.assert_close(model(tokens, document_ids=document_ids(tokens, 0))[0], logits.detach(),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # torch.compile traces the decoding step
def test_compiled_decoding_with_a_static_cache_compiles_once():
    """Without dynamic=True: the halo's rows and masks have fixed shapes, so one graph serves every step
    (a recompilation is an error here), and the logits follow a full forward."""
    assert compiled_decoding_error(mta_model().eval(), prompt=3) < 1e-5


@pytest.mark.slow  # torch.compile traces forward and backward
def test_a_training_step_compiles_into_one_graph_with_the_eager_gradients():
    model = mta_model()
    tokens = torch.randint(0, 512, (2, 24))
    model(tokens, tokens, return_logits=False)[1].backward()
    eager = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, backend="aot_eager", fullgraph=True)(tokens, tokens, return_logits=False)[1]
    loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_parameters_counted_by_hand(preset):
    """Beyond the matched Transformer (the same H heads of width d): per layer the two head mixings
    (H² each, the heads in one group), the head norm (d) and the gate (d + 1); per convolved layer (l % 4
    == 2) two kernels of H·6·11."""
    std, mta = (ModelConfig.from_preset(preset, attention=kind) for kind in ("standard", "mta"))
    assert (mta.n_heads, mta.n_kv_heads, mta.head_dim) == (std.n_heads, std.n_kv_heads, std.head_dim)
    h, d, layers = std.n_heads, std.head_dim, std.n_layers
    convolved = sum(1 for layer in range(layers) if layer % 4 == 2)
    count = {c.attention: LanguageModel(c, device="meta").num_parameters() for c in (std, mta)}
    assert count["mta"] - count["standard"] == layers * (2 * h * h + 2 * d + 1) + convolved * 2 * h * 6 * 11
    if preset == "tiny":  # 6 heads of 32, one convolved layer of four: 4 · 137 + 792
        assert (count["standard"], count["mta"]) == (4_916_928, 4_918_268)


@pytest.mark.slow  # builds every preset (4 s)
def test_info_lists_the_parameter_counts(capsys):
    assert cli_main(["info"]) == 0
    out = capsys.readouterr().out
    header, tiny = out.splitlines()[0], next(line for line in out.splitlines() if line.startswith("tiny"))
    assert "MTA" in header and "4,918,268" in tiny.split()


def test_init_is_the_identity_and_the_gate_is_drawn_as_the_input_projections():
    """Kernels: 1 at (the last query row, the middle key), 0 elsewhere; head mixings the identity; the
    gate's weight drawn after q, k, v and o at N(0, init_std), its bias 0."""
    config = ModelConfig.from_preset("debug", attention="mta", mta_conv_every=1)
    a = LanguageModel(config).layers[0].attn
    a.init_weights(0.02, 0.005, torch.Generator().manual_seed(5))
    identity = torch.zeros(4, 6, 11)
    identity[:, 5, 5] = 1.0
    assert torch.equal(a.kq_conv_pre, identity) and torch.equal(a.kq_conv_post, identity)
    assert torch.equal(a.head_mix_pre, torch.eye(4)) and torch.equal(a.head_mix_post, torch.eye(4)[None])
    g = torch.Generator().manual_seed(5)
    for tensor, std in ((a.q_proj.weight, 0.02), (a.k_proj.weight, 0.02), (a.v_proj.weight, 0.02),
                        (a.o_proj.weight, 0.005), (a.gate_proj.weight, 0.02)):
        torch.testing.assert_close(tensor, torch.empty_like(tensor).normal_(0.0, std, generator=g), atol=0, rtol=0)
    assert a.gate_proj.bias.item() == 0.0 and torch.equal(a.head_norm.weight, torch.ones(16))


def test_config_defaults_are_the_authors_and_round_trip(tmp_path):
    config = ModelConfig.from_preset("tiny", attention="mta")
    assert (config.mta_query_kernel, config.mta_key_kernel, config.mta_conv_every, config.mta_head_group) == (
        6, 11, 4, None)
    assert config.head_norm and [config.mta_conv_layer(i) for i in range(4)] == [False, False, True, False]
    assert ModelConfig.from_dict(config.to_dict()) == config
    model = mta_model(mta_head_group=2, mta_key_kernel=3)
    assert model.layers[0].attn.head_mix_post.shape == (2, 2, 2)
    out = model.save_pretrained(tmp_path / "model")
    loaded = LanguageModel.from_pretrained(out)
    assert loaded.config == model.config
    tokens = torch.randint(0, 512, (2, 9))
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0], atol=0, rtol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(attention="standard", mta_query_kernel=4),
     "mta_query_kernel only applies to attention='mta', not 'standard'"),
    (dict(attention="diff", mta_head_group=2), "mta_head_group only applies to attention='mta'"),
    (dict(mta_key_kernel=10), "mta_key_kernel must be odd"),
    (dict(mta_query_kernel=0), "mta_query_kernel must be a positive integer, got 0"),
    (dict(mta_conv_every=True), "mta_conv_every must be a positive integer, got True"),
    (dict(mta_head_group=3), "mta_head_group=3 must divide n_heads=4"),
])
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_preset("debug", **{"attention": "mta", **fields})


def test_export_hf_writes_it_as_remote_code(tmp_path, capsys):
    """No transformers class computes MTA: the export ships the modeling file (tests/test_export_remote.py)."""
    LanguageModel(ModelConfig.from_preset("debug", attention="mta")).save_pretrained(tmp_path / "model")
    assert cli_main(["export-hf", str(tmp_path / "model"), str(tmp_path / "hf")]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out
    assert (tmp_path / "hf" / "modeling_diff_transformer.py").is_file()


@pytest.mark.slow  # trains, resumes and generates (9 s)
def test_it_trains_resumes_and_generates_and_a_changed_setting_refuses_the_resume(byte_dataset,  # noqa: F811
                                                                                   tmp_path):
    """Through the trainer (its kernels and head mixing decayed as matrices): a run stopped after one step
    resumes to the end; a resume with another kernel is refused by the field's name (every ModelConfig
    field is compared, state.RESUME_RULES "fields"); batched generation with left padding gives each
    prompt what it gives alone."""
    models = {"mta": {"attention": "mta", "mta_conv_every": 1}}
    train(debug_config(byte_dataset, tmp_path, models, run={"stop_at_step": 1}))
    changed = {"mta": {"attention": "mta", "mta_conv_every": 1, "mta_key_kernel": 7}}
    with pytest.raises(CheckpointError, match=r"model\.mta_key_kernel: 11 -> 7"):
        train(debug_config(byte_dataset, tmp_path, changed), resume=True)
    result = train(debug_config(byte_dataset, tmp_path, models), resume=True)
    assert result.status == "completed" and result.steps == 6
    model = LanguageModel.from_pretrained(tmp_path / "checkpoint").eval()
    assert model.config.mta_conv_every == 1 and model.config.mta_key_kernel == 11
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    batched = generate(model, prompts, 8, temperature=0)
    assert batched == [generate(model, [p], 8, temperature=0)[0] for p in prompts]
