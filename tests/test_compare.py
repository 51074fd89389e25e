"""``compare``: an end-to-end run at the debug size, the report's wording, model selection."""

import json
import os
import sys
from functools import partial

import pytest

import yaml

from diff_transformer.checkpoint import load_checkpoint_tokenizer
from diff_transformer.cli import main
from diff_transformer.evaluation import SuiteResult, run_suite
from diff_transformer.experiments import compare, load_experiment, select_models
from diff_transformer.experiments.language_models import LanguageModelling, run_config
from diff_transformer.experiments.report import render_report
from diff_transformer.experiments.study import NoBestLearningRate, RunKey, sweep
from diff_transformer.model import LanguageModel
from diff_transformer.train import ConfigError, load_config
from planted import compare_metrics, lm, lm_sweep, retrieval, retrieval_run, summary, training_run
from test_train import byte_dataset, debug_experiment  # noqa: F401  (byte_dataset is a fixture)

MODELS = {
    "standard": {"attention": "standard", "label": "Transformer", "paper_row": "transformer"},
    "diff": {"attention": "diff", "label": "DIFF", "paper_row": "diff"},
}


@pytest.mark.slow  # a learning-rate sweep of both models
def test_compare_sweeps_the_learning_rates_and_reports_each_model_at_its_best(byte_dataset, tmp_path):  # noqa: F811
    config = debug_experiment(byte_dataset, tmp_path / "unused", models=MODELS, run={"steps": 3, "eval_every": 3})
    seen = {}

    def evaluation(checkpoints, out_dir):
        seen.update(checkpoints)
        return SuiteResult(sections={"hook": "section from the hook"}, data={"hook": {"title": "Hook"}})

    out = tmp_path / "compare"
    grid = [1e-3, 1e-2]
    metrics = compare(config, out, lr_grid=grid, evaluation=evaluation, progress=False)

    assert list(metrics.models) == ["standard", "diff"]
    for name, m in metrics.models.items():
        by_lr = metrics.lm.sweeps[name].runs[None]  # no recipe dimension
        losses = {lr: sum(r.summary.final_val_loss for r in runs) / len(runs) for lr, runs in by_lr.items()}
        assert m.lr == min(losses, key=losses.get)  # its own best, by final validation loss
        assert m.final_val_loss.mean == pytest.approx(losses[m.lr])
        # min_lr keeps its ratio to lr (3e-4 / 3e-3) at every grid value.
        for lr in grid:
            first = json.loads((out / "runs" / name / f"lr-{lr:g}" / "seed-0" / "metrics.jsonl").read_text()
                               .splitlines()[0])
            assert first["lr"] == pytest.approx(lr / 2)  # step 0 of a 2-step warmup
        assert m.tokens == 3 * 8 * 32 and m.status == ["completed"]
        assert m.final_val_loss.mean > 0 and m.tokens_per_s.mean > 0 and m.peak_memory_bytes > 0
        model = LanguageModel.from_pretrained(out / name)  # the best run's final checkpoint, with its tokenizer
        assert model.config.attention == m.attention and model.num_parameters() == m.parameters
        assert load_checkpoint_tokenizer(out / name) is not None
        best_dir = out / "runs" / name / f"lr-{m.lr:g}" / "seed-0" / "checkpoint"
        assert seen[f"{config.model_name(name)} s0"] == best_dir
        assert (out / name / "model.safetensors").read_bytes() == (best_dir / "model.safetensors").read_bytes()
    assert metrics.models["diff"].parameters - metrics.models["standard"].parameters == 2 * 6 * 16
    assert [c.claim for c in metrics.claims] == ["Language modelling"]

    report = (out / "report.md").read_text()
    assert "| Transformer | standard |" in report and "| DIFF | diff |" in report
    assert "3.087" in report and "3.062" in report  # the paper's Table 6 figures beside ours
    assert "The search" in report and "| Init recipe | lr 0.001 | lr 0.01 |" in report
    edge = next(line for line in report.splitlines() if line.startswith("Best at an end of the grid"))
    assert all(f"{m.label} ({m.lr:g})" in edge for m in metrics.models.values())  # of two lrs, either is an end
    assert "The paper's claims at this scale" in report and "| Language modelling |" in report
    assert "training throughput" in report and "peak RSS" in report
    assert "DIFF vs Transformer, parameters**: +192 (" in report
    assert report.rstrip().endswith("section from the hook")
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "metrics.json").read_text())["lm"]["budget"]["steps"] == 3

    # --resume reuses finished runs: nothing is trained again.
    stamp = (out / "runs" / "diff" / "lr-0.01" / "seed-0" / "checkpoint" / "model.safetensors").stat().st_mtime_ns
    again = compare(config, out, lr_grid=grid, resume=True, progress=False)
    assert ((out / "runs" / "diff" / "lr-0.01" / "seed-0" / "checkpoint" / "model.safetensors").stat().st_mtime_ns
            == stamp)
    assert again.models["diff"].final_val_loss == metrics.models["diff"].final_val_loss


