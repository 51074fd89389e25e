"""lm-evaluation-harness on an exported checkpoint, offline, with the task shipped in the package.

Runs the documented recipe (``lm_eval --model hf ... --include_path ... --tasks
diff_transformer_facts``) as a subprocess and checks that it reports an accuracy, and that the
log-likelihood it scored for every choice is the one this project's model gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from diff_transformer.config import ModelConfig
from diff_transformer.interop.hf import LM_EVAL_TASKS, export_hf
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import ByteTokenizer

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm_eval's hf model needs it
TASK = "diff_transformer_facts"


def continuation_loglikelihood(model: LanguageModel, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) summed over the continuation's tokens."""
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        logits, _ = model(tokens[:, :-1])
    logprobs = F.log_softmax(logits.float()[0, len(context) - 1 :], dim=-1)
    return logprobs.gather(-1, torch.tensor(continuation)[:, None]).sum().item()


@pytest.mark.slow
def test_lm_eval_scores_exported_checkpoint(tmp_path):
    model = LanguageModel(ModelConfig.from_preset("debug", n_kv_heads=1)).eval()
    model.save_pretrained(tmp_path / "ckpt", ByteTokenizer())
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    command = [
        sys.executable, "-m", "lm_eval",
        "--model", "hf",
        "--model_args", f"pretrained={tmp_path / 'hf'},dtype=float32",
        "--include_path", str(LM_EVAL_TASKS),
        "--tasks", TASK,
        "--device", "cpu",
        "--batch_size", "16",
        "--output_path", str(tmp_path / "results"),
        "--log_samples",
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]

    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    metrics = json.loads(results_file.read_text())["results"][TASK]
    assert 0.0 <= metrics["acc,none"] <= 1.0 and metrics["sample_len"] == 40

    (samples_file,) = (tmp_path / "results").rglob(f"samples_{TASK}_*.jsonl")
    tokenizer, correct = ByteTokenizer(), 0
    for line in samples_file.read_text().splitlines():
        sample = json.loads(line)
        doc = sample["doc"]
        theirs = [float(loglik) for loglik, _is_greedy in sample["filtered_resps"]]
        context = tokenizer.encode(doc["question"])
        ours = [continuation_loglikelihood(model, context, tokenizer.encode(" " + c)) for c in doc["choices"]]
        assert ours == pytest.approx(theirs, abs=1e-3), doc["question"]
        correct += max(range(len(ours)), key=ours.__getitem__) == doc["answer"]
    assert metrics["acc,none"] == pytest.approx(correct / 40)
