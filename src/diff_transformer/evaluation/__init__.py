"""The paper's evaluations, each runnable on any checkpoint (any attention kind).

    diff-transformer eval NAME --checkpoint DIR [--checkpoint DIR ...] [--out DIR] [options]

writes OUT/NAME.json and OUT/NAME.png. From Python, :func:`run_suite` runs all of them on
several models (``compare`` does, after training) and returns Markdown sections for a report.

    needle           multi-needle retrieval accuracy by depth and length   Table 2, Fig. 5
    attention-noise  attention on the answer vs on the rest of the context  Table 3, Fig. 1
    context-qa       answers over a given context: exact match, lookback    Table 4 (no judge)
    outliers         largest attention logits and hidden states (per layer)  Table 5
    quantization     accuracy and loss with 16/8/6/4-bit attention logits   Fig. 8
    ar-hit           validation loss on AR-Hit and other tokens             Table 6
    position-nll     cumulative average NLL by position                     Fig. 4
    icl              many-shot classification and order robustness          Fig. 6, 7, 9
    mqar             multi-query associative recall (Zoology)               –
    attention-sink   attention on the first token per layer                 – (Xiao et al.; Qiu et al.)
    scaling          fitted scaling laws from several runs                  Fig. 3
"""

from __future__ import annotations

from .models import ModelUnderTest, load_model
from .options import Evaluation
from .suite import EVALUATIONS, NAMES, SuiteResult, report_sections, run_evaluation, run_suite
from .texts import EvalText

__all__ = [
    "EVALUATIONS",
    "NAMES",
    "EvalText",
    "Evaluation",
    "ModelUnderTest",
    "SuiteResult",
    "load_model",
    "report_sections",
    "run_evaluation",
    "run_suite",
]