@pytest.mark.slow  # both experiments, every seed, the evaluations
def test_compare_runs_the_evaluations_on_every_seed_into_the_report(byte_dataset, tmp_path, capfd):  # noqa: F811
    """What the CLI wires: the config's evaluations on every seed's model, a report section each,
    and the claims table fed by their figures; with progress=False, no run prints its summary line."""
    config = debug_experiment(byte_dataset, tmp_path / "unused", models=MODELS, run={"steps": 2, "eval_every": 2})
    out = tmp_path / "compare"
    names = ["outliers", "quantization", "ar-hit"]
    metrics = compare(config, out, seeds=2, evaluation=partial(run_suite, quick=True, evaluations=names),
                      progress=False)
    assert "tokens/s; checkpoint" not in capfd.readouterr().err  # the runs' processes write to fd 2
    report = (out / "report.md").read_text()
    assert "## Evaluations of the paper" in report
    labels = {"Transformer s0", "Transformer s1", "DIFF s0", "DIFF s1"}
    for name in names:
        results = json.loads((out / "eval" / f"{name}.json").read_text())
        assert set(results["models"]) == labels, name
        assert (out / "eval" / f"{name}.png").read_bytes()[:4] == b"\x89PNG", name
        assert f"eval/{name}.png" in report, name
    claims = {c.measure: c for c in metrics.claims}
    outliers = claims["top-1 / median magnitude of attention logits"]
    result = json.loads((out / "eval" / "outliers.json").read_text())["models"]
    expected = [result[f"DIFF s{s}"]["attention_logits"]["top1"] / result[f"DIFF s{s}"]["attention_logits"]["median"]
                for s in (0, 1)]
    assert outliers.ours.per_seed == pytest.approx(expected)
    assert outliers.difference.low is not None  # two seeds: an interval


def test_models_are_selected_by_attention_kind():
    config = load_experiment("tiny")
    assert select_models(config, None) == ["standard", "diff"]
    assert select_models(config, ["standard", "diff"]) == ["standard", "diff"]
    assert select_models(config, ["diff_v2", "standard"]) == ["standard", "diff_v2"]
    # tiny's ablation variants (diff-no-headnorm, diff-lambda-0.8) are not in compare.models
    assert select_models(config, ["standard", "diff", "diff_v2"]) == ["standard", "diff", "diff_v2"]
    ablation = load_experiment("ablation-1.4b")
    assert select_models(ablation, ["diff"]) == ["diff", "diff-no-groupnorm", "diff-lambda-0.8", "diff-lambda-0.5"]
    with pytest.raises(ConfigError, match="diff_v2"):
        select_models(ablation, ["diff_v2"])


def test_compare_command_rejects_a_kind_the_config_lacks(capsys, tmp_path):
    assert main(["compare", "--config", "ablation-1.4b", "--attention", "diff_v2", "--out", str(tmp_path)]) == 2
    assert "no model of that kind" in capsys.readouterr().err


