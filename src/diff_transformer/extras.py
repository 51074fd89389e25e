"""The optional libraries, by the extra that installs them (pyproject.toml's optional-dependencies).

The core, ``pip install diff-transformer``: the ops, ``MultiheadDiffAttention``, ``ModelConfig`` and
``LanguageModel`` (forward, generate, save_pretrained, from_pretrained) need torch, numpy and
safetensors only. Training, data, evaluation, reports and the ``diff-transformer`` command come with
``pip install "diff-transformer[train]"``; Hugging Face interop with ``[hf]``, the Triton kernel with
``[kernels]``.

    import_optional("pyarrow", "reading Parquet")    # the module, or a MissingExtraError naming the extra
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> {module imported: distribution installed}
EXTRAS: dict[str, dict[str, str]] = {
    "train": {"yaml": "pyyaml", "tqdm": "tqdm", "tokenizers": "tokenizers", "tensorboard": "tensorboard",
              "matplotlib": "matplotlib", "scipy": "scipy", "pyarrow": "pyarrow"},
    "hf": {"transformers": "transformers", "lm_eval": "lm-eval", "accelerate": "accelerate"},
    "kernels": {"triton": "triton"},
}


class MissingExtraError(ModuleNotFoundError):
    """An optional library is not installed; the message names it and the extra that installs it."""


def install_command(extra: str) -> str:
    return f"pip install 'diff-transformer[{extra}]'"


def extra_of(module: str) -> str | None:
    """The extra whose library ``module`` (or a submodule of it, "scipy.stats") is, or None."""
    top = module.split(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def missing_distributions(extra: str) -> list[str]:
    """The distributions of ``extra`` that are not installed here (found without importing them)."""
    return [dist for module, dist in EXTRAS[extra].items() if importlib.util.find_spec(module) is None]


def missing_extra_message(module: str, purpose: str) -> str | None:
    """"PURPOSE needs DIST, which the EXTRA extra installs: pip install ..." for an optional
    ``module``; None for a module of no extra."""
    extra = extra_of(module)
    if extra is None:
        return None
    dist = EXTRAS[extra][module.split(".")[0]]
    return f"{purpose} needs {dist}, which the {extra} extra installs: {install_command(extra)}"


def import_optional(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)`` for a library of an extra; if it is not installed, a
    MissingExtraError saying that ``purpose`` (e.g. "reading Parquet") needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the library is there, something it imports is not: its own error says what
        raise MissingExtraError(missing_extra_message(module, purpose), name=exc.name) from None
