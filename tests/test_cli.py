"""The diff-transformer command: --help of every subcommand, info, generate."""

import os
import subprocess
import sys

import pytest

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.cli import build_parser, main
from diff_transformer.tokenizer import ByteTokenizer


def subcommands() -> list[str]:
    parser = build_parser()
    return list(parser._subparsers._group_actions[0].choices)


@pytest.mark.parametrize("name", subcommands())
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: diff-transformer {name}" in capsys.readouterr().out


@pytest.mark.slow  # a subprocess per command: torch starts in each
def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "diff_transformer", "info"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "1.4b" in result.stdout and "13.1b" in result.stdout and "GDA (r)" in result.stdout


@pytest.mark.parametrize("kind", ["diff", "diff_symmetric", "gda"])
def test_info_on_a_checkpoint(kind, tmp_path, capsys):
    fields = {"gda_ratio": 2, "n_heads": 4} if kind == "gda" else {}
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind, vocab_size=257, **fields))
    model.save_pretrained(tmp_path / "ckpt")
    assert main(["info", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert f'"attention": "{kind}"' in out
    assert "lambda per layer: " + " ".join(f"{x:.3f}" for x in model.lambdas()) in out
    if kind == "gda":
        assert "heads: 4 signal, 2 noise (2 signal per noise head), 2 key/value groups, d = 8" in out


def test_generate_streams_the_greedy_continuation(tmp_path, capsys):
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))
    model.save_pretrained(tmp_path / "ckpt", tokenizer=ByteTokenizer())
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "To be", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    expected = model.generate([list(b"To be")], 12, temperature=0, stop_tokens=[256])[0]
    assert out == "To be" + ByteTokenizer().decode(expected) + "\n"


def test_generate_without_tokenizer_is_a_clear_error(tmp_path, capsys):
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt")]) == 2
    assert "holds no tokenizer; pass --tokenizer" in capsys.readouterr().err


def test_generate_without_max_new_tokens_fills_what_the_context_leaves(tmp_path, capsys):
    """The default (200) is cut to what fits after the prompt; an explicit count that does not fit is refused."""
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))  # 128 tokens of context
    model.save_pretrained(tmp_path / "ckpt", tokenizer=ByteTokenizer())
    prompt = "x" * 100
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", prompt, "--temperature", "0"]) == 0
    expected = model.generate([list(prompt.encode())], 28, temperature=0, stop_tokens=[256])[0]
    assert capsys.readouterr().out == prompt + ByteTokenizer().decode(expected) + "\n"
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", prompt, "--max-new-tokens", "29"]) == 2
    assert "at most 28 fit after this prompt" in capsys.readouterr().err


@pytest.mark.parametrize("argv, keeps_note", [
    ([], True), (["--jobs", "1", "--resume"], True),
    (["--steps", "4"], False), (["--seeds", "1"], False), (["--set", "optim.lr=1e-3"], False),
    (["--set", "run.steps=4", "--set", "compare.budget_note=mine"], True),
], ids=["defaults", "jobs-resume", "steps", "seeds", "set", "own-note"])
def test_compare_keeps_the_config_budget_note_only_for_the_config_budget(argv, keeps_note, tmp_path, monkeypatch):
    """tiny.yaml's note says "1,048 steps"; a report of `compare --steps 4` must not repeat it."""
    import types

    import diff_transformer.experiments as experiments

    seen = {}

    def fake_compare(config, out, **options):
        seen["note"] = config.compare.budget_note
        return types.SimpleNamespace(wall_seconds=0.0)

    monkeypatch.setattr(experiments, "compare", fake_compare)  # what the command calls
    assert main(["compare", "--out", str(tmp_path / "cmp"), *argv]) == 0
    shipped = experiments.load_experiment("tiny").compare.budget_note
    assert "1,048 steps" in shipped
    expected = ("mine" if "compare.budget_note=mine" in argv else shipped) if keeps_note else ""
    assert seen["note"] == expected


def test_generate_takes_the_shipped_tokenizer_by_name(tmp_path, capsys):
    """--tokenizer default (the shipped BPE) was accepted by the parser but not found when loaded."""
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=8192)).save_pretrained(tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt"), "--tokenizer", "default", "--prompt", "To be",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("To be")


@pytest.mark.parametrize("command", ["train", "compare"])
def test_help_lists_every_shipped_config(command, capsys):
    """Derived from the configs folder: a config added there is listed without a hand-kept list."""
    from diff_transformer.train.config import CONFIG_DIR

    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    listed = help_text.split("a shipped one (", 1)[1].split(")", 1)[0].split(", ")
    names = {name[: -len(".yaml")] for name in os.listdir(CONFIG_DIR) if name.endswith(".yaml")}
    assert len(names) >= 11 and sorted(listed) == sorted(names)