def report_for(standard_losses, diff_losses, tokens_per_s=(1000.0, 950.0), busy=None, budget_note=None):
    """report.md of two models whose runs finished with these final losses (one run a seed), without training."""
    config = load_experiment("tiny")
    runs = {RunKey(name, i, 1e-3): training_run(name, i, loss, tokens_per_s=speed, parameters=params)
            for name, losses, speed, params in (("standard", standard_losses, tokens_per_s[0], 100),
                                                ("diff", diff_losses, tokens_per_s[1], 106))
            for i, loss in enumerate(losses)}
    sweeps = sweep(runs, lambda run: run.final_val_loss, lower_is_better=True)
    language_models = LanguageModelling.of(config, sweeps, ["standard", "diff"], [None])
    note = config.compare.budget_note if budget_note is None else budget_note
    return render_report(compare_metrics(language_models, busy=busy, budget_note=note))


@pytest.mark.slow  # a study end to end (1.6 s)
def test_the_report_says_plainly_when_the_result_contradicts_the_paper(tmp_path):
    # losses below tiny.yaml's data's bigram (2.437 nats/byte) by more than the margin: judged
    worse = report_for([2.00, 2.01, 2.02], [2.10, 2.11, 2.12])
    assert "contradicts the paper" in worse and "+0.1000" in worse
    noise = report_for([2.00, 2.10, 2.05], [2.06, 1.99, 2.07])
    assert "no difference either way" in noise and "contradicts" not in noise
    better = report_for([2.10, 2.11, 2.12], [2.00, 2.01, 2.02])
    assert "Same direction as the paper" in better
    one_seed = report_for([2.0], [2.1])
    assert "contradicts the paper" in one_seed and "one seed" in one_seed
    # above it (models that have not learned): no verdict, with the reference named
    unlearned = report_for([4.00, 4.01, 4.02], [4.10, 4.11, 4.12])
    assert "contradicts" not in unlearned and "**Not judged**: the models have not passed a bigram table" in unlearned
    assert "bigram 2.437 nats/byte" in unlearned


def test_the_report_states_the_throughput_ratio_against_the_target(tmp_path):
    slow = report_for([4.0], [4.0], tokens_per_s=(1000.0, 850.0))
    assert "0.85× here" in slow and "**missed**" in slow
    fast = report_for([4.0], [4.0], tokens_per_s=(1000.0, 950.0))
    assert "0.95× here" in fast and "met." in fast


def test_the_report_does_not_judge_throughput_measured_on_a_busy_machine():
    from diff_transformer.experiments.language_models import busy_load_average

    models = {"standard": summary("standard", [4.0]), "diff": summary("diff", [4.0])}
    models["standard"].load_average = [2.0 + os.cpu_count() * 2]  # other jobs competing
    assert busy_load_average(list(models.values()), os.cpu_count()) == 2.0 + os.cpu_count() * 2
    models["standard"].load_average = [float(os.cpu_count())]  # its own threads only
    assert busy_load_average(list(models.values()), os.cpu_count()) is None
    busy = report_for([4.0], [4.0], tokens_per_s=(1000.0, 2200.0), busy=2.0 + os.cpu_count() * 2)
    assert "2.20× here" in busy and "not judged from this run" in busy and "met." not in busy


def test_the_best_learning_rate_ignores_one_where_a_seed_diverged():
    by_lr = {1e-3: [4.0, 4.2], 1e-2: [3.0, None], 3e-3: [3.9, 3.95]}  # 1e-2: one of two seeds diverged
    runs = {RunKey("diff", seed, lr): training_run("diff", seed, loss, lr=lr,
                                                   status="completed" if loss else "diverged")
            for lr, losses in by_lr.items() for seed, loss in enumerate(losses)}
    best = sweep(runs, lambda run: run.final_val_loss, lower_is_better=True)["diff", None, None]
    assert best.lr == 3e-3 and best.missing[None] == {1e-3: 0, 1e-2: 1, 3e-3: 0}
    assert [r.key.seed for r in best.chosen] == [0, 1]
    diverged = {RunKey("diff", 0, 1e-2): training_run("diff", 0, None, lr=1e-2, status="diverged")}
    with pytest.raises(NoBestLearningRate, match="no learning rate"):
        sweep(diverged, lambda run: run.final_val_loss, lower_is_better=True)


