"""Train Hugging Face's DiffLlama and Llama in our regime: is a DIFF − Transformer gap ours or the regime's?

    PYTHONPATH=src python scripts/hf_reference_check.py --config tiny --lr-grid 1e-3,4e-3 --seeds 3 --out out/hf-check
    PYTHONPATH=src python scripts/hf_reference_check.py --task retrieval --recipes scaled-init,plain-init \
--out out/hf-retrieval

transformers' ``DiffLlamaForCausalLM`` and ``LlamaForCausalLM``, an implementation independent of
ours, are built with the shapes of the config's first DIFF and first standard model (the configs
come from ``interop.hf.hf_config_dict``, which export uses; the parameter counts are checked) and
trained exactly as ours are trained; what is not shared is the model code.

``--task lm`` (the default): the language models, on the batches of our trainer (``DataPlan``),
through the trainer's step (``train.step``: its loss normalisation, AdamW parameter groups, warmup +
linear-decay schedule and gradient clipping) and validation loss (``trainer.evaluate``), fp32 on the CPU,
``torch.manual_seed(seed)`` before building each model. HF initialises every matrix N(0, init_std)
(``--recipes plain-init``, the default); ``--recipes scaled-init`` then divides o_proj and down_proj
by sqrt(2L), as ours initialises them by default.
Writes DIR/results.json (every run; per model and learning rate the final validation loss over
seeds; the difference at each model's best learning rate with Welch's 95% interval) and
DIR/results.md.

``--task retrieval``: the retrieval experiment's models (``experiments.retrieval``, the config's
``retrieval`` section), ours and HF's, trained on the same generated batches with the same recipe
and measured along training on the same held-out cells (``learning_curve``, the trainer's step with
the config's optimizer), run by the studies' runner (``--jobs``), under each init recipe:
``plain-init`` is HF's own initialisation, ``scaled-init`` rescales HF's o_proj and down_proj by
1/sqrt(2L) after it (what ours does). Writes DIR/retrieval.json and DIR/retrieval.md: per recipe and
point of the curve, DIFF − Transformer in our implementation next to DiffLlama − Llama in HF's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from diff_transformer.evaluation.stats import MeanStd, welch_difference
from diff_transformer.experiments import load_experiment
from diff_transformer.experiments.config import INIT_RECIPES, retrieval_examples_per_step
from diff_transformer.experiments.results import CurvePoint, to_json
from diff_transformer.experiments.retrieval import TASKS, learning_curve
from diff_transformer.experiments.runner import PoolJob, run_jobs
from diff_transformer.experiments.study import RunKey
from diff_transformer.interop.hf import hf_config_dict
from diff_transformer.loss import IGNORE_INDEX
from diff_transformer.model import LanguageModel
from diff_transformer.train.optim import WarmupLinearSchedule, build_optimizer
from diff_transformer.train.step import CPU, advance, clip_gradients, forward_backward
from diff_transformer.train.trainer import DataPlan, evaluate

HF_NAMES = {"diff": "DiffLlama", "standard": "Llama"}  # our attention kind -> the HF model trained for it


class HFAdapter(nn.Module):
    """An HF causal LM called as our LanguageModel is: ``model(inputs, targets, return_logits=...,
    reduction=...) -> (logits or None, loss or None)``, the loss F.cross_entropy over the logits."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None, *, return_logits: bool = True,
                reduction: str = "mean"):
        logits = self.hf(input_ids=inputs, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction=reduction)
        return (logits if return_logits else None), loss


def build_hf(model_config, seed: int) -> HFAdapter:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = hf_config_dict(model_config, eos_id=None)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return HFAdapter(AutoModelForCausalLM.from_config(hf_config))


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def batches_digest(batches) -> str:
    digest = hashlib.sha256()
    for inputs, targets in batches:
        digest.update(inputs.numpy().tobytes())
        digest.update(targets.numpy().tobytes())
    return digest.hexdigest()


