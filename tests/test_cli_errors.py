"""Every command answers a bad value, path or file with one line ``error: <what> (<why>)`` on
stderr and exit status 2, before any work and never with a traceback. Most cases run
in-process through ``cli.main``; a few as subprocesses prove that no traceback reaches stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diff_transformer.cli import main
from diff_transformer.config import ModelConfig
from diff_transformer.model import LanguageModel
from diff_transformer.tokenizer import ByteTokenizer
from motif_fixtures import make_tiny_motif_dir

CUDA_BAD = "cuda:99" if torch.cuda.is_available() else "cuda"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A debug checkpoint, a damaged copy, a text file, a JSONL file and a plain file."""
    root = tmp_path_factory.mktemp("cli-errors")
    ckpt = root / "ckpt"
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(ckpt, ByteTokenizer())
    damaged = root / "damaged"
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(damaged, ByteTokenizer())
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    (root / "text.txt").write_text("To be, or not to be, that is the question.\n" * 20)
    (root / "docs.jsonl").write_text('{"body": "some text"}\n')
    (root / "junk.json").write_bytes(os.urandom(300))
    (root / "file").write_text("a file, not a directory")
    (root / "empty.yaml").write_text("")
    (root / "nomodel.yaml").write_text("run: {steps: 3}\n")
    (root / "empty.txt").write_text("")
    (root / "baddata").mkdir()
    (root / "baddata" / "meta.json").write_bytes(b'{"format": "diff-transformer-tokens", \xff')
    integers = root / "int32"  # a checkpoint whose tensors were stored as integers
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(integers, ByteTokenizer())
    weights = load_file(integers / "model.safetensors")
    save_file({k: v.to(torch.int32) for k, v in weights.items()}, integers / "model.safetensors")
    no_tokenizer = root / "no-tokenizer"  # 512 ids, saved without the tokenizer it was trained with
    LanguageModel(ModelConfig.from_preset("debug")).save_pretrained(no_tokenizer)
    motif = make_tiny_motif_dir(root / "motif", "12.7b")  # a transformers directory, with a Llama-style tokenizer
    motif3 = make_tiny_motif_dir(root / "motif3", "12.7b", tokenizer=False,
                                 config_overrides={"num_experts": 64, "kv_lora_rank": 512})
    return {"motif": motif, "motif3": motif3,
            "root": root, "ckpt": ckpt, "damaged": damaged, "text": root / "text.txt", "jsonl": root / "docs.jsonl",
            "junk": root / "junk.json", "file": root / "file", "empty_config": root / "empty.yaml",
            "no_model": root / "nomodel.yaml", "empty_text": root / "empty.txt", "baddata": root / "baddata",
            "int32": integers, "no_tokenizer": no_tokenizer}


