"""``diff-transformer compare``: train several attention kinds side by side and report.

Every model of the comparison is trained by the same ``train`` entry point, in its own process
(a fresh interpreter, so that its peak memory is its own and no model inherits another's
state), with the same config: the same data order (run.data_seed), the same seeds and the same
token budget (run.steps × data.batch_size × data.seq_len). The output directory:

    DIR/report.md            the table (parameters, tokens, final validation loss ± std over
                             seeds, tokens/s, peak memory) beside the paper's figures
    DIR/metrics.json         everything in the report, and the loss curves
    DIR/loss.png             training and validation loss of every model on one figure
    DIR/config.yaml          the resolved config every run used
    DIR/<model>/             the final checkpoint of the model's first seed (from_pretrained loads
                             it; the tokenizer is inside)
    DIR/runs/<model>/seed-<s>/   logs of each run (metrics.jsonl, tensorboard/, summary.json);
                             the checkpoints of further seeds are in checkpoint/ there
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from ..config import ConfigError
from .config import TrainConfig
from .report import build_metrics, render_report, write_plots
from .state import find_checkpoint
from .trainer import SUMMARY_FILE, TrainingError, read_metrics

# An evaluation step run after training: given {model name: checkpoint directory} and the output
# directory, it returns Markdown sections that are appended to report.md.
Evaluation = Callable[[dict[str, Path], Path], list[str]]


class CompareInterrupted(RuntimeError):
    """A signal stopped the comparison; the interrupted run saved a checkpoint."""


def select_models(config: TrainConfig, attention: list[str] | None) -> list[str]:
    """Model names to train: those whose attention kind is listed (in config order), else the
    config's compare.models, else all of its models."""
    if attention:
        names = [name for name, entry in config.models.items() if entry.attention in attention]
        missing = [kind for kind in attention if not any(config.models[n].attention == kind for n in names)]
        if missing:
            raise ConfigError(
                f"--attention {','.join(missing)}: config {config.name!r} has no model of that kind "
                f"(its models: {', '.join(f'{n} ({e.attention})' for n, e in config.models.items())})"
            )
        return names
    return list(config.compare.models) or list(config.models)


def _run_paths(out_dir: Path, model: str, seed_index: int, seed: int) -> tuple[Path, Path]:
    """(log directory, checkpoint directory) of one run."""
    log_dir = out_dir / "runs" / model / f"seed-{seed}"
    checkpoint_dir = out_dir / model if seed_index == 0 else log_dir / "checkpoint"
    return log_dir, checkpoint_dir


