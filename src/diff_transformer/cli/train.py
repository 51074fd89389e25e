"""diff-transformer train | compare: train one model, or several side by side with a report."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from functools import partial

from ..config import ATTENTION_KINDS
from . import args as types


def config_help() -> str:
    """--config's help: every config the package ships (its configs folder), by name."""
    from ..train.config import shipped_configs

    return f"a YAML config file, or the name of a shipped one ({', '.join(shipped_configs())}); default: tiny"


SET_HELP = (
    "override a config value, e.g. --set optim.lr=1e-3 --set run.steps=100 (repeatable; values are YAML). "
    "An optim field set so applies to every model, replacing a model's own value; "
    "--set models.NAME.optim.lr=... sets one model's"
)
# Exit statuses of train and compare, as shells and schedulers read them.
INTERRUPTED = ("130 / 143 / 129 stopped by SIGINT / SIGTERM / SIGHUP after saving a checkpoint: rerun the same "
               "command with --resume to continue exactly where it stopped.")
TRAIN_EXIT_STATUSES = ("Exit status: 0 done (or paused at run.stop_at_step, or --resume found the run finished); "
                       "1 the loss diverged; 2 an error "
                       f"(one 'error:' line); {INTERRUPTED}")
COMPARE_EXIT_STATUSES = f"Exit status: 0 done; 2 an error (one 'error:' line); {INTERRUPTED}"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train one model of a config (one CPU/GPU, or every process under torchrun)",
        description="Train one model of a config. Runs unchanged under "
        "`torchrun --nproc_per_node K -m diff_transformer train ...` (DDP, or FSDP2 with --set run.parallel=fsdp). "
        "Writes metrics.jsonl, tensorboard/, summary.json and checkpoint/ into run.out_dir; while it runs, "
        "run.out_dir/.lock names its pid, and a second run on the same directory is refused. "
        "SIGINT, SIGTERM and SIGHUP save a checkpoint before exiting; --resume continues from it exactly. "
        "--init-from starts a new run from another checkpoint's weights, e.g. to extend its context: "
        "--init-from RUN/checkpoint --set model.max_seq_len=1024 --set model.rope_theta=226000 "
        "--set data.seq_len=1024.",
        epilog=TRAIN_EXIT_STATUSES,
    )
    p.add_argument("--config", default="tiny", help=config_help())
    p.add_argument("--model", help="which model of the config to train (needed when it defines several)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    p.add_argument("--resume", action="store_true",
                   help="continue the run from the checkpoint in run.checkpoint_dir, with the settings it was started "
                   "with: one that changes the numbers (the model, data, optim values, seeds, precision) and "
                   "differs is refused by name; logging, evaluation, paths, device and backend may change. "
                   "An explicit --set "
                   "run.steps=N larger than the run's lengthens it: the learning-rate schedule is recomputed for N "
                   "steps (a note gives the rate before and after). A finished run's --resume says so, exits 0 and "
                   "writes nothing (docs/training.md, Resume)")
    p.add_argument("--init-from", metavar="CHECKPOINT", type=types.checkpoint_dir,
                   help="start a new run from this checkpoint's weights (a fresh optimizer, schedule and step count; "
                   "sets run.init_from). The model must be the checkpoint's but for model.max_seq_len and "
                   "model.rope_theta; data, optim and run settings are free. Not with --resume")
    p.add_argument("--quiet", action="store_true",
                   help="no summary line when the run completes (errors and notes still print; compare passes it "
                   "to its runs where it prints its own line for each)")
    p.set_defaults(run=run_train)

    c = subparsers.add_parser(
        "compare",
        help="train several attention kinds side by side and write a report (the main job)",
        description="Train each model with the same data order, seeds and token budget, then write "
        "DIR/report.md (parameters, tokens, final validation loss ± std over seeds, tokens/s, peak memory, "
        "beside the paper's figures), DIR/metrics.json, DIR/loss.png, and each model's final checkpoint in "
        "DIR/<model>/ (at each model's best learning rate when --lr-grid gives several); then the retrieval "
        "experiment (small models trained on generated multi-needle and MQAR tasks: accuracy by difficulty, "
        "attention to the answer); then the grounded experiment (small models that learn facts, then answer from "
        "documents that agree with them, contradict them or lack them: faithful accuracy, prior override, "
        "fabrication, abstention and the lookback ratio; the grounded section); then the evaluations of "
        "compare.evaluations on every seed's model (JSON and "
        "plots in DIR/eval/). The report opens with a table of the paper's claims: DIFF minus the Transformer, "
        "95% interval over seeds, and a verdict. Default: the tiny config (3 seeds; the Transformer, DIFF and "
        "DIFF V2). One comparison at a time writes into DIR (DIR/.lock names its pid), and a DIR that holds a "
        "study is refused unless --resume continues it (the same study) or --overwrite replaces it. "
        "A config with a long_context section (--config long-context) runs the long-context experiment instead: "
        "the models trained short, each seed extended (run.init_from) to a longer context and a larger RoPE θ, "
        "cumulative NLL by position and retrieval by length before and after (docs/training.md, "
        "\"Extending the context\"). A config with a convert section (--config convert) runs the conversion study: "
        "a Transformer (trained here for run.steps, which --steps sets, or convert.source) converted to DIFF, then "
        "fine-tuned beside the Transformer trained on; the tokens each needs to recover the source's loss and where "
        "it ends against the Transformer (docs/training.md, \"From a pretrained Transformer\"). A config with a "
        "pretrained section (--config pretrained) trains nothing: it runs compare.evaluations on the checkpoints "
        "pretrained.models names (trained here, converted, or imported with import-hf), each labelled DIFF family "
        "or Transformer, on the same text, and reports every effect as DIFF family − Transformer with its 95% "
        "interval over windows (docs/pretrained-study.md); it takes --set, --out, --resume and --jobs.",
        epilog=COMPARE_EXIT_STATUSES,
    )
    c.add_argument("--config", default="tiny", help=config_help())
    c.add_argument(
        "--attention",
        help=f"comma-separated attention kinds ({','.join(ATTENTION_KINDS)}) or "
        "model names (standard-wide) to train: the config's models of these kinds (for a kind that compare.models "
        "names, only its models there) and the models named; default: the config's compare.models",
    )
    c.add_argument("--steps", type=types.positive_int,
                   help="optimizer steps per model (overrides run.steps; a run.budget of the config is dropped: the "
                   "length is in steps)")
    c.add_argument("--budget", type=types.budget, metavar="KIND=AMOUNT",
                   help="train each model until it has spent AMOUNT of KIND instead of run.steps: tokens, flops "
                   "(training FLOPs by the formula of diff_transformer.flops: each model its own number of steps) "
                   "or seconds (of training steps on this machine; the learning-rate decay runs over them); sets "
                   "run.budget. The report gives the verdicts at equal tokens, FLOPs and (on a quiet machine) time "
                   "(docs/training.md, \"Budgets\")")
    c.add_argument("--seeds", type=types.positive_int, help="seeds per model (overrides compare.seeds)")
    c.add_argument("--out", default="out/compare", type=types.output_dir,
                   help="output directory (default: out/compare)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    c.add_argument("--resume", action="store_true",
                   help="continue the study in --out: its finished runs reused, interrupted ones continued from their "
                   "checkpoint. Only the same study: its settings (DIR/config.yaml, with the command line's models, "
                   "seeds, learning rates, recipes, retrieval) compared field by field, one that changes the runs "
                   "and differs refused by name; logging, evaluation, paths, device, backend and --jobs may change")
    c.add_argument("--overwrite", action="store_true",
                   help="replace the study in --out as a whole: it is moved aside (.DIR.replaced beside it) and "
                   "deleted once this one completes; refused if DIR holds files no study writes. Without --resume "
                   "or --overwrite, a DIR holding a study is refused")
    c.add_argument("--nproc", type=types.positive_int, default=1, help="processes per model run (torchrun; default 1)")
    c.add_argument("--lr-grid", type=types.positive_float_list, metavar="LR,LR,...",
                   help="re-run the learning-rate sweep: train every model at each peak lr (min_lr keeps its ratio), "
                   "report each at its own best; default: the config's compare.lr_grid, else each model's own lr")
    c.add_argument("--retrieval-lr-grid", type=types.positive_float_list, metavar="LR,LR,...",
                   help="the same for the retrieval and the grounded experiments (default: retrieval.lr_grid, else "
                   "each model's own lr there: retrieval.lr_by_model, grounded.lr_by_model)")
    c.add_argument("--recipes", type=types.init_recipes, metavar="RECIPE,...",
                   help="the init recipes every model is trained under, in every experiment (scaled-init: o_proj and "
                   "down_proj at init_std/sqrt(2 layers), the authors'; plain-init: every matrix N(0, init_std), "
                   "transformers'); each model is reported at its best (recipe, lr) and the report gives the "
                   "difference under each recipe; default: compare.recipes (and compare.lm_recipes for language "
                   "modelling, grounded.recipes for the grounded experiment)")
    c.add_argument("--retrieval-steps", type=types.positive_int, metavar="N",
                   help="training steps of each retrieval model (overrides retrieval.steps; the learning curve keeps "
                   "its fractions of them)")
    c.add_argument("--jobs", type=types.positive_int,
                   help="runs trained at the same time, each with cores / jobs CPU threads (default: compare.jobs)")
    c.add_argument("--no-retrieval", action="store_true", help="skip the retrieval experiment")
    c.add_argument("--no-grounded", action="store_true", help="skip the grounded (contextual hallucination) experiment")
    c.add_argument("--no-eval", action="store_true", help="skip the evaluation suite after training")
    c.add_argument("--quick-eval", action="store_true", help="run the evaluation suite on a smoke-test budget")
    c.set_defaults(run=run_compare)


