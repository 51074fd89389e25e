"""``export-hf`` for every attention kind, as transformers' Llama / DiffLlama where they compute it and
as remote code otherwise: the shipped modeling file held to the library (logits, the cache path, every
config field), and the exported directories loaded with ``trust_remote_code=True`` in a process where
this package cannot be imported (logits, greedy tokens, the cache path, ``save_pretrained`` and back);
PEFT's LoRA and lm-evaluation-harness on an export."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diff_transformer.cli import main as cli_main
from diff_transformer.config import ModelConfig
from diff_transformer.interop import remote_code
from diff_transformer.interop.hf import LM_EVAL_TASKS
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import ByteTokenizer

transformers = pytest.importorskip("transformers")

LOGITS_TOL = 1e-4
# Every kind transformers has no exact class for, and the settings DiffLlama cannot express, on the
# "debug" size (d_model 64, 2 layers); GQA where the kind takes it, so that the head grouping shows.
CASES = {
    "standard": dict(attention="standard", n_kv_heads=2),
    "diff": dict(attention="diff", n_kv_heads=1),
    "diff_v2": dict(attention="diff_v2", n_kv_heads=2),
    "diff_symmetric": dict(attention="diff_symmetric"),
    "gated": dict(attention="gated", n_kv_heads=2),
    "gated_headwise": dict(attention="gated_headwise"),
    "gda": dict(attention="gda", n_heads=4, gda_ratio=2, n_kv_heads=1),
    "mta": dict(attention="mta", mta_conv_every=1, mta_query_kernel=3, mta_key_kernel=3, n_kv_heads=2),
    "xsa": dict(attention="xsa", xsa_gate=True, n_kv_heads=2),
    "diff-converted": dict(attention="diff", value_factor=1, n_heads=4, lambda_init=0.5, head_norm=False),
    "diff-motif-arithmetic": dict(attention="diff", ffn_activation="polynorm", lambda_init_depth_offset=-1,
                                  attention_bias=True, attention_out_bias=True, mlp_bias=True, head_norm_eps=1e-6,
                                  rope_scaling=dict(kind="llama3", factor=4.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_seq_len=32)),
    "standard-head-norm": dict(attention="standard", head_norm=True, tie_embeddings=True),
}


# Exported as transformers' own classes (tests/test_hf.py); the file computes them too
EXACT = {"standard": "LlamaForCausalLM", "diff": "DiffLlamaForCausalLM"}


def random_model(overrides: dict) -> LanguageModel:
    """A debug-size model whose every weight matters: a larger init than training's (sharp maps), random
    norm weights, λ vectors, gates, MTA kernels and mixings, biases and PolyNorm coefficients."""
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig.from_preset("debug", init_std=0.1, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif "lambda_" in name or "xsa_gate" in name or name.endswith("bias"):
                param.normal_(0.0, 0.3)
            elif "kq_conv" in name or "head_mix" in name or "polynorm" in name:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def in_package_remote_model(model: LanguageModel):
    """The package's own modeling file (the one an export ships) built from the export's config and tensors."""
    from diff_transformer.interop.configuration_diff_transformer import DiffTransformerConfig
    from diff_transformer.interop.modeling_diff_transformer import DiffTransformerForCausalLM

    fields = remote_code.remote_config(model.config, None)
    for name in ("model_type", "architectures", "auto_map"):
        fields.pop(name)
    remote = DiffTransformerForCausalLM(DiffTransformerConfig(**fields)).eval()
    state = {remote_code.remote_name(name): t for name, t in model.state_dict().items()}
    missing, unexpected = remote.load_state_dict(state, strict=False)
    assert not unexpected and missing in ([], ["lm_head.weight"]), (missing, unexpected)  # tied: one tensor
    return remote


@pytest.mark.parametrize("case", CASES)
def test_the_modeling_file_computes_the_library_and_its_cache_path_equals_the_full_forward(case):
    model = random_model(CASES[case])
    remote = in_package_remote_model(model)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        full = remote(tokens, use_cache=False).logits
        assert (full - model(tokens)[0]).abs().max().item() <= LOGITS_TOL
        # a prefix, then one token at a time through transformers' DynamicCache (MTA's halo: 4 rows)
        out = remote(tokens[:, :8], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for i in range(8, 16):
            out = remote(tokens[:, i : i + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
        assert (torch.cat(steps, dim=1) - full).abs().max().item() <= LOGITS_TOL


@pytest.mark.parametrize("case", ["mta", "gda", "xsa"])
def test_a_left_padded_row_computes_what_it_computes_alone(case):
    """attention_mask (B, S) as generate passes it for a padded batch, with its positions from the mask."""
    remote = in_package_remote_model(random_model(CASES[case]))
    alone = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([torch.zeros(1, 5, dtype=torch.long), alone], dim=1)
    mask = (torch.arange(12) >= 5).long()[None]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        padded = remote(ids, attention_mask=mask, position_ids=positions).logits[:, 5:]
        assert (padded - remote(alone).logits).abs().max().item() <= LOGITS_TOL


def test_every_config_field_is_carried_or_said_to_be_no_part_of_the_function():
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    stated = (set(remote_code.RENAMED) | set(remote_code.COPIED) | set(remote_code.REWRITTEN)
              | set(remote_code.NOT_CARRIED))
    assert fields == stated


def test_the_shipped_files_import_only_torch_and_transformers():
    for name in remote_code.REMOTE_FILES:
        tree = ast.parse((remote_code.HERE / name).read_text())
        modules = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                   for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for alias in node.names}
        assert {m.split(".")[0] for m in modules if m} <= {"__future__", "math", "torch", "transformers",
                                                            "configuration_diff_transformer"}, (name, modules)


# --- end to end, in a process without this package ----------------------------------------------

# Run in a subprocess: the package is made unimportable first, then each export is loaded as a user would.
LOADER = r"""
import importlib.abc, json, sys

class NoPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "diff_transformer" or name.startswith("diff_transformer."):
            raise ImportError("diff_transformer is blocked in this process")

sys.meta_path.insert(0, NoPackage())
try:
    import diff_transformer  # noqa: F401
    sys.exit("diff_transformer was importable")
except ImportError:
    pass

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

results = {}
for directory in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    inputs = load_file(directory + "/../inputs.safetensors")
    tokens, prompt = inputs["tokens"], inputs["prompt"]
    with torch.no_grad():
        logits = model(tokens).logits
        out = model(tokens[:, :8], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for i in range(8, tokens.shape[1]):
            out = model(tokens[:, i : i + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
        cached = torch.cat(steps, dim=1)
        greedy = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=tokenizer.pad_token_id)[0, prompt.shape[1]:]
    model.save_pretrained(directory + "-saved")
    again = AutoModelForCausalLM.from_pretrained(directory + "-saved", trust_remote_code=True).eval()
    with torch.no_grad():
        resaved = (again(tokens).logits - logits).abs().max().item()
    results[directory] = {"class": type(model).__name__, "module": type(model).__module__,
                          "logits": logits.tolist(), "cache_error": (cached - logits).abs().max().item(),
                          "greedy": greedy.tolist(), "resaved_error": resaved,
                          "eos": tokenizer.eos_token, "encoded": tokenizer.encode("hi")}
print(json.dumps(results))
"""


def run_without_package(script: str, *args: str, home: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter that cannot import this package (it blocks it first), offline."""
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": ""}
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.slow
def test_every_kind_loads_with_remote_code_where_the_package_cannot_be_imported(tmp_path, capsys):
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    prompt = tokens[:1, :8].clone()
    save_file({"tokens": tokens, "prompt": prompt}, str(tmp_path / "inputs.safetensors"))
    ours = {}
    for case, overrides in CASES.items():
        model = random_model(overrides)
        model.save_pretrained(tmp_path / f"{case}-ckpt", ByteTokenizer())
        # --layout hf: the Motif-like case would leave in Motif's layout by default
        assert cli_main(["export-hf", str(tmp_path / f"{case}-ckpt"), str(tmp_path / case), "--layout", "hf"]) == 0
        printed = capsys.readouterr().out
        if case not in EXACT:
            assert "trust_remote_code=True" in printed
            config = json.loads((tmp_path / case / "config.json").read_text())
            assert config["model_type"] == "diff_transformer" and "AutoModelForCausalLM" in config["auto_map"]
            for name in remote_code.REMOTE_FILES:  # byte for byte the package's modules
                assert (tmp_path / case / name).read_bytes() == (remote_code.HERE / name).read_bytes()
        with torch.no_grad():
            ours[case] = (model(tokens)[0], model.generate([prompt[0].tolist()], max_new_tokens=12, temperature=0)[0])
    run = run_without_package(LOADER, *(str(tmp_path / case) for case in CASES), home=tmp_path / "hf_home")
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.splitlines()[-1])
    for case in CASES:
        theirs = results[str(tmp_path / case)]
        assert theirs["class"] == EXACT.get(case, "DiffTransformerForCausalLM"), case
        assert theirs["module"].startswith("transformers." if case in EXACT else "transformers_modules"), case
        error = (torch.tensor(theirs["logits"]) - ours[case][0]).abs().max().item()
        print(f"{case}: largest logit error {error:.2e}, cache path {theirs['cache_error']:.2e}")
        assert error <= LOGITS_TOL, case
        assert theirs["cache_error"] <= LOGITS_TOL, case
        assert theirs["resaved_error"] == 0.0, case
        assert theirs["greedy"] == ours[case][1], case
        assert theirs["eos"] == "<|endoftext|>" and theirs["encoded"] == list(b"hi"), case


# --- the tools users already run -------------------------------------------------------------------


@pytest.fixture(scope="module")
def diff_v2_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("diff_v2")
    model = LanguageModel(ModelConfig.from_preset("debug", attention="diff_v2", n_kv_heads=2)).eval()
    model.save_pretrained(root / "ckpt", ByteTokenizer())
    assert cli_main(["export-hf", str(root / "ckpt"), str(root / "hf")]) == 0
    return model, root


@pytest.mark.slow
def test_a_lora_adapter_attaches_to_an_export_and_trains_a_step(diff_v2_export, tmp_path):
    peft = pytest.importorskip("peft")
    _, root = diff_v2_export
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf"), trust_remote_code=True)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [name for name, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in lora.named_parameters() if not p.requires_grad}
    loss = lora(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(before[n], p) for n, p in lora.named_parameters() if p.requires_grad)
    assert all(torch.equal(frozen[n], p) for n, p in lora.named_parameters() if not p.requires_grad)
    lora.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_lm_eval_scores_an_exported_diff_v2_model(diff_v2_export):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    model, root = diff_v2_export
    command = [sys.executable, "-m", "lm_eval", "--model", "hf",
               "--model_args", f"pretrained={root / 'hf'},dtype=float32,trust_remote_code=True",
               "--include_path", str(LM_EVAL_TASKS), "--tasks", "diff_transformer_facts", "--device", "cpu",
               "--batch_size", "16", "--output_path", str(root / "results"), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(root / "hf_home")}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (results,) = (root / "results").rglob("results_*.json")
    metrics = json.loads(results.read_text())["results"]["diff_transformer_facts"]
    assert 0.0 <= metrics["acc,none"] <= 1.0 and metrics["sample_len"] == 40
    (samples,) = (root / "results").rglob("samples_diff_transformer_facts_*.jsonl")
    sample = json.loads(samples.read_text().splitlines()[0])
    tokenizer = ByteTokenizer()
    context = tokenizer.encode(sample["doc"]["question"])
    for choice, (loglik, _) in zip(sample["doc"]["choices"], sample["filtered_resps"]):
        continuation = tokenizer.encode(" " + choice)
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids[:, :-1])[0][0, len(context) - 1 :], dim=-1)
        ours = logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum().item()
        assert ours == pytest.approx(float(loglik), abs=1e-3)


def test_the_motif_layout_refuses_a_model_it_cannot_express_and_writes_nothing(tmp_path, capsys):
    LanguageModel(ModelConfig.from_preset("debug", attention="diff_v2")).save_pretrained(tmp_path / "ckpt")
    assert cli_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--layout", "motif"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "--layout motif: this model has attention='diff_v2'" in err
    assert not (tmp_path / "out").exists()


def test_an_export_is_replaced_only_with_overwrite(tmp_path, capsys):
    LanguageModel(ModelConfig.from_preset("debug", attention="xsa")).save_pretrained(tmp_path / "ckpt")
    assert cli_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    assert cli_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--overwrite"]) == 0
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in weights
