"""A light install: the core (the op, MultiheadDiffAttention, ModelConfig, LanguageModel's forward,
generate, save and load) runs with torch, numpy and safetensors alone; the rest comes with an extra,
and a command whose extra is missing says which one to install (exit 2), before any work."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diff_transformer.cli import main
from diff_transformer.extras import EXTRAS, MissingExtraError, import_optional

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter where every optional library (and a few that come with them) is absent:
# sys.modules[name] = None makes `import name` raise ImportError and find_spec(name) return None.
CORE_SCRIPT = """
import sys
ABSENT = {absent!r}
for name in ABSENT:
    sys.modules[name] = None

import torch
from diff_transformer import LanguageModel, ModelConfig, MultiheadDiffAttention, diff_attention

torch.manual_seed(0)
attn = MultiheadDiffAttention(64, 2, num_kv_heads=1)
x = torch.randn(2, 9, 64, requires_grad=True)
attn(x).sum().backward()
q = torch.randn(1, 2, 5, 8)
diff_attention(q, q, q[:, :1], q[:, :1], torch.randn(1, 1, 5, 16), torch.tensor(0.5)).sum()
for kind in ("diff", "standard"):
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind))
    tokens = torch.randint(0, model.config.vocab_size, (2, 17))
    logits, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    out = model.generate([[1, 2, 3]], max_new_tokens=4, temperature=0)
    model.save_pretrained(sys.argv[1] + "/" + kind)
    loaded = LanguageModel.from_pretrained(sys.argv[1] + "/" + kind)
    assert torch.equal(loaded(tokens[:, :-1])[0], logits.detach()), kind
    assert loaded.generate([[1, 2, 3]], max_new_tokens=4, temperature=0) == out
optional = sorted(name for name in sys.modules if name.split(".")[0] in ABSENT and sys.modules[name] is not None)
print("ok", optional)
"""

ABSENT = sorted({module for modules in EXTRAS.values() for module in modules} | {"datasets", "pandas", "zstandard"})


def run_core(tmp_path: Path, absent: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CORE_SCRIPT.format(absent=absent), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a subprocess without the extras
def test_the_core_runs_with_torch_numpy_and_safetensors_alone(tmp_path):
    result = run_core(tmp_path, ABSENT)
    assert result.returncode == 0 and result.stdout.strip() == "ok []", result.stderr[-2000:]


@pytest.mark.slow
def test_the_core_check_sees_a_planted_optional_import(tmp_path):
    """The check above fails when a core module needs an optional library: here the model's
    ``generate`` made to import tqdm, as an eager ``from tqdm import tqdm`` would."""
    planted = CORE_SCRIPT.replace("import torch\n", "import torch\nimport diff_transformer.generation as g\n"
                                  "real = g.generate\n"
                                  "def generate(*a, **k):\n    import tqdm\n    return real(*a, **k)\n"
                                  "g.generate = generate\n", 1)
    result = subprocess.run([sys.executable, "-c", planted.format(absent=ABSENT), str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "tqdm" in result.stderr


def test_the_extras_name_the_libraries_pyproject_declares():
    """extras.EXTRAS (what the command checks and names) and pyproject.toml's optional
    dependencies list the same distributions; the core depends on torch, numpy, safetensors only;
    constraints.txt pins each of them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name = lambda requirement: re.split(r"[<>=\[; ]", requirement, maxsplit=1)[0]  # noqa: E731
    assert sorted(name(r) for r in project["dependencies"]) == ["numpy", "safetensors", "torch"]
    optional = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert sorted(name(r) for r in optional[extra]) == sorted(modules.values()), extra
    assert "diff-transformer[train,kernels,hf]" in optional["dev"]  # `make test` and `make demo` install .[dev]
    pinned = {line.split("==")[0] for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line}
    assert {d for modules in EXTRAS.values() for d in modules.values()} <= pinned


@pytest.mark.slow  # new processes with a package hidden (10 s)
@pytest.mark.parametrize("absent", [["pyarrow"], ["yaml", "scipy"]])
def test_a_command_without_its_extra_names_it_before_any_work(absent, tmp_path, capsys, monkeypatch):
    for module in absent:
        monkeypatch.setitem(sys.modules, module, None)
    (tmp_path / "text.txt").write_text("some text\n")
    out = tmp_path / "data"
    assert main(["prepare", str(tmp_path / "text.txt"), "--out", str(out), "--tokenizer", "bytes"]) == 2
    names = ", ".join(EXTRAS["train"][m] for m in absent)
    verb = "is" if len(absent) == 1 else "are"
    assert capsys.readouterr().err == (f"error: diff-transformer prepare needs the train extra, and {names} {verb} not "
                                       f"installed: pip install 'diff-transformer[train]'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.txt"]
    assert main(["info"]) == 0  # a command of the core alone


def test_a_library_of_an_extra_missing_later_is_named_with_its_extra(capsys, monkeypatch, tmp_path):
    """A library not checked up front (another extra's) met during the command: one line naming
    it and its extra, exit 2 (not an unexpected error)."""
    import diff_transformer.cli.info as info

    def needs_transformers(args):
        import transformers  # noqa: F401

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(info, "run", needs_transformers)  # the parser takes the module's run when it is built
    assert main(["info"]) == 2
    assert capsys.readouterr().err == ("error: diff-transformer info needs transformers, which the hf extra installs: "
                                       "pip install 'diff-transformer[hf]'\n")


def test_import_optional_names_the_purpose_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MissingExtraError, match=re.escape(
            "reading Parquet needs pyarrow, which the train extra installs: pip install 'diff-transformer[train]'")):
        import_optional("pyarrow", "reading Parquet")
    assert issubclass(MissingExtraError, ImportError)
