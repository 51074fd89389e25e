"""The documentation runs: every Python code block of README.md and docs/*.md is executed, the
blocks of one file in order in one namespace (as a reader would paste them), in an empty
temporary directory (README's in the fast tier, the others' in the full one); every command
line the README's first lines give exists in the Makefile; and the config reference of
docs/training.md names every field of the sections it shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


def test_the_block_finder_sees_every_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a + 1\n```\n")
    assert python_blocks(page) == ["a = 1\n", "b = a + 1\n"]


def run_python_blocks(path: Path, directory: Path, monkeypatch) -> None:
    monkeypatch.chdir(directory)
    namespace: dict = {"__name__": f"docs.{path.stem}"}
    for i, block in enumerate(python_blocks(path)):
        exec(compile(block, f"{path.relative_to(REPO)} (python block {i + 1})", "exec"), namespace)


def test_readme_python_blocks_run_and_leave_its_commands_room(tmp_path, monkeypatch):
    """README's blocks (a few seconds) run in the fast tier. What they write is not where the README's
    commands then train: `train` refuses a run.out_dir that holds a checkpoint."""
    readme = REPO / "README.md"
    assert python_blocks(readme)
    run_python_blocks(readme, tmp_path, monkeypatch)
    out_dirs = re.findall(r"run\.out_dir=(\S+)", readme.read_text(encoding="utf-8"))
    assert out_dirs and not [d for d in out_dirs if (tmp_path / d).exists()]


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS[1:] if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch):
    run_python_blocks(path, tmp_path, monkeypatch)


def test_readme_opens_with_the_two_commands_a_fresh_machine_needs():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()[:12]
    targets = set(re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    commands = [line.split("#")[0].split() for line in lines if line.startswith("make ")]
    assert [c[1] for c in commands][:2] == ["demo", "test"] and {"demo", "test"} <= targets
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_config_reference_names_every_field_of_every_section_it_shows():
    """docs/training.md's annotated config (the YAML block that starts ``name: tiny``) lists each
    section's fields: one added to a section's dataclass and not to the reference fails here."""
    import dataclasses

    import yaml

    from diff_transformer.experiments.config import (
        CompareConfig, ConvertConfig, GroundedConfig, LongContextConfig, RetrievalConfig, ScalingConfig,
    )
    from diff_transformer.train.config import DataConfig, OptimConfig, RunConfig

    page = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(name: tiny\n.*?)^```", page, re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1
    reference = yaml.safe_load(blocks[0])
    sections = {"data": DataConfig, "optim": OptimConfig, "run": RunConfig, "compare": CompareConfig,
                "retrieval": RetrievalConfig, "grounded": GroundedConfig, "long_context": LongContextConfig,
                "scaling": ScalingConfig, "convert": ConvertConfig}
    for section, settings in sections.items():
        # `enabled`: where a section is off unless present, its presence says it (the reference shows it where not)
        fields = {field.name for field in dataclasses.fields(settings)} - {"enabled"}
        assert set(reference[section]) - {"enabled"} == fields, section