def train_one(model_config, optim, plan: DataPlan, validation, steps: int, eval_every: int, seed: int, label: str,
              recipe: str = "plain-init") -> dict:
    """One HF model trained as our trainer trains ours, initialised by ``recipe``; the run's record."""
    model = build_hf(model_config, seed)
    if INIT_RECIPES[recipe]["scale_residual_init"]:
        scale_residual_writers(model, model_config.n_layers)
    optimizer = build_optimizer(model, optim, CPU.device)
    schedule = WarmupLinearSchedule(optimizer, optim, steps)
    seen = hashlib.sha256()  # every training batch this run read, in order
    record = {"status": "completed", "final_val_loss": None, "val_curve": {}}
    start = time.perf_counter()
    model.train()
    for step in range(1, steps + 1):
        batches = list(plan.micro_batches(step - 1))
        seen.update(batches_digest(batches).encode())
        loss_sum, n_targets = forward_backward(model, model, batches, CPU)
        grad_norm = clip_gradients(model, optim.grad_clip)
        loss = loss_sum / max(n_targets, 1)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            record["status"] = "diverged"
            print(f"{label}: step {step}: loss {loss} / gradient norm {grad_norm} is not finite: stopped", flush=True)
            break
        advance(optimizer, schedule)
        if step % eval_every == 0 or step == steps:
            record["final_val_loss"] = record["val_curve"][step] = evaluate(model, validation, CPU, nullcontext())
            print(f"{label}: step {step}/{steps} train {loss:.4f} val {record['final_val_loss']:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    record.update(train_batches_sha256=seen.hexdigest(), seconds=time.perf_counter() - start)
    return record


def pick_models(config) -> dict[str, str]:
    """{"diff": the first DIFF entry, "standard": the first standard one} among the compared models."""
    names = config.compare.models or list(config.train.models)
    picked = {kind: next((n for n in names if config.attention(n) == kind), None) for kind in HF_NAMES}
    missing = [kind for kind, name in picked.items() if name is None]
    if missing:
        sys.exit(f"config {config.name!r} has no {' or '.join(missing)} model among {', '.join(names)}")
    return picked


def parameter_counts(config, picked: dict[str, str]) -> dict[str, dict[str, int]]:
    """Ours vs HF's per kind; Llama must equal ours, DiffLlama lacks only the head-norm weights (2d a layer)."""
    counts = {}
    for kind, name in picked.items():
        model_config = config.train.model(name).model_config()
        ours = LanguageModel(model_config, device="meta").num_parameters()
        hf = count(build_hf(model_config, 0))
        head_norm = model_config.n_layers * 2 * model_config.head_dim if kind == "diff" else 0
        if hf != ours - head_norm:
            sys.exit(f"{HF_NAMES[kind]} has {hf:,} parameters, ours {ours:,}: expected a difference of {head_norm}")
        counts[HF_NAMES[kind]] = {"hf": hf, "ours": ours, "ours_model": name, "ours_minus_hf": ours - hf}
    return counts


def markdown(results: dict) -> str:
    lines = [f"# HF reference check: DiffLlama vs Llama on `{results['config']}`, {results['recipe']}", "",
             f"{results['steps']} steps, seeds {results['seeds']}, the batches of our trainer "
             f"(sha256 {results['train_batches_sha256'][:12]}), fp32 CPU. Final validation loss (nats/token), "
             "mean ± std over seeds; **bold** = the model's best learning rate.", "",
             "| model | parameters (ours) | lr | final val loss | diverged |", "|---|---|---|---|---|"]
    for name, model in results["models"].items():
        params = results["parameters"][name]
        for lr, cell in model["by_lr"].items():
            s = cell["final_val_loss"]
            loss = "—" if s["mean"] is None else f"{s['mean']:.4f}" + (
                f" ± {s['std']:.4f}" if s["std"] is not None else "")
            if float(lr) == model["best_lr"]:
                loss = f"**{loss}**"
            lines.append(f"| {name} | {params['hf']:,} ({params['ours']:,}) | {lr} | {loss} | {cell['diverged']} |")
    d = results["difference"]
    if d is not None:
        interval = "" if d["low"] is None else f", 95% Welch interval [{d['low']:+.4f}, {d['high']:+.4f}]"
        lines += ["", f"DiffLlama − Llama, each at its best lr: {d['delta']:+.4f}{interval}."]
    return "\n".join(lines) + "\n"


def scale_residual_writers(model: nn.Module, n_layers: int) -> None:
    """scaled-init on an HF model: o_proj and down_proj (which write into the residual stream) from
    N(0, std) to N(0, std / sqrt(2 L)), as ours initialises them."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.mul_(1 / math.sqrt(2 * n_layers))


@dataclass
class ReferenceRun:
    """One retrieval model of the check: which one, and its learning curve."""

    recipe: str
    seed: int
    impl: str  # "ours" or "hf"
    kind: str  # our attention kind ("diff", "standard")
    model: str  # how the tables name it
    lr: float
    parameters: int
    curve: list[CurvePoint]
    curve_area: dict[str, float]
    train_seconds: float

    @classmethod
    def from_dict(cls, data: dict) -> "ReferenceRun":
        return cls(**{**data, "curve": [CurvePoint(**p) for p in data["curve"]]})


def retrieval_unit(config, recipe: str, seed: int, impl: str, kind: str, lr: float) -> ReferenceRun:
    """One retrieval model trained (ours or HF's, of attention ``kind``), with its learning curve."""
    settings = config.retrieval
    model_config = settings.model_config(kind, **INIT_RECIPES[recipe])
    if impl == "ours":
        torch.manual_seed(seed)
        model = LanguageModel(model_config)
    else:
        model = build_hf(model_config, seed)
        if INIT_RECIPES[recipe]["scale_residual_init"]:
            scale_residual_writers(model, model_config.n_layers)
    trained = learning_curve(model, settings, config.retrieval_optim(lr))
    name = HF_NAMES[kind] if impl == "hf" else {"diff": "DIFF", "standard": "Transformer"}[kind]
    return ReferenceRun(recipe, seed, impl, kind, name, lr, count(model), trained.curve, trained.curve_area,
                        trained.train_seconds)


def retrieval_check(config, picked: dict[str, str], recipes: list[str], grid: list[float] | None, seeds: list[int],
                    out: Path, jobs: int = 1) -> dict:
    """The retrieval models of both implementations, every recipe, lr and seed; see the module docstring."""
    settings = config.retrieval
    units = [(recipe, seed, impl, kind, lr) for recipe in recipes for seed in seeds for impl in ("ours", "hf")
             for kind in HF_NAMES
             for lr in (grid or [config.lr_for(picked[kind], recipe, "retrieval")])]
    pool = [PoolJob(RunKey(f"{impl}-{kind}", seed, lr, recipe), f"{recipe} {impl} {kind} lr {lr:g} seed {seed}",
                    out / "runs" / recipe / impl / kind / f"lr-{lr:g}" / f"seed-{seed}.json", retrieval_unit,
                    (config, recipe, seed, impl, kind, lr), ReferenceRun.from_dict)
            for recipe, seed, impl, kind, lr in units]

    def describe(job: PoolJob, run: ReferenceRun) -> str:
        return (f"{job.label}: " + ", ".join(f"{t} {run.curve[-1].mean_accuracy[t]:.3f}" for t in TASKS)
                + f" ({run.train_seconds:.0f} s)")

    runs = [to_json(run) for run in run_jobs(pool, at_once=jobs, describe=describe).values()]

    def final(run: dict) -> float:
        return statistics.fmean(run["curve"][-1]["mean_accuracy"].values())

    def difference(ours: list[float], base: list[float]) -> dict:
        return to_json(welch_difference(ours, base))

    table = {}
    for recipe in recipes:
        for impl in ("ours", "hf"):
            chosen = {}
            for kind in HF_NAMES:
                mine = [r for r in runs if (r["recipe"], r["impl"], r["kind"]) == (recipe, impl, kind)]
                lrs = dict.fromkeys(r["lr"] for r in mine)
                best = max(lrs, key=lambda lr: statistics.fmean(final(r) for r in mine if r["lr"] == lr))
                chosen[kind] = [r for r in mine if r["lr"] == best]
            steps = [p["step"] for p in chosen["diff"][0]["curve"]]
            table[f"{recipe}/{impl}"] = {
                "best_lr": {kind: rs[0]["lr"] for kind, rs in chosen.items()},
                "steps": steps,
                "accuracy": {task: {kind: [[r["curve"][i]["mean_accuracy"][task] for r in rs]
                                           for i in range(len(steps))]
                                    for kind, rs in chosen.items()} for task in TASKS},
                "difference": {task: [difference([r["curve"][i]["mean_accuracy"][task] for r in chosen["diff"]],
                                                 [r["curve"][i]["mean_accuracy"][task] for r in chosen["standard"]])
                                      for i in range(len(steps))] for task in TASKS},
                "curve_area_difference": {task: difference([r["curve_area"][task] for r in chosen["diff"]],
                                                           [r["curve_area"][task] for r in chosen["standard"]])
                                          for task in TASKS},
            }
    results = {"config": config.name, "settings": {"steps": settings.steps, "batch_size": settings.batch_size,
                                                   "length": settings.length, "d_model": settings.d_model,
                                                   "n_layers": settings.n_layers, "n_heads": settings.n_heads},
               "recipes": recipes, "seeds": seeds, "lr_grid": grid, "table": table, "runs": runs}
    out.mkdir(parents=True, exist_ok=True)
    (out / "retrieval.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "retrieval.md").write_text(retrieval_markdown(results))
    print(retrieval_markdown(results), flush=True)
    return results


def retrieval_markdown(results: dict) -> str:
    settings = results["settings"]
    per_step = retrieval_examples_per_step(settings["batch_size"])

    def cell(values: list[float]) -> str:
        return f"{statistics.fmean(values):.3f}"

    def interval(d: dict) -> str:
        return f"{d['delta']:+.3f}" + ("" if d["low"] is None else f" [{d['low']:+.3f}, {d['high']:+.3f}]")

    lines = [f"# HF reference check: the retrieval experiment of `{results['config']}`", "",
             f"{settings['n_layers']} layers, d_model {settings['d_model']}, DIFF {settings['n_heads']} head(s) "
             "against "
             f"{2 * settings['n_heads']} standard; {settings['steps']} steps × {settings['batch_size']} examples of "
             f"{settings['length']} tokens; seeds {results['seeds']}; each model at its best lr "
             "(final mean accuracy). Accuracy: mean over the difficulty cells; differences with Welch's 95% "
             "interval.", ""]
    for recipe in results["recipes"]:
        ours, hf = results["table"][f"{recipe}/ours"], results["table"][f"{recipe}/hf"]
        lines += [f"## {recipe}", "",
                  f"Best lrs: ours Transformer {ours['best_lr']['standard']:g}, DIFF {ours['best_lr']['diff']:g}; "
                  f"HF Llama {hf['best_lr']['standard']:g}, DiffLlama {hf['best_lr']['diff']:g}.", ""]
        for task in TASKS:
            lines += [f"| {task} examples seen | ours: Transformer | DIFF | DIFF − Transformer | HF: Llama | "
                      "DiffLlama | DiffLlama − Llama |", "|---:|---:|---:|---:|---:|---:|---:|"]
            for i, step in enumerate(ours["steps"]):
                lines.append(f"| {step * per_step[task]:,} | {cell(ours['accuracy'][task]['standard'][i])} | "
                             f"{cell(ours['accuracy'][task]['diff'][i])} | {interval(ours['difference'][task][i])} | "
                             f"{cell(hf['accuracy'][task]['standard'][i])} | {cell(hf['accuracy'][task]['diff'][i])} | "
                             f"{interval(hf['difference'][task][i])} |")
            lines += [f"| mean over training | | | {interval(ours['curve_area_difference'][task])} | | | "
                      f"{interval(hf['curve_area_difference'][task])} |", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--config", default="tiny", help="a shipped config name or a YAML path (default: tiny)")
    parser.add_argument("--lr-grid", help="peak learning rates, comma-separated, e.g. 1e-3,4e-3; min_lr keeps its "
                        "ratio (default: the config's compare.lr_grid, else each model's own lr)")
    parser.add_argument("--seeds", type=int,
                        help="seeds run.seed, run.seed + 1, ... (default: the config's compare.seeds)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the config's run.steps)")
    parser.add_argument("--out", type=Path, default=Path("out/hf-check"),
                        help="output directory (default: out/hf-check)")
    parser.add_argument("--task", choices=("lm", "retrieval"), default="lm",
                        help="lm: the language models (default); retrieval: the retrieval experiment's models")
    parser.add_argument("--recipes", help="init recipes, comma-separated (retrieval; default: the config's "
                        "compare.recipes, else scaled-init), or one (lm; default: plain-init, HF's own)")
    parser.add_argument("--jobs", type=int, default=1, help="retrieval: runs trained at the same time (default 1)")
    args = parser.parse_args(argv)

    key = "retrieval.steps" if args.task == "retrieval" else "run.steps"
    config = load_experiment(args.config, [f"{key}={args.steps}"] if args.steps else [])
    picked = pick_models(config)
    seeds = [config.train.run.seed + i for i in range(args.seeds or config.compare.seeds)]
    if args.task == "retrieval":
        recipes = args.recipes.split(",") if args.recipes else (config.compare.recipes or ["scaled-init"])
        unknown = [r for r in recipes if r not in INIT_RECIPES]
        if unknown:
            sys.exit(f"--recipes: no init recipe {unknown[0]!r}; choose from {', '.join(INIT_RECIPES)}")
        grid = [float(v) for v in args.lr_grid.split(",")] if args.lr_grid else (config.retrieval.lr_grid or None)
        return retrieval_check(config, picked, recipes, grid, seeds, args.out, args.jobs)
    grid = [float(v) for v in args.lr_grid.split(",")] if args.lr_grid else (config.compare.lr_grid or [None])
    recipe = args.recipes or "plain-init"  # HF's own initialisation
    if recipe not in INIT_RECIPES:
        sys.exit(f"--recipes: --task lm takes one init recipe ({', '.join(INIT_RECIPES)}), got {recipe!r}")
    train = config.train
    steps, model_configs = train.run.steps, {kind: train.model(name).model_config() for kind, name in picked.items()}
    seq_len = train.data.seq_len or model_configs["diff"].max_seq_len
    plan = DataPlan(train, seq_len, CPU)
    validation = plan.validation_batches()
    params = parameter_counts(config, picked)
    for name, p in params.items():
        print(f"{name}: {p['hf']:,} parameters; ours ({p['ours_model']}): {p['ours']:,}", flush=True)

    runs, total = [], len(seeds) * len(grid) * len(picked)
    for seed in seeds:
        for lr in grid:
            for kind, name in picked.items():
                optim = train.optim_for(name, lr)
                label = f"[{len(runs) + 1}/{total}] {HF_NAMES[kind]} lr {optim.lr:g} seed {seed}"
                run = train_one(model_configs[kind], optim, plan, validation, steps, train.run.eval_every, seed, label,
                                recipe)
                runs.append({"model": HF_NAMES[kind], "ours": name, "lr": optim.lr, "seed": seed, **run})

    models = {}
    for name in HF_NAMES.values():
        by_lr = {}
        for lr in dict.fromkeys(r["lr"] for r in runs if r["model"] == name):
            done = [r["final_val_loss"] for r in runs
                    if r["model"] == name and r["lr"] == lr and r["status"] == "completed"]
            by_lr[f"{lr:g}"] = {"final_val_loss": to_json(MeanStd.of(done)), "diverged": len(seeds) - len(done)}
        finished = {lr: cell["final_val_loss"]["mean"] for lr, cell in by_lr.items() if cell["diverged"] == 0}
        best = min(finished, key=finished.get) if finished else None
        models[name] = {"by_lr": by_lr, "best_lr": None if best is None else float(best),
                        "final_val_loss": by_lr[best]["final_val_loss"] if best else None}
    both = all(m["final_val_loss"] for m in models.values())
    results = {
        "config": config.name, "recipe": recipe, "steps": steps, "seq_len": seq_len,
        "batch_size": train.data.batch_size,
        "seeds": seeds, "lr_grid": list(dict.fromkeys(r["lr"] for r in runs)),
        "hf_configs": {HF_NAMES[k]: hf_config_dict(c, eos_id=None) for k, c in model_configs.items()},
        "parameters": params,
        "train_batches_sha256": runs[0]["train_batches_sha256"], "validation_sha256": batches_digest(validation),
        "same_batches": len({r["train_batches_sha256"] for r in runs}) == 1,
        "models": models,
        "difference": to_json(welch_difference(models["DiffLlama"]["final_val_loss"]["per_seed"],
                                               models["Llama"]["final_val_loss"]["per_seed"])) if both else None,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(results))
    print(markdown(results), flush=True)
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}", flush=True)
    return results


if __name__ == "__main__":
    main()
