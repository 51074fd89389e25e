"""Importing Motif-2.6B and Motif-2-12.7B as released, without their weights: tiny random directories
in the released format (tests/motif_fixtures.py) imported with `import-hf`, their logits against an
independent float64 forward of the files (the public implementations' arithmetic), for both layouts,
MHA and GQA, tied and untied, fp32 and bf16 files; `--dtype bfloat16` keeping the bf16 values; the
config read field by field; what is not read exactly refused by name, nothing written."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diff_transformer import LanguageModel
from diff_transformer.checkpoint import CheckpointError, load_checkpoint_tokenizer
from diff_transformer.cli import main as cli_main
from diff_transformer.interop.hf import HFConversionError, export_hf, import_hf, load_hf
from motif_fixtures import make_tiny_motif_dir, motif_forward_float64

LOGITS_TOL = 1e-4  # fp32 model against the float64 forward, absolute

CASES = {
    "2.6b": dict(layout="2.6b"),
    "2.6b-gqa-tied": dict(layout="2.6b", gqa=True, tie=True),
    "12.7b": dict(layout="12.7b"),
    "12.7b-gqa-tied-bf16": dict(layout="12.7b", gqa=True, tie=True, dtype=torch.bfloat16),
    "2.6b-bf16-one-file": dict(layout="2.6b", dtype=torch.bfloat16, shards=1),
}


@pytest.fixture(scope="module", params=[case if case in ("2.6b", "12.7b-gqa-tied-bf16") else
                                        pytest.param(case, marks=pytest.mark.slow) for case in CASES])
def imported(request, tmp_path_factory):
    """(case, source directory, imported checkpoint) for each case, imported through the CLI."""
    root = tmp_path_factory.mktemp(request.param)
    source = make_tiny_motif_dir(root / "motif", **CASES[request.param])
    assert cli_main(["import-hf", str(source), str(root / "ckpt")]) == 0
    return request.param, source, root / "ckpt"


def test_imported_logits_match_the_float64_forward_of_the_files(imported):
    case, source, checkpoint = imported
    model = LanguageModel.from_pretrained(checkpoint).eval()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=g)
    with torch.no_grad():
        logits = model(tokens)[0].double()
    for row in range(2):
        expected = motif_forward_float64(source, tokens[row])
        assert expected.abs().max() > 1.0  # not a comparison of near-zero logits
        err = (logits[row] - expected).abs().max().item()
        assert err < LOGITS_TOL, f"{case}: max logit error {err:.2e}"


def test_imported_model_decodes_as_its_full_forward(imported):
    _, _, checkpoint = imported
    model = LanguageModel.from_pretrained(checkpoint).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 17))
    with torch.no_grad():
        full, _ = model(tokens)
        cache = model.new_cache(2, 20)
        pieces = [model(tokens[:, :9], cache=cache)[0]]
        pieces += [model(tokens[:, i : i + 1], cache=cache)[0] for i in range(9, 17)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-4


def test_the_config_is_read_field_by_field(imported):
    case, source, checkpoint = imported
    hf = json.loads((source / "config.json").read_text())
    config = LanguageModel.from_pretrained(checkpoint).config
    grouped = case.startswith("12.7b")
    assert config.attention == ("gda" if grouped else "diff")
    assert config.gda_ratio == (4 if grouped else None)
    assert config.n_heads == (8 if grouped else 4)  # signal heads / DIFF heads
    assert config.n_kv_heads == hf["num_key_value_heads"] // 2
    assert config.head_dim == (16 if grouped else 8)
    assert config.attn_head_dim == (16 if grouped else None)  # 12.7B's heads are wider than hidden_size allows
    assert config.ffn_activation == "polynorm" and config.ffn_hidden == 96
    assert config.lambda_init_depth_offset == -1
    assert config.lambda_init_for(0) == pytest.approx(0.8 - 0.6 * math.exp(0.3))  # Motif's layer 0: negative
    assert (config.norm_eps, config.head_norm_eps) == (1e-6, 1e-5)
    assert (config.rope_theta, config.rope_scaling, config.max_seq_len) == (500.0, None, 128)
    assert config.tie_embeddings == hf["tie_word_embeddings"]
    assert not (config.attention_bias or config.attention_out_bias or config.mlp_bias)


def test_the_tokenizer_keeps_its_own_special_tokens(imported):
    _, source, checkpoint = imported
    tokenizer = load_checkpoint_tokenizer(checkpoint)
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|end_of_text|>", "<|begin_of_text|>")
    hf = json.loads((source / "config.json").read_text())
    assert (tokenizer.eos_id, tokenizer.bos_id) == (hf["eos_token_id"], hf["bos_token_id"])


def test_bfloat16_is_kept_as_released(tmp_path):
    """--dtype bfloat16 writes the bf16 values unchanged (up to the rotary row order of q and k),
    λ vectors in fp32; the model computes the float64 forward's logits to bf16's precision."""
    source = make_tiny_motif_dir(tmp_path / "motif", "12.7b", dtype=torch.bfloat16)
    assert cli_main(["import-hf", str(source), str(tmp_path / "ckpt"), "--dtype", "bfloat16"]) == 0
    ours = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    theirs = {}
    for shard in sorted(source.glob("model-*.safetensors")):
        theirs.update(load_file(str(shard)))
    assert ours["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(ours["embed.weight"], theirs["model.embed_tokens.weight"])
    assert torch.equal(ours["layers.1.attn.v_proj.weight"], theirs["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(ours["layers.2.ffn.polynorm.weight"], theirs["model.layers.2.mlp.act_fn.weight"])
    q_ours, q_theirs = ours["layers.0.attn.q_proj.weight"], theirs["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q_ours.sort(dim=0).values, q_theirs.sort(dim=0).values)  # the same rows, reordered
    assert ours["layers.0.attn.lambda_q1"].dtype == torch.float32
    assert torch.equal(ours["layers.0.attn.lambda_q1"], theirs["model.layers.0.self_attn.lambda_q1"].float())
    model = LanguageModel.from_pretrained(tmp_path / "ckpt").eval()
    tokens = torch.randint(0, model.config.vocab_size, (24,))
    with torch.no_grad():
        err = (model(tokens[None])[0][0].double() - motif_forward_float64(source, tokens)).abs().max().item()
    assert err < LOGITS_TOL  # bf16 values held in an fp32 model: the same weights as the float64 forward's


def test_load_hf_gives_the_model_in_memory(tmp_path):
    source = make_tiny_motif_dir(tmp_path / "motif", "12.7b", gqa=True)
    model, tokenizer = load_hf(source)
    tokens = torch.randint(0, model.config.vocab_size, (20,))
    with torch.no_grad():
        err = (model.eval()(tokens[None])[0][0].double() - motif_forward_float64(source, tokens)).abs().max().item()
    assert err < LOGITS_TOL and tokenizer.eos_token == "<|end_of_text|>"
    bf16, _ = load_hf(source, dtype="bfloat16", with_tokenizer=False)
    assert bf16.embed.weight.dtype == torch.bfloat16


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts=64, experts_top_k=8), r"num_experts=64.*Motif-3"),
    (dict(kv_lora_rank=512, q_lora_rank=1536), r"q_lora_rank=1536, kv_lora_rank=512"),
    (dict(mhc_enabled=True), r"mhc_enabled=True"),
    (dict(k_ratio=3), r"k_ratio=3"),
    (dict(use_sliding_window=True, sliding_window=4096), r"use_sliding_window=True"),
    (dict(hidden_act="silu"), r"hidden_act 'silu'"),
    (dict(attn_rms_norm_eps=None), None),  # replaced below: the field removed
    (dict(head_dim=None), r"num_noise_heads without head_dim"),
    (dict(num_noise_heads=3), r"multiple of num_noise_heads"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), r"RoPE scaling 'yarn'"),
])
def test_what_is_not_read_exactly_is_refused_by_name_and_nothing_is_written(changes, message, tmp_path):
    source = make_tiny_motif_dir(tmp_path / "motif", "12.7b", tokenizer=False)
    if message is None:  # a field Motif's code reads without a default, missing
        config = json.loads((source / "config.json").read_text())
        del config["attn_rms_norm_eps"]
        (source / "config.json").write_text(json.dumps(config))
        message = r"missing field\(s\) attn_rms_norm_eps"
    else:
        _edit_config(source, **changes)
    with pytest.raises(HFConversionError, match=message):
        import_hf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_damaged_tensor_is_named_and_nothing_is_written(tmp_path, capsys):
    source = make_tiny_motif_dir(tmp_path / "motif", "2.6b", tokenizer=False)
    shard = sorted(source.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"NaN or Inf values in {name}"):
        import_hf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert cli_main(["import-hf", str(source), str(tmp_path / "out")]) == 2
    assert name in capsys.readouterr().err


def test_weights_that_do_not_fit_are_named_from_the_headers(tmp_path):
    source = make_tiny_motif_dir(tmp_path / "motif", "12.7b", shards=1, tokenizer=False)
    tensors = load_file(str(source / "model.safetensors"))
    tensors.pop("model.layers.1.mlp.act_fn.bias")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.mlp\.act_fn\.bias \| not understood: "
                                              r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        import_hf(source, tmp_path / "out")


def test_an_imported_motif_model_leaves_in_motif_layout_by_default(tmp_path):
    """The round trip, tensor for tensor: tests/test_motif_export.py."""
    for layout in ("2.6b", "12.7b"):
        source = make_tiny_motif_dir(tmp_path / layout, layout, tokenizer=False)
        import_hf(source, tmp_path / f"{layout}-ckpt")
        out = export_hf(tmp_path / f"{layout}-ckpt", tmp_path / f"{layout}-hf")
        assert json.loads((out / "config.json").read_text())["model_type"] == "Motif"


def test_the_streamed_file_is_a_safetensors_file_with_the_planned_tensors(tmp_path):
    source = make_tiny_motif_dir(tmp_path / "motif", "2.6b", tie=True, tokenizer=False)
    import_hf(source, tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "diff-transformer"}
    model = LanguageModel.from_pretrained(tmp_path / "ckpt")
    assert names == set(model.state_dict()) and "lm_head.weight" not in names


# Measures the resident memory of an import in a fresh process: VmHWM (the peak resident set of
# this process image; ru_maxrss would carry the parent's over from fork) less the resident size
# once the library is imported and the meta device used (its first use loads ~180 MB of code);
# prints {"baseline": bytes, "peak": bytes}.
MEASURE_IMPORT = """
import json, os, sys
from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.interop.hf import import_hf
def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024
LanguageModel(ModelConfig.from_preset("debug"), device="meta")
baseline = status("VmRSS")
import_hf(sys.argv[1], sys.argv[2], dtype=sys.argv[3], with_tokenizer=False)
print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
"""
MIB = 2**20


@pytest.mark.slow  # writes and imports a 190 MB directory twice
def test_import_holds_about_one_shard_and_a_few_tensors_never_the_model(tmp_path, capsys):
    """The peak resident memory of `import-hf` on an 8-shard bf16 directory: the largest tensor as
    read plus as written (its cast), far below the model's size, whatever the shards' sizes;
    docs/pretrained.md states the formula for Motif-2-12.7B."""
    sizes = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, vocab_size=32000,
                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)
    source = make_tiny_motif_dir(tmp_path / "motif", "2.6b", shards=8, dtype=torch.bfloat16, tokenizer=False,
                                 config_overrides=sizes)
    shards = sorted(source.glob("model-*.safetensors"))
    numels = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            numels.update({n: math.prod(f.get_slice(n).get_shape()) for n in f.keys()})
    largest_shard = max(s.stat().st_size for s in shards)
    env = {"PYTHONPATH": ":".join(sys.path)}
    for dtype, itemsize in (("bfloat16", 2), ("float32", 4)):
        out = tmp_path / f"ckpt-{dtype}"
        done = subprocess.run([sys.executable, "-c", MEASURE_IMPORT, str(source), str(out), dtype],
                              capture_output=True, text=True, check=True, env=env)
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        held = figures["peak"] - figures["baseline"]
        model_bytes = sum(numels.values()) * itemsize
        largest = max(numels.values()) * itemsize
        largest_read = max(numels.values()) * 2  # bf16 files
        with capsys.disabled():
            print(f"\nimport-hf --dtype {dtype}: {len(numels)} tensors in {len(shards)} shards of ≤ "
                  f"{largest_shard / MIB:.1f} MiB; model {model_bytes / MIB:.1f} MiB, largest tensor "
                  f"{largest_read / MIB:.1f} MiB read, {largest / MIB:.1f} MiB written; peak RSS above the "
                  f"baseline {held / MIB:.1f} MiB")
        assert held < largest_read + largest + 64 * MIB  # the largest tensor read and cast, and little else
        assert held < 0.6 * model_bytes  # the model is never held whole
        assert (out / "model.safetensors").stat().st_size > model_bytes  # it was written, whole


@pytest.mark.slow  # imports, prepares and trains two steps (about 15 s)
def test_an_imported_model_fine_tunes_from_its_weights_with_its_own_tokenizer(tmp_path):
    """The recipe of docs/pretrained.md: import, prepare a corpus with the model's own tokenizer (its
    special tokens read from the files beside it), write a training config whose model is the
    checkpoint's (its config.json), `train --init-from` it; the run starts from the imported weights."""
    import yaml

    source = make_tiny_motif_dir(tmp_path / "motif", "12.7b")
    assert cli_main(["import-hf", str(source), str(tmp_path / "ckpt")]) == 0
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    assert cli_main(["prepare", str(corpus), "--tokenizer", str(tmp_path / "ckpt" / "tokenizer.json"),
                     "--out", str(tmp_path / "data"), "--quiet"]) == 0
    model = json.loads((tmp_path / "ckpt" / "config.json").read_text())["model"]
    config = {
        "models": {"motif": model},
        "data": {"dataset": str(tmp_path / "data"), "seq_len": 32, "batch_size": 4, "eval_sequences": 4},
        "optim": {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "run": {"steps": 2, "eval_every": 2, "out_dir": str(tmp_path / "run"), "tensorboard": False,
                "progress": False},
    }
    (tmp_path / "finetune.yaml").write_text(yaml.safe_dump(config))
    before = LanguageModel.from_pretrained(tmp_path / "ckpt").state_dict()
    assert cli_main(["train", "--config", str(tmp_path / "finetune.yaml"), "--model", "motif",
                     "--init-from", str(tmp_path / "ckpt")]) == 0
    after = LanguageModel.from_pretrained(tmp_path / "run" / "checkpoint")
    assert after.config == LanguageModel.from_pretrained(tmp_path / "ckpt").config
    moved = [name for name, t in after.state_dict().items() if not torch.equal(t, before[name])]
    assert moved and all((after.state_dict()[n] - before[n]).abs().max() < 0.01 for n in moved)  # a few small steps