def test_evaluation_sentences_pair_the_same_seed_only():
    from diff_transformer.evaluation.output import pairs_to_compare

    def result(kind):
        return {"model": {"attention": kind}}

    labels = {"Transformer s0": "standard", "Transformer s1": "standard", "DIFF s0": "diff", "DIFF s1": "diff"}
    assert pairs_to_compare({k: result(v) for k, v in labels.items()}) == [
        ("Transformer s0", "DIFF s0"), ("Transformer s1", "DIFF s1")]
    plain = {"standard": result("standard"), "diff": result("diff"), "diff_v2": result("diff_v2")}
    assert pairs_to_compare(plain) == [("standard", "diff"), ("standard", "diff_v2")]


def test_each_run_reads_its_own_config_even_for_a_model_name_with_dots(tmp_path):
    config = load_config("tiny")
    run = run_config(config, RunKey("diff-lambda-0.8", 2, 8e-3), tmp_path / "run", progress=False)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))  # as the runner writes it
    again = load_config(path)
    optim = again.optim_for("diff-lambda-0.8")
    assert optim.lr == 8e-3 and optim.min_lr == pytest.approx(8e-4)  # min_lr keeps the config's ratio 1/10
    assert again.run.seed == 2 and again.run.checkpoint_dir == str(tmp_path / "run" / "checkpoint")
    assert again.model("diff-lambda-0.8").model_config().lambda_init == 0.8
    assert again.optim_for("standard").lr == config.optim_for("standard").lr  # other models untouched


def test_the_report_says_why_the_budget_is_what_it_is():
    assert "**The budget.** Meant to finish within 12 minutes" in report_for([4.0], [4.1])
    assert "**The budget.**" not in report_for([4.0], [4.1], budget_note="")


CHILD = """
import os, pathlib, signal, sys, time
folder, me, other = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def stop(signum, frame):
    (folder / f"{me}.stopped").write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
(folder / me).write_text(os.environ.get("OMP_NUM_THREADS", ""))
start = time.time()
while not (folder / other).exists() or sys.argv[4] == "wait":  # finishes only once the other one runs too
    if time.time() - start > 60:
        sys.exit(3)
    time.sleep(0.01)
sys.exit(0)
"""


def _process_jobs(folder, mode, third=False):
    """The runner's training jobs with a stand-in for the trainer: each process writes its thread count,
    then waits for the other to start (``mode`` "finish") or forever ("wait")."""
    from diff_transformer.experiments.runner import TrainingJob

    class Child(TrainingJob):
        def __init__(self, me, other):
            super().__init__(RunKey(me, 0, 1e-3), me, folder / me, me, None)
            self.argv = [sys.executable, "-c", CHILD, str(folder), me, other, mode]

        def command(self, resume, nproc):
            return self.argv

        def result(self, exit_status):
            return exit_status

        def cost(self):
            return 0.0

    jobs = [Child("a0", "b1"), Child("b1", "a0")]
    if third:
        jobs.append(Child("c2", "a0"))
        jobs[-1].argv = [sys.executable, "-c", f"open({str(folder / 'third')!r}, 'w')"]
    return jobs


def test_the_costliest_training_runs_start_first(monkeypatch, tmp_path):
    """MTA (its maps convolved) before DIFF before the Transformer, by their training FLOPs; the seed order
    kept among equals; a pool job keeps its place after them."""
    from diff_transformer.experiments import load_experiment, runner

    started = []
    monkeypatch.setattr(runner._Runner, "run", lambda self, queue, results: (
        started.extend(job.label for job in queue), results.update({job.key: None for job in queue})))
    train = load_experiment("alternatives").train
    jobs = [runner.TrainingJob(RunKey(m, seed, 2e-3), f"{m} {seed}", tmp_path / f"{m}{seed}", m, train)
            for seed in (0, 1) for m in ("standard", "mta", "diff")]
    jobs.append(runner.PoolJob(RunKey("small", 0, 1e-3), "pool", tmp_path / "p.json", print, (), dict))
    runner.run_jobs(jobs, progress=False)
    assert started == ["mta 0", "mta 1", "diff 0", "diff 1", "standard 0", "standard 1", "pool"]


