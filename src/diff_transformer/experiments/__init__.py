"""The studies, built on the library (which never imports them): a config file's experiment sections
(:mod:`.config`) describe a grid of runs over named axes (:mod:`.study`), one runner trains them
(:mod:`.runner`), and each study reads typed results (:mod:`.results`) into its report: the
side-by-side comparison of attention kinds (:mod:`.comparison`: language modelling, the generated
retrieval tasks of :mod:`.retrieval`, the paper's claims of :mod:`.claims`, :mod:`.report`) and the
long-context study (:mod:`.long_context`). :func:`compare` runs the one a config describes.

    from diff_transformer.experiments import compare, load_experiment
    compare(load_experiment("tiny"), out_dir="out/compare")   # every model, same data, report.md
"""

from .compare import compare, select_models
from .config import ExperimentConfig, load_experiment
from .runner import StudyInterrupted

__all__ = ["ExperimentConfig", "StudyInterrupted", "compare", "load_experiment", "select_models"]
