"""Typed study results with hand-planted figures, for the tests of claims and reports: the figures a
test asserts on are the ones it planted here, never computed by the code under test."""

from pathlib import Path

from diff_transformer.evaluation.stats import MeanStd
from diff_transformer.experiments.config import GroundedConfig, RetrievalConfig
from diff_transformer.experiments.grounded import GroundedModel, GroundedResult
from diff_transformer.experiments.language_models import Budget, LanguageModelling, Machine, ModelSummary
from diff_transformer.experiments.report import CompareMetrics, comparisons
from diff_transformer.experiments.results import (
    AnswerShares, CurvePoint, GroundedPoint, GroundedRun, GroundedScores, Outcomes, RetrievalRun, RunLog, SeedCurves,
    TrainingRun,
)
from diff_transformer.experiments.retrieval import RetrievalModel, RetrievalResult
from diff_transformer.experiments.study import RunKey, Sweep
from diff_transformer.train.trainer import TrainResult

LABELS = {"standard": "Transformer", "diff": "DIFF", "diff_v2": "DIFF V2"}


def summary(name, best, curve=None, steps=(2, 4), tokens=(100, 200)):
    """A model at its best: per-seed final losses ``best``, its validation curve [seed][point]."""
    curve = curve or [[v] * len(steps) for v in best]
    return ModelSummary(
        name=name, label=LABELS.get(name, name), attention=name, recipe=None, lr=1e-3, parameters=1, tokens=200,
        seeds=list(range(len(best))), status=["completed"] * len(best), messages=[], final_val_loss=MeanStd.of(best),
        tokens_per_s=MeanStd.of([1.0] * len(best)), peak_memory_bytes=1, peak_memory_kind="peak RSS",
        train_seconds=[1.0], load_average=[None], paper_table6=None, train_curve=SeedCurves([], [], []),
        val_curve=SeedCurves(list(steps), list(tokens), curve), diagnostics=None)


def lm_sweep(name, by_recipe):
    """A language model's sweep: {recipe: (its best lr there, {lr: per-seed final losses})}."""
    scores = {r: {lr: MeanStd.of(v) for lr, v in by_lr.items()} for r, (_, by_lr) in by_recipe.items()}
    runs = {r: {lr: [None] * len(v) for lr, v in by_lr.items()} for r, (_, by_lr) in by_recipe.items()}
    missing = {r: {lr: 0 for lr in by_lr} for r, (_, by_lr) in by_recipe.items()}
    return Sweep(name, runs, scores, missing, {r: lr for r, (lr, _) in by_recipe.items()}, next(iter(by_recipe)))


def lm(models, sweeps=None, recipes=(), steps=4):
    """Language modelling of ``models`` {name: ModelSummary}; each model's sweep one lr, unless given."""
    sweeps = sweeps or {n: lm_sweep(n, {None: (1e-3, {1e-3: list(m.final_val_loss.per_seed)})})
                        for n, m in models.items()}
    return LanguageModelling(Budget(steps, 2, 32, 0, {}), models, sweeps, list(recipes))


def retrieval_run(needle, mqar, attention=((0.0, 1.0), (0.5, 0.5)), full=1.0, four=1.0, curve=None, area=0.0):
    """A retrieval run: its final accuracy per task, answer-row shares per layer ((answer, noise) or None),
    quantised accuracy, and its learning curve [(step, accuracy of both tasks)] (default: 0, then the end)."""
    shares = [None if a is None else AnswerShares(a[0], a[1], 0.0) for a in attention]
    points = [CurvePoint(s, {}, {"needle": a, "mqar": a}) for s, a in curve] if curve else \
        [CurvePoint(0, {}, {"needle": 0.0, "mqar": 0.0}), CurvePoint(8, {}, {"needle": needle, "mqar": mqar})]
    return RetrievalRun(
        seed=0, lr=1e-3, parameters=1, train_seconds=1.0, train_tokens_per_second=1.0, losses=[],
        accuracy={"needle": {}, "mqar": {}}, mean_accuracy={"needle": needle, "mqar": mqar}, curve=points,
        curve_area={"needle": area, "mqar": area}, attention=shares, attention_needles=8,
        quantized_accuracy={"full": full, "4": four})