def _train_command(config_file: Path, model: str, overrides: list[str], resume: bool, nproc: int) -> list[str]:
    command = [sys.executable, "-m"]
    if nproc > 1:
        command += ["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
    command += ["diff_transformer", "train", "--config", str(config_file), "--model", model]
    for item in overrides:
        command += ["--set", item]
    return command + (["--resume"] if resume else [])


def _run_child(command: list[str]) -> int:
    """Run one training process; SIGINT/SIGTERM to this process are passed on to it exactly once
    (it runs in its own session, so a terminal's Ctrl-C reaches only us), and it saves a checkpoint."""
    child = subprocess.Popen(command, start_new_session=True)
    received: list[int] = []

    def forward(signum, frame) -> None:
        if not received:
            received.append(signum)
            child.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        raise CompareInterrupted("interrupted: the running model saved a checkpoint; rerun the same command with --resume")
    return code


def compare(
    config: TrainConfig,
    out_dir: str | Path = "out/compare",
    *,
    models: list[str] | None = None,
    seeds: int | None = None,
    resume: bool = False,
    nproc: int = 1,
    evaluation: Evaluation | None = None,
    progress: bool = True,
) -> dict:
    """Train ``models`` (names in ``config``; default: :func:`select_models`) for ``seeds`` seeds
    each and write the report into ``out_dir``; returns the metrics (also DIR/metrics.json).

    With ``resume``, runs that finished are reused and interrupted ones continue from their
    checkpoint; without it, earlier runs of the same models in ``out_dir`` are replaced.
    """
    start = time.perf_counter()
    out_dir = Path(out_dir)
    names = models or select_models(config, None)
    for name in names:
        config.model(name)  # an unknown name is an error before anything starts
    n_seeds = seeds or config.compare.seeds
    seed_values = [config.run.seed + i for i in range(n_seeds)]
    out_dir.mkdir(parents=True, exist_ok=True)

    if config.data.dataset == "default":  # prepare the corpus once, here, before the runs start
        from ..data import default_dataset

        default_dataset(config.data.cache_dir, progress=progress)

    # The resolved config every run reads: the user's, with what compare decided.
    resolved = config.to_dict()
    resolved["compare"] = {"models": names, "seeds": n_seeds}
    resolved["run"]["progress"] = progress
    config_file = out_dir / "config.yaml"
    tmp = config_file.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(resolved, sort_keys=False))
    os.replace(tmp, config_file)

    runs: dict[str, list[dict]] = {name: [] for name in names}
    total = len(names) * n_seeds
    for seed_index, seed in enumerate(seed_values):
        for name in names:
            log_dir, checkpoint_dir = _run_paths(out_dir, name, seed_index, seed)
            done = _finished_summary(log_dir, checkpoint_dir, config.run.steps) if resume else None
            position = len([r for rs in runs.values() for r in rs]) + 1
            label = f"[{position}/{total}] {name} (seed {seed})"
            if done is None:
                continue_run = resume and find_checkpoint(checkpoint_dir) is not None
                if not continue_run:
                    _clear_run(log_dir, checkpoint_dir, label)
                print(f"{label}: {'resuming' if continue_run else 'training'} -> {checkpoint_dir}", file=sys.stderr, flush=True)
                overrides = [f"run.seed={seed}", f"run.out_dir={log_dir}", f"run.checkpoint_dir={checkpoint_dir}"]
                code = _run_child(_train_command(config_file, name, overrides, continue_run, nproc))
                done = _read_summary(log_dir)
                if done is None:
                    raise TrainingError(f"{label}: training failed (exit code {code}); see the messages above")
            else:
                print(f"{label}: already trained, reusing {checkpoint_dir}", file=sys.stderr)
            done["seed"] = seed
            done["metrics"] = read_metrics(log_dir / "metrics.jsonl")
            runs[name].append(done)

    checkpoints = {name: out_dir / name for name in names}
    metrics = build_metrics(config, runs, wall_seconds=time.perf_counter() - start, nproc=nproc)
    write_plots(metrics, out_dir)
    report = render_report(metrics)

    # The evaluation suite (the CLI passes diff_transformer.evaluation.report_sections) runs on
    # each model's final checkpoint; its Markdown sections are appended to the report.
    if evaluation is not None:
        report += "".join("\n" + section.rstrip() + "\n" for section in evaluation(checkpoints, out_dir))

    metrics["wall_seconds"] = time.perf_counter() - start
    _write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    _write_text(out_dir / "report.md", report)
    return metrics


def _finished_summary(log_dir: Path, checkpoint_dir: Path, steps: int) -> dict | None:
    summary = _read_summary(log_dir)
    if summary and summary["status"] == "completed" and summary["steps"] >= steps and find_checkpoint(checkpoint_dir):
        return summary
    return None


def _read_summary(log_dir: Path) -> dict | None:
    path = log_dir / SUMMARY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _clear_run(log_dir: Path, checkpoint_dir: Path, label: str) -> None:
    """Remove an earlier run of this model and seed (said aloud: nothing is replaced silently)."""
    for path in (log_dir, checkpoint_dir):
        if path.exists():
            print(f"{label}: replacing the earlier run in {path}", file=sys.stderr)
            shutil.rmtree(path)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