def test_jobs_run_side_by_side_each_on_its_share_of_the_cores(tmp_path):
    from diff_transformer.experiments.runner import run_jobs

    results = run_jobs(_process_jobs(tmp_path, "finish"), at_once=2, progress=False)
    assert list(results.values()) == [0, 0]  # neither could finish unless both ran at once
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    assert (tmp_path / "a0").read_text() == threads and (tmp_path / "b1").read_text() == threads


def test_a_signal_reaches_every_running_job_once_and_none_starts_after_it(tmp_path):
    import signal
    import threading
    import time

    from diff_transformer.experiments.runner import StudyInterrupted, run_jobs

    def send_when_both_run():
        while not ((tmp_path / "a0").exists() and (tmp_path / "b1").exists()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_when_both_run, daemon=True).start()
    with pytest.raises(StudyInterrupted, match="interrupted by SIGTERM") as caught:
        run_jobs(_process_jobs(tmp_path, "wait", third=True), at_once=2, progress=False)
    assert caught.value.exit_status == 143
    assert (tmp_path / "a0.stopped").read_text() == (tmp_path / "b1.stopped").read_text() == str(int(signal.SIGTERM))
    assert not (tmp_path / "third").exists()


def test_a_run_started_as_the_signal_came_is_stopped_and_one_the_signal_ended_counts_as_interrupted(tmp_path):
    """A signal that lands while a run's process is being started (after the runner passed it to the
    running ones) reaches that process too, once; a process the signal itself ended (-15: it had no
    handler yet, still importing torch) is an interrupted run, not a failed one (the issue: "training
    failed (exit code -2)", exit status 2)."""
    import signal

    from diff_transformer.experiments.runner import _Runner

    runner = _Runner(1, 1, False, False, None)
    runner.received.append(signal.SIGTERM)
    job = _process_jobs(tmp_path, "wait")[0]
    job.argv = [sys.executable, "-c", "import time; time.sleep(60)"]  # no handler: the signal ends it
    runner._start(job)
    [(_, process)] = runner.processes.values()
    assert process.wait(timeout=60) == -signal.SIGTERM and runner.signalled == {process.pid}
    assert runner._collect() == [] and runner.stopped == [signal.SIGTERM]