# (case id, argument list with {placeholders}, text the error line must contain)
CASES = [
    # generate: every option that takes a value
    ("generate-checkpoint-missing", ["generate", "{root}/none"], "not a checkpoint directory"),
    ("generate-checkpoint-is-file", ["generate", "{file}"], "not a checkpoint directory (a file"),
    ("generate-checkpoint-truncated", ["generate", "{damaged}"], "truncated or corrupted safetensors"),
    ("generate-max-new-tokens", ["generate", "{ckpt}", "--max-new-tokens", "-3"],
     "--max-new-tokens: '-3' is not valid (must be a positive integer)"),
    ("generate-max-new-tokens-word", ["generate", "{ckpt}", "--max-new-tokens", "ten"], "an integer is needed"),
    ("generate-temperature", ["generate", "{ckpt}", "--temperature", "-1"],
     "--temperature: '-1' is not valid (must be 0 or more)"),
    ("generate-temperature-nan", ["generate", "{ckpt}", "--temperature", "nan"], "a finite number is needed"),
    ("generate-top-k", ["generate", "{ckpt}", "--top-k", "0"], "--top-k: '0' is not valid"),
    ("generate-top-p", ["generate", "{ckpt}", "--top-p", "1.5"], "--top-p: '1.5' is not valid (must be in (0, 1])"),
    ("generate-top-p-zero", ["generate", "{ckpt}", "--top-p", "0"], "must be in (0, 1]"),
    ("generate-seed", ["generate", "{ckpt}", "--seed", "-1"], "--seed: '-1' is not valid (a seed must be"),
    ("generate-tokenizer-missing", ["generate", "{ckpt}", "--tokenizer", "{root}/none.json"], "--tokenizer"),
    ("generate-tokenizer-junk", ["generate", "{ckpt}", "--tokenizer", "{junk}"], "not a readable tokenizers JSON file"),
    ("generate-device", ["generate", "{ckpt}", "--device", "gpu0"], "--device: 'gpu0' is not valid"),
    ("generate-device-cuda", ["generate", "{ckpt}", "--device", CUDA_BAD], "--device"),
    ("generate-prompt-too-long", ["generate", "{ckpt}", "--prompt", "x" * 200],
     "--prompt: 200 tokens (the model's context is 128)"),
    ("generate-prompt-not-utf8", ["generate", "{ckpt}", "--prompt", "caf\udce9"],
     "--prompt: b'caf\\xe9' is not UTF-8 text"),
    ("generate-beyond-context", ["generate", "{ckpt}", "--prompt", "x" * 100, "--max-new-tokens", "500"],
     "--max-new-tokens 500: the prompt (100 tokens) and 500 new tokens exceed the model's context of 128 tokens; "
     "at most 28 fit after this prompt"),
    ("generate-tokenizer-too-small", ["generate", "{no_tokenizer}", "--tokenizer", "bytes"],
     "--tokenizer bytes: ByteTokenizer of 257 tokens for a model of vocab_size 512: ids 257 to 511 would have no text"),
    ("generate-tokenizer-too-large", ["generate", "{ckpt}", "--tokenizer", "default"],
     "--tokenizer default: BPETokenizer of 8,192 tokens, more than the model's vocab_size 257"),
    ("generate-integer-weights", ["generate", "{int32}"],
     "not floating point: embed.weight is torch.int32 (the model's torch.float32)"),
    # info
    ("info-missing", ["info", "{root}/none"], "not a checkpoint directory"),
    ("info-truncated", ["info", "{damaged}"], "truncated or corrupted safetensors"),
    # tokenizer train
    ("tokenizer-input", ["tokenizer", "train", "--input", "{root}/none.txt", "--out", "{root}/t.json"], "--input: "),
    ("tokenizer-vocab-size", ["tokenizer", "train", "--input", "{text}", "--vocab-size", "0", "--out", "{root}/t.json"],
     "--vocab-size"),
    ("tokenizer-vocab-size-small", ["tokenizer", "train", "--input", "{text}", "--vocab-size", "100", "--out",
                                    "{root}/t.json"], "vocab_size must be between 257"),
    ("tokenizer-out-is-dir", ["tokenizer", "train", "--input", "{text}", "--out", "{root}"],
     "an output file is needed, this is a directory"),
    ("tokenizer-out-exists", ["tokenizer", "train", "--input", "{text}", "--out", "{file}"],
     "already exists; pass --overwrite"),
    ("tokenizer-text-field", ["tokenizer", "train", "--input", "{jsonl}", "--out", "{root}/t.json"], "no field 'text'"),
    ("tokenizer-min-frequency", ["tokenizer", "train", "--input", "{text}", "--out", "{root}/t.json",
                                 "--min-frequency", "0"], "--min-frequency"),
    # prepare
    ("prepare-input", ["prepare", "{root}/none.txt", "--out", "{root}/data"], "argument INPUT: "),
    ("prepare-out-is-file", ["prepare", "{text}", "--out", "{file}"], "an output directory is needed, this is a file"),
    ("prepare-out-under-file", ["prepare", "{text}", "--out", "{file}/data"],
     "is a file, so no directory can be created"),
    ("prepare-tokenizer", ["prepare", "{text}", "--out", "{root}/data", "--tokenizer", "{root}/none.json"],
     "--tokenizer"),
    ("prepare-text-field", ["prepare", "{jsonl}", "--out", "{root}/data", "--text-field", "content"],
     "no field 'content'"),
    ("prepare-val-fraction", ["prepare", "{text}", "--out", "{root}/data", "--val-fraction", "1.5"],
     "--val-fraction: '1.5' is not valid (must be more than 0 and less than 1: train needs a validation split)"),
    ("prepare-val-fraction-0", ["prepare", "{text}", "--out", "{root}/data", "--val-fraction", "0"],
     "--val-fraction: '0' is not valid (must be more than 0 and less than 1: train needs a validation split)"),
    ("prepare-seed", ["prepare", "{text}", "--out", "{root}/data", "--seed", "x"], "--seed"),
    ("prepare-workers", ["prepare", "{text}", "--out", "{root}/data", "--workers", "0"],
     "--workers: '0' is not valid (must be a positive integer)"),
    ("prepare-eos-token-of-default", ["prepare", "{text}", "--out", "{root}/data", "--eos-token", "</s>"],
     "tokenizer 'default' has its own end-of-text token"),
    ("prepare-bos-token", ["prepare", "{text}", "--out", "{root}/data", "--tokenizer", "{motif}/tokenizer.json",
                           "--bos-token", "<s>"], "bos token '<s>' (from --bos-token '<s>') is not in its vocabulary"),
    # export-hf / import-hf
    ("export-checkpoint", ["export-hf", "{root}/none", "{root}/hf"], "not a checkpoint directory"),
    ("export-out", ["export-hf", "{ckpt}", "{file}"], "an output directory is needed"),
    ("export-layout", ["export-hf", "{ckpt}", "{root}/hf", "--layout", "bogus"], "invalid choice: 'bogus'"),
    ("import-directory", ["import-hf", "{root}/none", "{root}/back"], "no such directory"),
    ("import-out", ["import-hf", "{root}", "{file}/x"], "is a file, so no directory"),
    ("import-own-checkpoint", ["import-hf", "{ckpt}", "{root}/back"],
     "{ckpt} is already a diff-transformer checkpoint, not a transformers directory: nothing to import"),
    ("import-dtype", ["import-hf", "{motif}", "{root}/back", "--dtype", "int8"], "invalid choice: 'int8'"),
    ("import-eos-token", ["import-hf", "{motif}", "{root}/back", "--eos-token", "</s>"],
     "eos token '</s>' (from --eos-token '</s>') is not in its vocabulary"),
    ("import-bos-token", ["import-hf", "{motif}", "{root}/back", "--bos-token", "<s>"], "bos token '<s>'"),
    ("import-motif-3", ["import-hf", "{motif3}", "{root}/back"], "num_experts=64, kv_lora_rank=512"),
    # convert (its refusals of sources and outputs: tests/test_convert.py)
    ("convert-source", ["convert", "{root}/none", "{root}/conv"], "argument SOURCE: "),
    ("convert-source-diff", ["convert", "{ckpt}", "{root}/conv"], "holds a model with attention='diff'"),
    ("convert-out", ["convert", "{ckpt}", "{file}"], "an output directory is needed"),
    ("convert-to", ["convert", "{ckpt}", "{root}/conv", "--to", "gated"], "argument --to: invalid choice: 'gated'"),
    ("convert-init", ["convert", "{ckpt}", "{root}/conv", "--init", "zero"], "argument --init: invalid choice"),
    ("convert-seed", ["convert", "{ckpt}", "{root}/conv", "--seed", "-1"], "--seed: '-1' is not valid"),
    ("convert-windows", ["convert", "{ckpt}", "{root}/conv", "--windows", "0"], "--windows: '0' is not valid"),
    ("convert-text", ["convert", "{ckpt}", "{root}/conv", "--text", "{root}/none.txt"], "--text: "),
    # eval (the shared flags, and the option flags of several evaluations)
    ("eval-checkpoint", ["eval", "needle", "--checkpoint", "{root}/none"],
     "--checkpoint {root}/none: not a checkpoint directory"),
    ("eval-label", ["eval", "needle", "--checkpoint", "{ckpt}", "--label", "a", "--label", "b"],
     "2 --label for 1 --checkpoint"),
    ("eval-out", ["eval", "needle", "--checkpoint", "{ckpt}", "--out", "{file}"], "--out"),
    ("eval-tokenizer", ["eval", "needle", "--checkpoint", "{ckpt}", "--tokenizer", "{root}/none.json"], "--tokenizer"),
    ("eval-tokenizer-not-the-models", ["eval", "position-nll", "--checkpoint", "{no_tokenizer}", "--tokenizer", "bytes",
                                       "--out", "{root}/pn", "--quick", "--no-progress"],
     "tokenizer bytes: ByteTokenizer of 257 tokens for a model of vocab_size 512"),
    ("eval-text", ["eval", "needle", "--checkpoint", "{ckpt}", "--text", "{root}/none.txt"], "--text: "),
    ("eval-text-not-utf8", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--text", "{junk}", "--out", "{root}/pn"],
     "--text {junk}: not UTF-8 text"),
    ("eval-text-empty", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--text", "{empty_text}", "--out",
                         "{root}/pn", "--quick", "--no-progress"],
     "--text {empty_text}: empty (no text in it)"),
    ("eval-mqar-seq-lens", ["eval", "mqar", "--checkpoint", "{ckpt}", "--seq-lens", "100000", "--out", "{root}/mq",
                            "--quick", "--no-progress"],
     "mqar cannot run on diff:ckpt: no MQAR cell fits: seq_lens (100000,) within max_seq_len=128"),
    ("eval-device", ["eval", "needle", "--checkpoint", "{ckpt}", "--device", "tpu"], "--device"),
    ("eval-max-seq-len", ["eval", "needle", "--checkpoint", "{ckpt}", "--max-seq-len", "0"],
     "--max-seq-len: '0' is not valid (must be in [1, 4194304])"),
    ("eval-max-seq-len-word", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--max-seq-len", "1k"],
     "--max-seq-len: '1k' is not valid (an integer is needed)"),
    ("eval-rope-theta", ["eval", "needle", "--checkpoint", "{ckpt}", "--rope-theta", "-1"],
     "--rope-theta: '-1' is not valid (must be greater than 0)"),
    ("eval-rope-theta-nan", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--rope-theta", "nan"],
     "--rope-theta: 'nan' is not valid (a finite number is needed)"),
    ("eval-max-seq-len-beyond-text", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--text", "{text}",
                                      "--max-seq-len", "4096", "--out", "{root}/pn", "--quick", "--no-progress"],
     "position-nll cannot run on diff:ckpt: "),
    ("eval-needle-depths", ["eval", "needle", "--checkpoint", "{ckpt}", "--depths", "0.5", "2"],
     "--depths: '2' is not valid (must be in [0.0, 1.0])"),
    ("eval-needle-samples", ["eval", "needle", "--checkpoint", "{ckpt}", "--samples", "0"],
     "--samples: '0' is not valid"),
    ("eval-ar-hit-batch", ["eval", "ar-hit", "--checkpoint", "{ckpt}", "--batch-size", "-1"], "--batch-size"),
    ("eval-ar-hit-seq-len", ["eval", "ar-hit", "--checkpoint", "{ckpt}", "--seq-len", "-1"],
     "--seq-len: '-1' is not valid (must be in [0, "),
    ("eval-quantization-bits", ["eval", "quantization", "--checkpoint", "{ckpt}", "--bits", "1"],
     "--bits: '1' is not valid (must be in [2, 24])"),
    ("eval-quantization-granularity", ["eval", "quantization", "--checkpoint", "{ckpt}", "--granularity", "tensor"],
     "invalid choice: 'tensor'"),
    ("eval-attention-noise-depths", ["eval", "attention-noise", "--checkpoint", "{ckpt}", "--depths", "1.5"],
     "--depths: '1.5' is not valid"),
    ("eval-outliers-tokens", ["eval", "outliers", "--checkpoint", "{ckpt}", "--tokens", "0"],
     "--tokens: '0' is not valid"),
    ("eval-attention-sink-windows", ["eval", "attention-sink", "--checkpoint", "{ckpt}", "--windows", "0"],
     "--windows: '0' is not valid"),
    ("eval-position-nll-windows", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--windows", "many"],
     "--windows: 'many' is not valid (an integer is needed)"),
    ("eval-icl-demos", ["eval", "icl", "--checkpoint", "{ckpt}", "--demos", "-2"], "--demos"),
    ("eval-icl-data", ["eval", "icl", "--checkpoint", "{ckpt}", "--data", "{root}/none.jsonl", "--tasks", "none"],
     "no such JSONL file"),
    ("eval-mqar-seed", ["eval", "mqar", "--checkpoint", "{ckpt}", "--seed", "-5"], "--seed"),
    ("eval-context-qa-data", ["eval", "context-qa", "--checkpoint", "{ckpt}", "--data", "{jsonl}"],
     "docs.jsonl:1: missing field 'context', 'question', 'answers'"),
    ("eval-needle-settings", ["eval", "needle", "--checkpoint", "{ckpt}", "--settings", "4:2", "x"],
     "--settings: 'x' is not valid (needle setting 'x' must look like N:R"),
    ("eval-needle-heatmap", ["eval", "needle", "--checkpoint", "{ckpt}", "--heatmap", "1:3"], "need 1 <= R <= N"),
    ("eval-quantization-needle-setting", ["eval", "quantization", "--checkpoint", "{ckpt}", "--needle-setting", "2"],
     "--needle-setting"),
    ("eval-icl-tasks", ["eval", "icl", "--checkpoint", "{ckpt}", "--tasks", "sentiment"],
     "unknown ICL task 'sentiment'"),
    ("eval-icl-tasks-classes", ["eval", "icl", "--checkpoint", "{ckpt}", "--tasks", "keywords-1"], "2 <= C <= 30"),
    ("eval-scaling-results", ["eval", "scaling", "--results", "{root}/none.json"], "--results: "),
    ("eval-scaling-results-junk", ["eval", "scaling", "--results", "{junk}", "--out", "{root}/scaling"], "error: "),
    ("eval-scaling-x", ["eval", "scaling", "--results", "{text}", "--x", "flops"], "invalid choice: 'flops'"),
    ("eval-scaling-windows", ["eval", "scaling", "--windows", "0"], "--windows"),
    ("eval-scaling-resamples", ["eval", "scaling", "--resamples", "50"], "--resamples"),
    ("eval-scaling-nothing", ["eval", "scaling", "--out", "{root}/scaling"], "nothing to fit"),
    # train
    ("train-config", ["train", "--config", "{root}/none.yaml"], "none.yaml"),
    ("train-config-binary", ["train", "--config", "{junk}"], "{junk}: not a YAML text file (not UTF-8"),
    ("train-config-directory", ["train", "--config", "{root}"], "config '{root}': a directory; give a YAML file"),
    ("train-config-empty", ["train", "--config", "{empty_config}"],
     "{empty_config}: an empty config; give at least a model"),
    ("train-config-no-model", ["train", "--config", "{no_model}"],
     "{no_model}: no model; set model (e.g. model: {{preset: tiny}}) or models"),
    ("train-dataset-meta", ["train", "--config", "tiny", "--model", "diff", "--set", "data.dataset={baddata}"],
     "{baddata}/meta.json: unreadable ("),
    ("train-set-nan", ["train", "--config", "tiny", "--set", "optim.lr=nan"],
     "optim.lr must be a finite number, got nan"),
    ("train-set-inf", ["train", "--config", "tiny", "--set", "optim.betas=[0.9, .inf]"],
     "optim.betas[1] must be a finite number, got inf"),
    ("train-set-model-lr-nan", ["train", "--config", "tiny", "--set", "models.diff.optim.lr=nan"],
     "models.diff.optim.lr must be a finite number, got nan"),
    ("train-set-init-std", ["train", "--config", "tiny", "--set", "models.diff.init_std=nan"],
     "models.diff.init_std must be a finite number, got nan"),
    ("train-set-rope-theta", ["train", "--config", "tiny", "--set", "model.rope_theta=-1"],
     "models.standard: rope_theta must be a positive finite number, got -1.0"),
    ("train-set-lambda-init", ["train", "--config", "tiny", "--set", "models.diff.lambda_init=1.5"],
     "models.diff: lambda_init must be a number in [0, 1)"),
    ("train-model", ["train", "--config", "tiny", "--model", "gpt"], "gpt"),
    ("train-set-syntax", ["train", "--config", "tiny", "--set", "run.steps"], "run.steps"),
    ("train-set-key", ["train", "--config", "tiny", "--set", "run.bogus=1"], "bogus"),
    ("train-set-value", ["train", "--config", "tiny", "--set", "data.batch_size=-4"],
     "error: --set data.batch_size=-4: data.batch_size must be positive"),  # the source is the --set, not tiny.yaml
    ("train-set-steps", ["train", "--config", "tiny", "--set", "run.log_every=2", "--set", "run.steps=0"],
     "error: --set run.steps=0: run.steps must be positive, got 0"),
    ("train-init-from", ["train", "--config", "tiny", "--init-from", "{root}/none"],
     "--init-from: {root}/none: not a checkpoint directory"),
    ("train-init-from-resume", ["train", "--config", "tiny", "--init-from", "{ckpt}", "--resume"], "give one of them"),
    ("train-init-from-model", ["train", "--config", "tiny", "--model", "diff", "--init-from", "{ckpt}"],
     "run.init_from: {ckpt} holds another model"),
    # compare
    ("compare-config", ["compare", "--config", "{root}/none.yaml"], "none.yaml"),
    ("compare-attention", ["compare", "--attention", "mamba", "--out", "{root}/cmp"], "mamba"),
    ("compare-steps", ["compare", "--steps", "0"], "--steps: '0' is not valid"),
    ("compare-budget", ["compare", "--budget", "flops"], "--budget: 'flops' is not valid (KIND=AMOUNT"),
    ("compare-seeds", ["compare", "--seeds", "-1"], "--seeds"),
    ("compare-out", ["compare", "--out", "{file}"], "--out"),
    ("compare-set", ["compare", "--set", "optim.bogus=1", "--out", "{root}/cmp"], "bogus"),
    ("compare-nproc", ["compare", "--nproc", "0"], "--nproc"),
    ("compare-lr-grid", ["compare", "--lr-grid", "1e-3,-2e-3"], "--lr-grid"),
    ("compare-retrieval-lr-grid", ["compare", "--retrieval-lr-grid", "fast"], "--retrieval-lr-grid"),
    ("train-set-seed", ["train", "--config", "tiny", "--set", "run.seed=-1"],
     "run.seed must be in [0, 2**63 - 1], got -1"),
    ("train-set-data-seed", ["train", "--config", "tiny", "--set", "run.data_seed=99999999999999999999"],
     "run.data_seed must be in [0, 2**63 - 1]"),
    ("compare-recipes", ["compare", "--recipes", "scaled-init,xavier"], "--recipes: 'scaled-init,xavier' is not valid"),
    ("compare-recipes-twice", ["compare", "--recipes", "plain-init,plain-init"], "each once"),
    ("compare-jobs", ["compare", "--jobs", "0"], "--jobs"),
    ("compare-retrieval-steps", ["compare", "--retrieval-steps", "-5"], "--retrieval-steps"),
    ("compare-jobs-and-nproc", ["compare", "--jobs", "2", "--nproc", "2", "--out", "{root}/cmp"],
     "--jobs 2 trains several single-process runs at once and --nproc 2"),
    ("compare-long-context-recipes", ["compare", "--config", "long-context", "--recipes", "plain-init", "--out",
                                      "{root}/cmp"], "takes neither --retrieval-lr-grid nor --recipes"),
    ("compare-pinned-recipe-field", ["compare", "--set", "models.diff.scale_residual_init=false", "--out",
                                     "{root}/cmp"],
     "models.diff.scale_residual_init=False disagrees with init recipe 'scaled-init'"),
    # bench attention
    ("bench-gpu", ["bench", "gpu", "--out", "{root}/gpu"], "needs a CUDA device"),
    ("bench-gpu-out", ["bench", "gpu", "--out", "{file}"], "--out"),
    ("bench-gpu-time-budget", ["bench", "gpu", "--out", "{root}/gpu", "--time-budget", "0"],
     "--time-budget: '0' is not valid (must be greater than 0)"),
    ("bench-attention-device", ["bench", "attention", "--device", "gpu"], "--device"),
    ("bench-attention-dtype", ["bench", "attention", "--dtype", "fp8"], "invalid choice: 'fp8'"),
    ("bench-attention-lengths", ["bench", "attention", "--lengths", "0"], "lengths must be positive"),
    ("bench-attention-heads", ["bench", "attention", "--heads", "3"], "heads must be even"),
    ("bench-attention-kv-heads", ["bench", "attention", "--kv-heads", "3"], "kv_heads must be even"),
    ("bench-attention-head-dim", ["bench", "attention", "--head-dim", "0"], "head_dim must be >= 1"),
    ("bench-attention-batch", ["bench", "attention", "--batch", "0"], "batch must be >= 1"),
    ("bench-attention-backends", ["bench", "attention", "--backends", "flash9"], "invalid choice: 'flash9'"),
    ("bench-attention-modes", ["bench", "attention", "--modes", "train"], "invalid choice: 'train'"),
    ("bench-attention-repeats", ["bench", "attention", "--repeats", "0"], "repeats must be >= 1"),
    ("bench-attention-warmup", ["bench", "attention", "--warmup", "-1"], "warmup must be >= 0"),
    ("bench-attention-memory", ["bench", "attention", "--memory-budget-gib", "-2"], "memory_budget_gib must be > 0"),
    ("bench-attention-threads", ["bench", "attention", "--threads", "0"], "threads must be >= 1"),
    ("bench-attention-gda-ratio", ["bench", "attention", "--gda-ratio", "3"],
     "gda_ratio=3 must divide the signal heads heads/2 = 8"),
    ("bench-attention-kinds", ["bench", "attention", "--kinds", "linear"], "invalid choice: 'linear'"),
    # bench model
    ("bench-model-preset", ["bench", "model", "--preset", "huge"], "invalid choice: 'huge'"),
    ("bench-model-length", ["bench", "model", "--length", "0"], "length must be >= 1"),
    ("bench-model-length-beyond-context", ["bench", "model", "--length", "100000"],
     "length 100,000 is beyond the context of preset 'tiny' (256 tokens, its max_seq_len)"),
    ("bench-model-decode-beyond-context", ["bench", "model", "--preset", "debug", "--decode-tokens", "1000"],
     "decode_tokens 1,000 is beyond the context of preset 'debug' (128 tokens"),  # length 128
    ("bench-model-memory", ["bench", "model", "--preset", "13.1b", "--length", "16"],
     "bench model --preset 13.1b --length 16 --batch 1 needs about "),
    ("bench-model-batch-memory", ["bench", "model", "--batch", "1000000"], "GiB on cpu"),
    ("bench-model-backend-decode", ["bench", "model", "--backend", "decode"], "backend 'decode' takes one query"),
    ("bench-model-batch", ["bench", "model", "--batch", "0"], "batch must be >= 1"),
    ("bench-train-models", ["bench", "train", "--models", "bogus"], "name it CONFIG:MODEL or CONFIG:MODEL@SIZE"),
    ("bench-train-size", ["bench", "train", "--models", "scaling:diff@huge"], "has no scaling size 'huge'"),
    ("bench-train-batches", ["bench", "train", "--batches", "0"], "batches must be positive sizes"),
    ("bench-train-steps", ["bench", "train", "--steps", "0"], "steps must be >= 1"),
    ("bench-train-repeats", ["bench", "train", "--repeats", "0"], "repeats must be >= 1"),
    ("bench-train-warmup", ["bench", "train", "--warmup", "-1"], "warmup must be >= 0"),
    ("bench-train-threads", ["bench", "train", "--threads", "0"], "threads must be >= 1"),
    ("bench-model-decode-tokens", ["bench", "model", "--decode-tokens", "1"], "decode_tokens must be >= 2"),
    ("bench-model-device", ["bench", "model", "--device", "gpu"], "--device"),
    ("bench-model-dtype", ["bench", "model", "--dtype", "int8"], "invalid choice: 'int8'"),
    ("bench-model-backend", ["bench", "model", "--backend", "magic"], "invalid choice: 'magic'"),
    *([("bench-model-backend-triton", ["bench", "model", "--backend", "triton"],
        "backend 'triton' (the fused kernel) needs a CUDA device, not 'cpu'")]
      if not torch.cuda.is_available() else []),
    ("bench-model-repeats", ["bench", "model", "--repeats", "0"], "repeats must be >= 1"),
    ("bench-model-warmup", ["bench", "model", "--warmup", "-1"], "warmup must be >= 0"),
    ("bench-model-architectures", ["bench", "model", "--architectures", "llama"], "invalid choice: 'llama'"),
    ("bench-model-gda-ratio", ["bench", "model", "--architectures", "gda", "--gda-ratio", "2"],
     "gda_ratio=2 must divide the 3 heads of preset 'tiny'"),
    ("bench-model-threads", ["bench", "model", "--threads", "0"], "threads must be >= 1"),
    # the parser itself
    ("no-command", [], "the following arguments are required: COMMAND"),
    ("unknown-command", ["fly"], "invalid choice: 'fly'"),
    ("unknown-option", ["info", "--colour"], "unrecognized arguments: --colour"),
]  # fmt: skip


