"""The diff-transformer command: --help of every subcommand, info, generate."""

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


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "diff_transformer", "info"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "1.4b" in result.stdout and "13.1b" in result.stdout


@pytest.mark.parametrize("kind", ["diff", "diff_symmetric"])
def test_info_on_a_checkpoint(kind, tmp_path, capsys):
    model = LanguageModel(ModelConfig.from_preset("debug", attention=kind, vocab_size=257))
    model.save_pretrained(tmp_path / "ckpt")
    assert main(["info", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert f'"attention": "{kind}"' in out
    assert "lambda per layer: " + " ".join(f"{x:.3f}" for x in model.lambdas()) in out


def test_generate_streams_the_greedy_continuation(tmp_path, capsys):
    model = LanguageModel(ModelConfig.from_preset("debug", vocab_size=257))
    model.save_pretrained(tmp_path / "ckpt", tokenizer=ByteTokenizer())
    assert main(["generate", str(tmp_path / "ckpt"), "--prompt", "To be", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    expected = model.generate([list(b"To be")], 12, temperature=0, stop_tokens=[256])[0]
    assert out == "To be" + ByteTokenizer().decode(expected) + "\n"


def test_generate_without_tokenizer_is_a_clear_error(tmp_path, capsys):
    LanguageModel(ModelConfig.from_preset("debug", vocab_size=257)).save_pretrained(tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt")]) == 2
    assert "holds no tokenizer; pass --tokenizer" in capsys.readouterr().err