@pytest.mark.slow  # three models, two recipes, both experiments, two at a time
def test_compare_searches_each_recipe_and_reports_what_each_claim_depends_on(byte_dataset, tmp_path):  # noqa: F811
    models = {**MODELS, "diff_v2": {"attention": "diff_v2", "label": "DIFF V2"}}
    retrieval = dict(length=32, keys=8, values=8, noise_tokens=8, d_model=32, n_layers=1, n_heads=1, steps=4,
                     batch_size=4, needles=[1, 2], depths=[0.0, 1.0], pairs=[2, 4], eval_samples=2, quantize_bits=[4])
    grounded = dict(length=20, entities=8, attributes=4, noise_tokens=4, context_facts=3, questions=3, d_model=32,
                    n_layers=1, n_heads=1, steps=4, batch_size=4, closed_book=1, eval_episodes=3)
    config = debug_experiment(byte_dataset, tmp_path / "unused", models=models, run={"steps": 4, "eval_every": 2},
                              compare={"recipes": ["scaled-init", "plain-init"], "lm_recipes": ["plain-init"],
                                       "jobs": 2},
                              retrieval=retrieval, grounded=grounded)
    out = tmp_path / "compare"
    metrics = compare(config, out, seeds=2, progress=False)

    # Language modelling under plain-init only (lm_recipes); retrieval under both.
    for name in models:
        run = out / "runs" / name / "plain-init" / "lr-0.003" / "seed-1"
        assert load_config(run / "config.yaml").model(name).model_config().scale_residual_init is False
        assert not (out / "runs" / name / "scaled-init").exists()
        assert (out / "retrieval" / name / "scaled-init" / "lr-0.003" / "seed-1.json").is_file()
        assert (out / "grounded" / name / "plain-init" / "lr-0.003" / "seed-1.json").is_file()  # compare.recipes
        assert metrics.models[name].recipe == "plain-init"
        assert set(metrics.retrieval.models[name].sweep.runs) == {"scaled-init", "plain-init"}
    assert metrics.lm.recipes == ["plain-init"] and metrics.machine.jobs == 2
    claims = {c.measure.split(",")[0]: c for c in metrics.claims}
    assert set(claims["final validation loss (nats/byte)"].by_recipe) == {"plain-init"}
    assert set(claims["mqar accuracy"].by_recipe) == {"scaled-init", "plain-init"}
    assert [p.fraction for p in claims["mqar accuracy"].along] == [0.25, 0.5, 1.0]  # steps 1, 2, 4 of 4
    hallucination = next(c for c in metrics.claims if c.claim == "Contextual hallucination")
    assert set(hallucination.by_recipe) == {"scaled-init", "plain-init"} and len(hallucination.along) == 4
    assert any(c.claim == "Contextual hallucination: lookback ratio" for c in metrics.claims)
    variants = metrics.variant_comparisons
    assert {(v.model, v.baseline) for v in variants} == {("DIFF V2", "Transformer"), ("DIFF V2", "DIFF")}
    assert {v.claim for v in variants} >= {"Contextual hallucination", "Lookback ratio"}
    report = (out / "report.md").read_text()
    for heading in ("## The paper's claims at this scale", "## The other attention kinds",
                    "## Sensitivity to the init recipe", "## Sample efficiency", "### Learning curves",
                    "| Under each recipe |", "## Contextual hallucination experiment"):
        assert heading in report, heading
    assert (out / "retrieval_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_an_earlier_run_is_replaced_only_when_it_holds_nothing_but_the_run(tmp_path, capsys):
    from diff_transformer.experiments.runner import clear_run as _clear_run
    from diff_transformer.files import OutputPathError, claim_output_dir

    run = claim_output_dir(tmp_path / "runs" / "diff" / "lr-0.002" / "seed-0", "train-run")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "checkpoint").mkdir()
    (run / "notes.md").write_text("my notes")
    with pytest.raises(OutputPathError, match="notes.md, which are not part of it"):
        _clear_run(run, "[1/1] diff")
    assert (run / "notes.md").read_text() == "my notes" and (run / "metrics.jsonl").is_file()
    (run / "notes.md").unlink()
    _clear_run(run, "[1/1] diff")
    assert not run.exists() and "replacing the earlier run" in capsys.readouterr().err


def _planted_metrics(standard_scaled=(4.2,), diff_scaled=(4.5,)):
    """Two models' figures, planted by hand: the Transformer's validation curve falls 5.0, 4.6, 4.4, 4.2
    over 10..40 tokens, DIFF's 5.2, 4.9, 4.7, 4.5; their final losses under scaled-init as given; one
    retrieval run each under two recipes."""
    models = {"standard": summary("standard", [4.2], [[5.0, 4.6, 4.4, 4.2]], (1, 2, 3, 4), (10, 20, 30, 40)),
              "diff": summary("diff", [4.5], [[5.2, 4.9, 4.7, 4.5]], (1, 2, 3, 4), (10, 20, 30, 40))}
    sweeps = {"standard": lm_sweep("standard", {"scaled-init": (1e-3, {1e-3: list(standard_scaled)})}),
              "diff": lm_sweep("diff", {"scaled-init": (1e-3, {1e-3: list(diff_scaled)})})}
    language_models = lm(models, sweeps, ["scaled-init"])
    language_models.budget.batch_size, language_models.budget.seq_len = 1, 10  # 40 tokens in all

    def run(points):  # accuracy after steps 0, 2, 4 (2 MQAR examples a step)
        return retrieval_run(points[-1], points[-1], curve=list(zip((0, 2, 4), points)))

    runs = {"standard": ([0.0, 0.1, 0.2], [0.0, 0.1, 0.3]), "diff": ([0.0, 0.5, 0.6], [0.0, 0.2, 0.4])}
    result = retrieval({name: [run(plain)] for name, (_, plain) in runs.items()}, chance=0.01, steps=4,
                       target_accuracy=0.25,
                       recipes={name: {"scaled-init": [run(scaled)], "plain-init": [run(plain)]}
                                for name, (scaled, plain) in runs.items()})
    return compare_metrics(language_models, result)


