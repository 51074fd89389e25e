"""The paper's own figures (Ye et al., "Differential Transformer", ICLR 2025), for the "paper"
columns of the compare report and of the evaluation reports. Everything here is quoted from the
paper, never measured by this project. Models there are 1.4B-13B parameters (3B for needle,
attention noise, outliers and quantisation; 1.4B for the ablations) trained on 10B-1T tokens;
ours are tiny CPU models, so only directions are comparable.
"""

from __future__ import annotations

PAPER_REFERENCE = 'Ye et al., "Differential Transformer", ICLR 2025'

# Table 6: 1.4B models, 10B tokens; validation loss, and the loss on AR-Hit tokens and on the rest.
# Keys are what a config's ``models.<name>.paper_row`` names.
PAPER_TABLE6: dict[str, dict[str, float | str]] = {
    "transformer": dict(row="Transformer, 16 heads × 128", valid=3.087, ar_hit=0.898, others=3.272),
    "transformer-8x256": dict(row="Transformer, 8 heads × 256", valid=3.088, ar_hit=0.899, others=3.273),
    "transformer-8x256-groupnorm": dict(row="Transformer 8 × 256 + GroupNorm", valid=3.086, ar_hit=0.899, others=3.271),
    "diff": dict(row="DIFF, 8 heads × 128", valid=3.062, ar_hit=0.880, others=3.247),
    "diff-no-groupnorm": dict(row="DIFF − GroupNorm", valid=3.122, ar_hit=0.911, others=3.309),
    "diff-lambda-0.8": dict(row="DIFF with λ_init = 0.8", valid=3.065, ar_hit=0.883, others=3.250),
    "diff-lambda-0.5": dict(row="DIFF with λ_init = 0.5", valid=3.066, ar_hit=0.882, others=3.251),
}

# Table 7: training throughput (forward + backward) on one H100, tokens/s, Transformer vs DIFF.
PAPER_TABLE7_TRAINING: list[dict[str, float | str]] = [
    dict(size="3B", length="2K", transformer=7247, diff=6635),
    dict(size="3B", length="4K", transformer=7491, diff=6718),
    dict(size="13B", length="2K", transformer=998, diff=942),
]

# Table 2: multi-needle retrieval accuracy at 4K context, keyed "N:R".
NEEDLE_TABLE2 = {
    "source": "paper Table 2 (3B models, 4K context)",
    "standard": {"1:1": 1.00, "2:2": 0.85, "4:2": 0.62, "6:2": 0.55},
    "diff": {"1:1": 1.00, "2:2": 0.92, "4:2": 0.84, "6:2": 0.85},
}

# Table 3: attention to the answer span and to noise (the rest of the context), by depth.
ATTENTION_TABLE3 = {
    "source": "paper Table 3 (3B models, key-information retrieval)",
    "depths": [0.0, 0.25, 0.5, 0.75, 1.0],
    "standard": {"answer": [0.03, 0.03, 0.03, 0.07, 0.09], "noise": [0.51, 0.54, 0.52, 0.49, 0.49]},
    "diff": {"answer": [0.27, 0.30, 0.31, 0.32, 0.40], "noise": [0.01, 0.02, 0.02, 0.02, 0.01]},
}

# Table 4: contextual hallucination, the share of outputs GPT-4o judged free of it (3B models; summaries of
# XSum, CNN/DM, MultiNews; question answering on Qasper, HotpotQA, 2WikiMQA), Transformer and DIFF.
HALLUCINATION_TABLE4 = {
    "source": "paper Table 4 (3B models, accuracy judged by GPT-4o)",
    "standard": {"XSum": 0.44, "CNN/DM": 0.32, "MultiNews": 0.42, "Qasper": 0.28, "HotpotQA": 0.36, "2WikiMQA": 0.29},
    "diff": {"XSum": 0.53, "CNN/DM": 0.41, "MultiNews": 0.61, "Qasper": 0.39, "HotpotQA": 0.46, "2WikiMQA": 0.36},
    "range": "+0.07 to +0.19",  # DIFF − Transformer over the six datasets
}

# Table 5: largest activation magnitudes over 0.4M tokens.
OUTLIERS_TABLE5 = {
    "source": "paper Table 5 (3B models, 0.4M tokens)",
    "columns": ["top1", "top2", "top3", "top10", "top100", "median"],
    "attention_logits": {
        "standard": [318.0, 308.2, 304.9, 284.7, 251.5, 5.4],
        "diff": [38.8, 38.8, 37.3, 32.0, 27.4, 3.3],
    },
    "hidden_states": {
        "standard": [3608.6, 3607.4, 3603.6, 3552.1, 2448.2, 0.6],
        "diff": [1688.2, 1672.5, 1672.1, 1624.3, 740.9, 1.2],
    },
}

# Figure 8 (text): quantised attention logits, HellaSwag accuracy.
QUANTIZATION_FIG8 = {
    "source": "paper Fig. 8 (3B models, HellaSwag zero-shot)",
    "claim": "at 6 bits DIFF keeps its accuracy while the Transformer's drops sharply; 4-bit DIFF is "
    "about as accurate as 6-bit Transformer and ~25 points above 4-bit Transformer",
}

# Table 6 rows of the two main models, for the AR-Hit evaluation.
AR_HIT_TABLE6 = {
    "source": "paper Table 6 (1.4B models, 10B tokens)",
    **{
        kind: {key: PAPER_TABLE6[row][key] for key in ("valid", "ar_hit", "others")}
        for kind, row in (("standard", "transformer"), ("diff", "diff"))
    },
}

# Figure 4 (text): cumulative average NLL by position, 3B models at 64K on book data.
POSITION_NLL_FIG4 = {
    "source": "paper Fig. 4 (3B models, 64K context, book data)",
    "claim": "DIFF has a lower cumulative average NLL than the Transformer at every position",
}

# Figures 6, 7, 9 (text): many-shot in-context learning.
ICL_FIGS = {
    "source": "paper Fig. 6, 7, 9 (3B models, 64K context; TREC, TREC-fine, Banking-77, Clinic-150)",
    "accuracy_claim": "DIFF is more accurate than the Transformer at every number of demonstrations "
    "(average gains of 5.2-21.6 points at 64K)",
    "robustness_claim": "DIFF's accuracy varies less with the order of demonstrations (smaller best-worst "
    "spread) in both random and class-alternating layouts",
}

# Figure 3: scaling.
SCALING_FIG3 = {
    "source": "paper Fig. 3 (830M-13.1B models, 10B tokens; 3B models, up to 360B tokens)",
    "parameter_fraction": (0.595, 0.622),  # Fig. 3a's two readings: 7.8B ≈ 13.1B, 6.8B ≈ 11B
    "token_fraction": 0.637,  # Fig. 3b: 160B ≈ 251B
    "claim": "DIFF matches the Transformer with 62.2% of the parameters (6.8B DIFF ≈ 11B Transformer) and 59.5% "
    "(7.8B ≈ 13.1B), and with 63.7% of the training tokens (160B ≈ 251B)",
}

MQAR_NOTE = "The paper reports no MQAR figure; Zoology (Arora et al., 2023) introduced the task."
