"""The paper's experiment, built on the library: ``compare`` trains several attention kinds side by
side (language modelling on a corpus, and the generated retrieval tasks of :mod:`.retrieval`),
tests the paper's claims on them (:mod:`.claims`) and writes the report (:mod:`.report`).

    from diff_transformer.train import load_config
    from diff_transformer.experiments import compare
    compare(load_config("tiny"), out_dir="out/compare")   # every model, same data, report.md
"""

from .compare import compare, select_models

__all__ = ["compare", "select_models"]