def test_sample_efficiency_reads_each_curve_as_a_hand_interpolation_does():
    from diff_transformer.experiments.report import sample_efficiency_lines

    text = "\n".join(sample_efficiency_lines(_planted_metrics()))
    # The Transformer reaches DIFF's final 4.5 between 20 tokens (4.6) and 30 (4.4): at 25 tokens, 62% of 40.
    assert "Transformer reaches DIFF's final loss (4.5000) after 25 tokens (62% of the budget)" in text
    assert "DIFF does not reach Transformer's final loss (4.2000) within the budget" in text
    # Retrieval, target 0.25, at 0, 4 and 8 examples of each task (2 a step; the needle curve is planted the
    # same): the Transformer under plain-init reaches it between 4 (0.1) and 8 (0.3), at 7; DIFF under
    # scaled-init between 0 (0.0) and 4 (0.5), at 2, under plain-init between 4 (0.2) and 8 (0.4), at 5.
    assert ("| Transformer | 1 | plain-init | 7 | 7 |" in text
            and "| Transformer | 1 | scaled-init | not within the budget " in text)
    assert "| DIFF | 1 | scaled-init | 2 | 2 |" in text and "| DIFF | 1 | plain-init | 5 | 5 |" in text


def test_the_sensitivity_table_gives_each_recipe_its_own_difference():
    from diff_transformer.experiments.report import sensitivity_lines

    metrics = _planted_metrics(standard_scaled=(4.2, 4.4), diff_scaled=(4.5, 4.5))  # two seeds for an interval
    lines = {line.split(" | ")[0] + " | " + line.split(" | ")[1]: line for line in sensitivity_lines(metrics)
             if line.startswith("| ")}
    lm_row = lines["| Language modelling (lower) | scaled-init"]
    assert "| 4.3000 ± 0.1414 | 4.5000 ± 0.0000 | +0.2 [" in lm_row  # DIFF − Transformer = 4.5 − 4.3
    mqar = lines["| Retrieval: mqar (higher) | plain-init"]
    assert "| 0.3000 | 0.4000 | +0.1 |" in mqar  # one seed each: the difference without an interval


def test_a_finished_run_that_lost_its_summary_is_trained_again_not_resumed(tmp_path):
    """A run killed between its last checkpoint and its summary.json: --resume would find the run finished
    and write no summary, so the runner replaces it (said aloud) and trains it from the start."""
    import json as json_module

    from diff_transformer.experiments.runner import TrainingJob
    from diff_transformer.files import claim_output_dir

    config = load_config("tiny", ["run.steps=4"])
    run = claim_output_dir(tmp_path / "run", "train-run")
    checkpoint = run / "checkpoint"
    checkpoint.mkdir()
    for name in ("model.safetensors", "training_state.pt"):
        (checkpoint / name).write_bytes(b"")
    (checkpoint / "config.json").write_text(json_module.dumps({"format": "diff-transformer", "format_version": 1,
                                                               "model": {}, "training": {"step": 4}}))
    job = TrainingJob(RunKey("diff", 0, 2e-3), "[1/1] diff", run, "diff", config)
    assert "--resume" not in job.command(resume=True, nproc=1) and not checkpoint.exists()
    (checkpoint.parent / "checkpoint").mkdir()
    for name in ("model.safetensors", "training_state.pt"):
        (checkpoint / name).write_bytes(b"")
    (checkpoint / "config.json").write_text(json_module.dumps({"format": "diff-transformer", "format_version": 1,
                                                               "model": {}, "training": {"step": 2}}))
    assert job.command(resume=True, nproc=1)[-1] == "--resume"  # interrupted part-way: continued