def _fill(argv: list[str], files: dict[str, Path]) -> list[str]:
    return [a.format(**files) for a in argv]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line_and_status_2(argv, expected, files, capsys):
    code = main(_fill(argv, files))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert expected.format(**files) in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize("name, argv, why", [
    ("mqar", ["--seq-lens", "100000"], ""),
    ("icl", ["--demos", "1000"], "keywords-4: no number of demonstrations of (1000,) fits the model's context of 128"),
    ("icl", ["--robustness-demos", "1000"],
     "keywords-4: robustness_demos=1000 does not fit the model's context of 128"),
    ("context-qa", ["--max-new-tokens", "1000"], "sample.jsonl:1 (and 19 more lines): the prompt is"),
], ids=["mqar-too-long", "icl-no-demos-fit", "icl-robustness-does-not-fit", "context-qa-too-long"])
def test_an_evaluation_that_cannot_run_writes_nothing(name, argv, why, files, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", name, "--checkpoint", str(files["ckpt"]), "--out", str(out), "--quick", "--no-progress",
                 *_fill(argv, files)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {name} cannot run on ") and err[0].endswith("; nothing written")
    assert why in err[0]  # before: icl exited 0 with a report of no figure at all
    assert not out.exists()


def _leaf_parsers(parser=None, path=()):
    """(command path, parser) of every runnable subcommand, e.g. (("bench", "model"), parser)."""
    import argparse

    from diff_transformer.cli import build_parser

    parser = parser or build_parser()
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        yield path, parser
        return
    for name, sub in subparsers[0].choices.items():
        yield from _leaf_parsers(sub, (*path, name))


# Flags every evaluation shares: tried on needle. Free-text flags, where any string is a value.
EVAL_SHARED = {"--checkpoint", "--label", "--out", "--tokenizer", "--text", "--device", "--max-seq-len", "--rope-theta"}
FREE_TEXT = {"--prompt", "--text-field", "--label-field"}


def _is_number_flag(action) -> bool:
    return getattr(action.type, "__name__", "") in ("int", "float")


def test_every_command_and_option_that_takes_a_value_has_a_case():
    """Each subcommand appears in CASES, and so does each of its options that takes a value (the
    numeric option flags of the evaluations are covered by the test below, free text has no bad value)."""
    missing = []
    for path, parser in _leaf_parsers():
        here = [argv for _, argv, _ in CASES if tuple(argv[: len(path)]) == path]
        if not here:
            missing.append(" ".join(path))
        for action in parser._actions:
            if action.nargs == 0 or not action.option_strings or action.option_strings[0] in FREE_TEXT:
                continue
            flag = action.option_strings[-1]
            if path[0] == "eval" and ((path[1] != "needle" and flag in EVAL_SHARED) or _is_number_flag(action)):
                continue
            if not any(flag in argv for argv in here):
                missing.append(f"{' '.join(path)} {flag}")
    assert missing == []


@pytest.mark.slow  # every evaluation's options (3 s)
def test_every_numeric_evaluation_option_refuses_a_negative_value(files, capsys):
    """For every evaluation and every option of it that takes a number: -1 is one error line."""
    tried = 0
    for path, parser in _leaf_parsers():
        if path[0] != "eval" or path[1] == "scaling":
            continue
        for action in parser._actions:
            if action.option_strings and _is_number_flag(action):
                flag = action.option_strings[-1]
                assert main([*path, "--checkpoint", str(files["ckpt"]), flag, "-1"]) == 2, flag
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and err[0].startswith("error: ") and f"{flag}: '-1' is not valid" in err[0]
                tried += 1
    assert tried > 30


def test_debug_flag_and_environment_show_the_traceback(files, monkeypatch):
    from diff_transformer.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        main(["--debug", "info", str(files["damaged"])])
    monkeypatch.setenv("DIFF_TRANSFORMER_DEBUG", "1")
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        main(["info", str(files["damaged"])])


def test_an_unexpected_error_is_one_line_with_status_1(files, monkeypatch, capsys):
    from diff_transformer import model as model_module

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(model_module.LanguageModel, "from_pretrained", broken)
    assert main(["info", str(files["ckpt"])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: unexpected KeyError: 'a bug' (a bug? rerun with --debug for the traceback)"]


class _Writes:
    """A stderr that keeps each write call apart (as a pipe shared by several processes sees them)."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_an_error_line_is_one_write_so_that_the_ranks_lines_do_not_run_together(files, monkeypatch):
    for argv, status in ((["info", str(files["damaged"])], 2), (["train", "--steps", "0"], 2)):
        stderr = _Writes()
        monkeypatch.setattr(sys, "stderr", stderr)
        assert main(argv) == status
        errors = [call for call in stderr.calls if "error" in call]
        assert len(errors) == 1 and errors[0].startswith("error: ") and errors[0].endswith("\n"), stderr.calls


def test_a_good_command_still_runs(files, capsys):
    assert main(["generate", str(files["ckpt"]), "--max-new-tokens", "3", "--temperature", "0", "--top-p", "1"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # the console command in a new process (14 s)
@pytest.mark.parametrize(
    "argv, expected",
    [(["generate", "{damaged}", "--temperature", "0"], "truncated or corrupted safetensors file")],
    ids=["truncated-weights"],
)
def test_no_traceback_from_the_console_command(argv, expected, files):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    env.pop("DIFF_TRANSFORMER_DEBUG", None)
    done = subprocess.run([sys.executable, "-m", "diff_transformer", *_fill(argv, files)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ") and expected in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


# --- text that is not text, and paths that are not files (issue 43) ------------------------------------


@pytest.fixture(scope="module")
def not_text(tmp_path_factory) -> dict[str, Path]:
    """40,000 NUL bytes and a few words (the issue's file), a JSONL task with a NUL escaped in a
    text, a FIFO, and a Transformer checkpoint to convert."""
    root = tmp_path_factory.mktemp("not-text")
    (root / "nuls.txt").write_bytes(b"\x00" * 40_000 + b"a few words of text\n" * 3)
    (root / "task.jsonl").write_text('{"text": "a b", "label": "x"}\n{"text": "c\\u0000d", "label": "y"}\n')
    os.mkfifo(root / "fifo")
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257, attention="standard")).save_pretrained(
        root / "standard", ByteTokenizer())
    return {"root": root, "nuls": root / "nuls.txt", "task": root / "task.jsonl", "fifo": root / "fifo",
            "standard": root / "standard"}


NUL_TEXT = "binary data (a NUL byte at offset 0), not text; give UTF-8 text"
NOT_TEXT_CASES = [  # (case id, argv, the whole error line after "error: ")
    # issue 43: 40,000 NUL bytes and a few words scored as text, exit 0, a figure that means nothing
    ("eval-text-nul", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--text", "{nuls}", "--out", "{root}/out"],
     f"--text {{nuls}}: {NUL_TEXT}"),
    ("convert-text-nul", ["convert", "{standard}", "{root}/out", "--text", "{nuls}"], f"--text {{nuls}}: {NUL_TEXT}"),
    ("prepare-nul", ["prepare", "{nuls}", "--out", "{root}/out"], f"{{nuls}}: {NUL_TEXT}"),
    ("tokenizer-nul", ["tokenizer", "train", "--input", "{nuls}", "--out", "{root}/out.json"], f"{{nuls}}: {NUL_TEXT}"),
    ("icl-data-nul", ["eval", "icl", "--checkpoint", "{ckpt}", "--data", "{nuls}", "--out", "{root}/out", "--quick"],
     f"icl cannot run on diff:ckpt: {{nuls}}: {NUL_TEXT}; nothing written"),
    ("icl-data-escaped-nul", ["eval", "icl", "--checkpoint", "{ckpt}", "--data", "{task}", "--out", "{root}/out",
                              "--quick"],
     "icl cannot run on diff:ckpt: {task}:2: field 'text': binary data (a NUL character at byte 1), not text; give "
     "UTF-8 text; nothing written"),
    # issue 43: a FIFO named as input was "no such file or folder" (and --text's said "a directory")
    ("eval-text-fifo", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--text", "{fifo}", "--out", "{root}/out"],
     "diff-transformer eval position-nll: argument --text: '{fifo}' is not valid (a FIFO, not a file)"),
    ("convert-text-fifo", ["convert", "{standard}", "{root}/out", "--text", "{fifo}"],
     "diff-transformer convert: argument --text: '{fifo}' is not valid (a FIFO, not a file)"),
    ("prepare-fifo", ["prepare", "{fifo}", "--out", "{root}/out"],
     "diff-transformer prepare: argument INPUT: '{fifo}' is not valid (a FIFO, not a file or directory)"),
    ("tokenizer-fifo", ["tokenizer", "train", "--input", "{fifo}", "--out", "{root}/out.json"],
     "diff-transformer tokenizer train: argument --input: '{fifo}' is not valid (a FIFO, not a file or directory)"),
    ("icl-data-fifo", ["eval", "icl", "--checkpoint", "{ckpt}", "--data", "{fifo}", "--out", "{root}/out", "--quick"],
     "icl cannot run on diff:ckpt: {fifo}: a FIFO, not a file; nothing written"),
    ("eval-text-device", ["eval", "position-nll", "--checkpoint", "{ckpt}", "--text", "/dev/zero"],
     "diff-transformer eval position-nll: argument --text: '/dev/zero' is not valid (a character device, not a file)"),
    ("train-config-fifo", ["train", "--config", "{fifo}"],
     "config '{fifo}': a FIFO, not a file; give a YAML file or the name of a shipped config"),
    ("prepare-tokenizer-fifo", ["prepare", "{text}", "--out", "{root}/out", "--tokenizer", "{fifo}"],
     "tokenizer {fifo}: a FIFO, not a file (give 'bytes', a JSON file or a directory)"),
]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in NOT_TEXT_CASES], ids=[c[0] for c in NOT_TEXT_CASES])
def test_text_that_is_not_text_and_paths_that_are_not_files_are_refused_by_name(argv, expected, files, not_text,
                                                                                 capsys):
    """Wherever the commands read a text (prepare, tokenizer train, eval --text, convert --text, an
    ICL --data file): binary data is refused by the one check (user_text) naming the file and the
    offset, a FIFO or a device as what it is; one line, exit status 2, nothing written."""
    names = {**files, **not_text}
    assert main([a.format(**names) for a in argv] + (["--no-progress"] if argv[0] == "eval" else [])) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {expected.format(**names)}\n" and captured.out == ""
    assert sorted(p.name for p in not_text["root"].iterdir()) == ["fifo", "nuls.txt", "standard", "task.jsonl"]


def test_evaluation_texts_given_in_python_are_checked_too():
    from diff_transformer.evaluation import EvalText
    from diff_transformer.user_text import InputError

    with pytest.raises(InputError, match=r"^evaluation text 2: binary data \(a NUL character at byte 4\), not text"):
        EvalText(["fine", "some\x00thing"])