def run_train(args: argparse.Namespace) -> int:
    from ..experiments import load_experiment
    from ..train import train
    from ..train.trainer import STUDY_RUN_ENV

    if args.init_from and args.resume:
        raise types.UsageError("--init-from starts a new run from a checkpoint's weights and --resume continues "
                               "this run from its own checkpoint: give one of them")
    overrides = list(args.overrides)
    if args.init_from:  # YAML-quoted: a path is a string whatever it looks like
        overrides.append(f"run.init_from={json.dumps(args.init_from)}")
    experiment = load_experiment(args.config, overrides)  # the whole file checked, its trainer's part trained
    if experiment.pretrained.enabled:
        raise types.UsageError(f"config {experiment.name!r} names pretrained checkpoints to evaluate, not a model to "
                               f"train: run diff-transformer compare --config {args.config}")
    config = experiment.train
    # An explicit --set run.steps=N (or run.budget...) may lengthen a resumed run; a length that only the
    # config file changed is a difference like any other.
    lengthen = any(item.partition("=")[0].strip() in ("run.steps", "run.budget", "run.budget.amount")
                   for item in args.overrides)
    result = train(config, args.model, resume=args.resume, lengthen=lengthen)
    code = {"completed": 0, "paused": 0, "finished": 0, "diverged": 1}.get(result.status)
    if result.status == "interrupted":  # 128 + the signal, as a shell reports a process it stopped
        code = 128 + signal.Signals[result.stopped_by or "SIGTERM"].value
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 speaks for all
        return code
    if result.status in ("diverged", "finished"):  # the trainer said why
        return code
    if result.status in ("interrupted", "paused"):  # a checkpoint was saved: --resume continues
        if result.status == "paused" or not os.environ.get(STUDY_RUN_ENV):  # a study's stop: the study's line
            print(result.message, file=sys.stderr)
        return code
    if args.quiet:
        return 0
    val = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "-"
    print(
        f"{result.model}: {result.steps} steps, {result.tokens:,} tokens, final validation loss {val}, "
        f"{result.tokens_per_s:,.0f} tokens/s; checkpoint {result.checkpoint}",
        file=sys.stderr,
    )
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from ..evaluation import run_suite
    from ..experiments import StudyInterrupted, compare, load_experiment, select_models

    overrides = list(args.overrides)
    flags = {}  # an override a flag became -> the flag as typed, for a refusal to quote what the user gave
    if args.steps is not None and args.budget is not None:
        raise types.UsageError("--steps sets each run's length in steps and --budget in tokens, FLOPs or seconds: "
                               "give one of them")
    if args.steps is not None:
        overrides += [f"run.steps={args.steps}", "run.budget=null"]  # the length in steps, whatever the file says
        flags[overrides[-2]] = f"--steps {args.steps}"
    if args.budget is not None:
        overrides.append(f"run.budget={json.dumps(args.budget)}")
        flags[overrides[-1]] = f"--budget {args.budget['kind']}={args.budget['amount']:g}"
    if args.retrieval_steps is not None:
        overrides.append(f"retrieval.steps={args.retrieval_steps}")
        flags[overrides[-1]] = f"--retrieval-steps {args.retrieval_steps}"
    if _changes_the_budget(args) and not any(item.startswith("compare.budget_note=") for item in overrides):
        overrides.append("compare.budget_note=''")  # the config's note describes its own budget, not this run's
    try:
        config = load_experiment(args.config, overrides)
    except ValueError as exc:  # an override a flag became is refused in the flag's words
        quoted = next((item for item in flags if str(exc).startswith(f"--set {item}:")), None)
        if quoted is None:
            raise
        raise type(exc)(flags[quoted] + str(exc)[len(f"--set {quoted}"):]) from None
    if config.pretrained.enabled:  # what compare() cannot see: the flags that became overrides, the evaluation's
        given = [flag for flag, value in (("--steps", args.steps), ("--retrieval-steps", args.retrieval_steps),
                                          ("--no-eval", args.no_eval), ("--quick-eval", args.quick_eval)) if value]
        if given:
            raise types.UsageError(f"config {config.name!r} runs the pretrained-models study, which trains nothing "
                                   f"and takes no {', '.join(given)}: its work is compare.evaluations, their budgets "
                                   "compare.evaluation_options (--set compare.evaluation_options.NAME.OPTION=VALUE)")
    kinds = [k.strip() for k in args.attention.split(",") if k.strip()] if args.attention else None
    models = select_models(config, kinds)
    evaluation = None
    if not args.no_eval and config.compare.evaluations:
        evaluation = partial(run_suite, quick=args.quick_eval, evaluations=config.compare.evaluations,
                             options=None if args.quick_eval else config.compare.evaluation_options,
                             overwrite=True)  # OUT/eval is the comparison's own: a rerun replaces its results
    try:
        metrics = compare(
            config, args.out, models=models, seeds=args.seeds, lr_grid=args.lr_grid,
            retrieval_lr_grid=args.retrieval_lr_grid, recipes=args.recipes,
            retrieval=False if args.no_retrieval else None, grounded=False if args.no_grounded else None,
            resume=args.resume, overwrite=args.overwrite, nproc=args.nproc, jobs=args.jobs, evaluation=evaluation,
        )
    except StudyInterrupted as exc:  # the running runs saved a checkpoint: --resume continues
        print(exc, file=sys.stderr)
        return exc.exit_status
    print(f"report: {args.out}/report.md ({metrics.wall_seconds / 60:.1f} min)", file=sys.stderr)
    return 0


def _changes_the_budget(args: argparse.Namespace) -> bool:
    """Whether compare's command line changes what the config's budget note describes (steps, seeds,
    models, recipes, learning rates, evaluations, any --set), which --out, --resume, --jobs and
    --nproc do not."""
    flags = (args.steps, args.budget, args.seeds, args.retrieval_steps, args.recipes, args.lr_grid,
             args.retrieval_lr_grid, args.attention)
    return (any(flag is not None for flag in flags) or args.no_retrieval or args.no_grounded or args.no_eval
            or args.quick_eval or bool(args.overrides))
