"""scripts/hf_reference_check.py on a debug-sized config: HF DiffLlama and Llama read the trainer's
batches, Llama has our standard model's parameter count, results.json has its fields."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from diff_transformer.data import corpus_documents, prepare  # noqa: E402
from diff_transformer.train import load_config  # noqa: E402
from diff_transformer.train.trainer import DataPlan  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hf_reference_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("hf_reference_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture
def config_file(tmp_path) -> Path:
    """The debug preset on ~20 KB of the corpus as bytes: 2 steps of 4 sequences of 32 tokens."""
    text = corpus_documents()[0][1][:20_000]
    (tmp_path / "text.txt").write_text(text)
    prepare([tmp_path / "text.txt"], tmp_path / "shards", tokenizer="bytes", progress=False)
    config = {
        "name": "hf-debug",
        "model": {"preset": "debug"},
        "models": {"standard": {"attention": "standard"}, "diff": {"attention": "diff"}},
        "data": {"dataset": str(tmp_path / "shards"), "seq_len": 32, "batch_size": 4, "eval_sequences": 4},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "run": {"steps": 2, "eval_every": 1, "out_dir": str(tmp_path / "unused")},
        "compare": {"models": ["standard", "diff"], "seeds": 2},
    }
    path = tmp_path / "debug.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow  # trains transformers' models
def test_hf_models_train_on_our_batches_with_our_shapes(check, config_file, tmp_path, monkeypatch):
    seen = []  # (HF class, batches) of every training step, in order
    real = check.forward_backward

    def spy(model, forward_model, batches, *args):
        seen.append((type(model.hf).__name__, batches))
        return real(model, forward_model, batches, *args)

    monkeypatch.setattr(check, "forward_backward", spy)
    results = check.main(["--config", str(config_file), "--out", str(tmp_path / "out")])

    # Every run (2 seeds x 2 models) read exactly the trainer's batches for steps 0 and 1.
    config = load_config(config_file)
    plan = DataPlan(config, 32, check.CPU)
    expected = [list(plan.micro_batches(step)) for step in range(2)]
    diff, llama = "DiffLlamaForCausalLM", "LlamaForCausalLM"
    assert [name for name, _ in seen] == [diff, diff, llama, llama] * 2  # seeds, then models, then steps
    for i, (_, batches) in enumerate(seen):
        for (inputs, targets), (want_in, want_t) in zip(batches, expected[i % 2], strict=True):
            assert torch.equal(inputs, want_in) and torch.equal(targets, want_t)
    assert results["same_batches"]

    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["parameters"]["Llama"]["hf"] == written["parameters"]["Llama"]["ours"]
    assert written["parameters"]["DiffLlama"]["ours_minus_hf"] == 2 * 2 * 16  # head-norm weights: 2 layers x 2d
    assert {"config", "steps", "seeds", "lr_grid", "parameters", "models", "difference", "runs",
            "train_batches_sha256", "validation_sha256", "hf_configs"} <= set(written)
    assert written["seeds"] == [0, 1] and written["steps"] == 2
    for name in ("DiffLlama", "Llama"):
        model = written["models"][name]
        assert model["best_lr"] == 3e-3 and len(model["final_val_loss"]["per_seed"]) == 2
        assert model["final_val_loss"]["std"] is not None
    assert set(written["difference"]) == {"delta", "low", "high"} and written["difference"]["low"] is not None
    assert len(written["runs"]) == 4 and all(r["status"] == "completed" for r in written["runs"])
    assert "DiffLlama − Llama" in (tmp_path / "out" / "results.md").read_text()


def test_scaled_init_on_an_hf_model_divides_its_residual_writers_by_sqrt_2l(check):
    model = torch.nn.ModuleDict({"o_proj": torch.nn.Linear(4, 4), "down_proj": torch.nn.Linear(4, 4),
                                 "q_proj": torch.nn.Linear(4, 4)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check.scale_residual_writers(model, n_layers=8)  # 1 / sqrt(16) = 1/4
    after = model.state_dict()
    assert torch.allclose(after["o_proj.weight"], before["o_proj.weight"] / 4)
    assert torch.allclose(after["down_proj.weight"], before["down_proj.weight"] / 4)
    for key in ("q_proj.weight", "o_proj.bias"):
        assert torch.equal(after[key], before[key])


@pytest.mark.slow  # trains ours and transformers' retrieval models
def test_the_retrieval_check_trains_both_implementations_on_the_same_curve(check, config_file, tmp_path):
    data = yaml.safe_load(config_file.read_text())
    data["retrieval"] = dict(length=32, keys=8, values=8, noise_tokens=8, d_model=32, n_layers=1, n_heads=1, steps=4,
                             batch_size=4, needles=[1, 2], depths=[0.0, 1.0], pairs=[2, 4], eval_samples=2,
                             quantize_bits=[4], lr=2e-3)
    config_file.write_text(yaml.safe_dump(data))
    results = check.main(["--config", str(config_file), "--task", "retrieval", "--recipes", "scaled-init,plain-init",
                          "--out", str(tmp_path / "out")])
    assert len(results["runs"]) == 2 * 2 * 2 * 2  # recipes × seeds × implementations × kinds
    llama = [r["parameters"] for r in results["runs"] if r["model"] == "Llama"]
    ours = [r["parameters"] for r in results["runs"] if r["model"] == "Transformer"]
    assert set(llama) == set(ours)  # the same shape
    for key, row in results["table"].items():
        assert row["steps"] == [0, 1, 2, 4] and set(row["difference"]) == {"needle", "mqar"}
        first = row["difference"]["mqar"][-1]
        diff_final = [r["curve"][-1]["mean_accuracy"]["mqar"] for r in results["runs"]
                      if f"{r['recipe']}/{r['impl']}" == key and r["kind"] == "diff"]
        base_final = [r["curve"][-1]["mean_accuracy"]["mqar"] for r in results["runs"]
                      if f"{r['recipe']}/{r['impl']}" == key and r["kind"] == "standard"]
        assert first["delta"] == pytest.approx(sum(diff_final) / 2 - sum(base_final) / 2)
    text = (tmp_path / "out" / "retrieval.md").read_text()
    assert "## scaled-init" in text and "## plain-init" in text and "DiffLlama − Llama" in text