def _sweep(name, by_recipe):
    """Each recipe's runs at one lr (1e-3), the first recipe the best."""
    return Sweep(name, {r: {1e-3: rs} for r, rs in by_recipe.items()}, {}, {}, {r: 1e-3 for r in by_recipe},
                 next(iter(by_recipe)))


class _Chosen(RetrievalModel):
    """A retrieval model whose best runs are planted apart from its per-recipe runs."""

    def __init__(self, label, attention, sweep, runs):
        super().__init__(label, attention, sweep)
        self._runs = runs

    @property
    def runs(self):
        return self._runs


def retrieval(runs_by_model, *, chance=0.02, recipes=None, **settings):
    """runs_by_model: {name: runs at its best}; recipes: {name: {recipe: runs at its best lr there}}."""
    config = RetrievalConfig(**{"values": round(1 / chance), "quantize_bits": [4], "steps": 8, "batch_size": 4,
                                **settings})
    models = {}
    for name, runs in runs_by_model.items():
        by_recipe = (recipes or {}).get(name)
        label = LABELS.get(name, name)
        models[name] = RetrievalModel(label, name, _sweep(name, {None: runs})) if by_recipe is None \
            else _Chosen(label, name, _sweep(name, by_recipe), runs)
    return RetrievalResult(config, list((recipes or {}).get("standard", {})), models)


def compare_metrics(language_models, retrieval_result=None, machine=None, busy=None, budget_note=""):
    """The metrics a comparison's report renders."""
    machine = machine or Machine("cpu", 1, 1, "2.x", 2, 2, "x86_64")
    return CompareMetrics("tiny", "", budget_note, language_models, machine, comparisons(language_models.models),
                          busy, retrieval_result)


def training_run(name, seed, loss, *, lr=1e-3, recipe=None, status="completed", tokens_per_s=1000.0, parameters=100,
                 load_average=0.5):
    """A finished run of the trainer, as its summary.json says, without its logs."""
    summary = TrainResult(model=name, attention=name, parameters=parameters, status=status, steps=4, tokens=1000,
                          final_val_loss=loss, tokens_per_s=tokens_per_s, peak_memory_bytes=500 << 20,
                          peak_memory_kind="peak RSS", train_seconds=1.0, wall_seconds=2.0, load_average=load_average,
                          device="cpu", world_size=1, checkpoint=None)
    return TrainingRun(RunKey(name, seed, lr, recipe), summary, RunLog(), Path("unused"))


def grounded_scores(accuracy, faithful=0.0, prior_override=0.0, fabrication=0.0, abstention=0.0, recall=1.0):
    """Grounded scores with the figures given; every condition's outcomes all on the document (planted)."""
    outcomes = {c: Outcomes(3, 1.0, 0.0, 0.0, 0.0, 0.0) for c in ("agree", "counterfactual", "lacking", "closed_book")}
    return GroundedScores(accuracy, faithful, prior_override, fabrication, abstention, recall, outcomes)


def grounded_run(accuracy, lookback=(0.5, 0.5), curve=None, **scores):
    """A grounded run: its final grounded accuracy (and any other score), its lookback ratio per layer,
    its curve [(step, accuracy, lookback per layer)] (default: 0 at step 0, then the end at step 8)."""
    points = curve or [(0, 0.0, (0.5, 0.5)), (8, accuracy, lookback)]
    return GroundedRun(seed=0, lr=1e-3, parameters=1, train_seconds=1.0, train_tokens_per_second=1.0, losses=[],
                       scores=grounded_scores(accuracy, **scores), lookback=list(lookback),
                       lookback_auroc=[0.5] * len(lookback),
                       curve=[GroundedPoint(step, grounded_scores(a), list(lb)) for step, a, lb in points])


def grounded(runs_by_model, **settings):
    """runs_by_model: {name: runs at its best (one lr, no recipe)}."""
    config = GroundedConfig(**{"steps": 8, "batch_size": 4, "closed_book": 1, **settings})
    return GroundedResult(config, [], {name: GroundedModel(LABELS.get(name, name), name, _sweep(name, {None: runs}))
                                       for name, runs in runs_by_model.items()})
