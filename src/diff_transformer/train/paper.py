"""The paper's figures that the compare report prints beside this project's own.

Copied from Ye et al., "Differential Transformer" (ICLR 2025); every number here is the
PAPER's, at the paper's scale, never a result of this code.
"""

from __future__ import annotations

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

PAPER_REFERENCE = 'Ye et al., "Differential Transformer", ICLR 2025'
