"""`diff-transformer eval NAME` and run_suite, end to end on saved tiny checkpoints."""

import json
import random

import pytest
import torch

from diff_transformer import LanguageModel, ModelConfig
from diff_transformer.cli import main
from diff_transformer.data.synthetic import ICL_WORDS
from diff_transformer.evaluation import EVALUATIONS, NAMES, EvalText, run_suite
from diff_transformer.tokenizer import ByteTokenizer

WORDS = " ".join(random.Random(0).choices(ICL_WORDS, k=4000))


@pytest.fixture(autouse=True)
def _one_thread():
    """Debug-size models run the suite several times faster on one thread than on two (OpenMP
    synchronisation dominates such small matrices); the thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for kind in ("standard", "diff"):
        torch.manual_seed(0)
        model = LanguageModel(ModelConfig.from_preset("debug", attention=kind, max_seq_len=256))
        out[kind] = model.save_pretrained(root / kind, ByteTokenizer())
    text = root / "heldout.txt"
    text.write_text(WORDS)
    return out, text


def test_every_evaluation_has_a_subcommand_and_options_that_parse():
    from diff_transformer.cli import build_parser

    parser = build_parser()
    for name in NAMES:
        args = parser.parse_args(["eval", name, "--checkpoint", "x"])
        assert args.evaluation == name
    args = parser.parse_args(["eval", "quantization", "--checkpoint", "x", "--bits", "8", "4", "--granularity", "head"])
    assert args.bits == [8, 4] and args.granularity == "head"
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "quantization", "--checkpoint", "x", "--granularity", "tensor"])
    assert set(EVALUATIONS) | {"scaling"} == set(NAMES)


@pytest.mark.slow  # evaluations end to end (1.5 s)
def test_eval_command_writes_json_and_png(checkpoints, tmp_path, capsys):
    ckpts, text = checkpoints
    out = tmp_path / "out"
    code = main(["eval", "ar-hit", "--checkpoint", str(ckpts["standard"]), "--checkpoint", str(ckpts["diff"]),
                 "--label", "T", "--label", "D", "--text", str(text), "--out", str(out), "--quick", "--no-progress",
                 "--ngram", "3"])
    assert code == 0
    data = json.loads((out / "ar-hit.json").read_text())
    assert (set(data["models"]) == {"T", "D"} and data["options"]["ngram"] == 3
            and data["models"]["D"]["model"]["attention"] == "diff")
    assert (out / "ar-hit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| D (ours" in printed and "Transformer (paper, 1.4B)" in printed


def test_eval_attention_sink_writes_the_first_token_share_per_layer(checkpoints, tmp_path, capsys):
    ckpts, text = checkpoints
    out = tmp_path / "sink"
    assert main(["eval", "attention-sink", "--checkpoint", str(ckpts["standard"]), "--checkpoint", str(ckpts["diff"]),
                 "--label", "T", "--label", "D", "--text", str(text), "--out", str(out), "--no-progress",
                 "--windows", "3", "--seq-len", "64", "--first-query", "2"]) == 0
    data = json.loads((out / "attention-sink.json").read_text())
    assert data["options"] == {"windows": 3, "seq_len": 64, "batch_size": 4, "first_query": 2}
    for label in ("T", "D"):
        result = data["models"][label]
        assert (result["windows"], result["seq_len"], result["first_query"]) == (3, 64, 2)
        assert len(result["per_layer"]["mean"]) == 2 and len(result["per_window"]["per_layer"]) == 3
    assert (out / "attention-sink.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "| T (3 × 64 tokens) |" in printed and "First-token share, mean over layers: D" in printed
    assert main(["eval", "attention-sink", "--checkpoint", str(ckpts["diff"]), "--out", str(tmp_path / "bad"),
                 "--first-query", "300", "--text", str(text)]) == 2
    assert capsys.readouterr().err.startswith("error: attention-sink cannot run on diff:diff: first_query 300")
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # evaluations end to end (2 s)
def test_eval_reads_every_checkpoint_at_the_context_and_theta_asked(tmp_path):
    """--max-seq-len and --rope-theta apply to every checkpoint: 64-token models read at 128 tokens
    and θ 20,000 give what the same weights saved as 128-token, θ 20,000 models give."""
    text = tmp_path / "heldout.txt"
    text.write_text(WORDS)
    short, wide = [], []
    for kind in ("standard", "diff"):
        torch.manual_seed(0)
        model = LanguageModel(ModelConfig.from_preset("debug", attention=kind, max_seq_len=64))
        with torch.no_grad():  # peaked maps, so that θ (where a key sits) matters to what is read
            for name, p in model.named_parameters():
                if "q_proj" in name or "k_proj" in name:
                    p.normal_(0.0, 0.5)
        short.append(model.save_pretrained(tmp_path / "short" / kind, ByteTokenizer()))
        extended = LanguageModel(ModelConfig.from_preset("debug", attention=kind, max_seq_len=128, rope_theta=20_000.0))
        extended.load_state_dict(model.state_dict())
        wide.append(extended.save_pretrained(tmp_path / "wide" / kind, ByteTokenizer()))

    def position_nll(checkpoints, name, *flags):
        given = [a for c in checkpoints for a in ("--checkpoint", str(c))]
        assert main(["eval", "position-nll", *given, "--label", "T", "--label", "D", "--text", str(text),
                     "--out", str(tmp_path / name), "--quick", "--no-progress", *flags]) == 0
        return json.loads((tmp_path / name / "position-nll.json").read_text())["models"]

    own = position_nll(short, "own")
    read = position_nll(short, "read", "--max-seq-len", "128", "--rope-theta", "20000")
    saved = position_nll(wide, "saved")
    theta_kept = position_nll(short, "kept", "--max-seq-len", "128")
    for label in ("T", "D"):
        assert own[label]["length"] == 64 and read[label]["length"] == 128
        assert (read[label]["model"]["max_seq_len"], read[label]["model"]["rope_theta"]) == (128, 20_000.0)
        assert read[label]["nll"] == pytest.approx(saved[label]["nll"], abs=1e-5)
        assert theta_kept[label]["model"]["rope_theta"] == 10_000.0 and theta_kept[label]["length"] == 128
        assert max(abs(a - b) for a, b in zip(theta_kept[label]["nll"], read[label]["nll"])) > 0.01  # θ matters


def test_bad_input_is_one_error_line(checkpoints, tmp_path, capsys):
    ckpts, _ = checkpoints
    assert main(["eval", "ar-hit", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert main(["eval", "icl", "--checkpoint", str(ckpts["diff"]), "--data", str(tmp_path / "none.jsonl"),
                 "--tasks", "none", "--out", str(tmp_path)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0].startswith("error: ") and "no config.json" in errors[0]
    assert errors[1] == f"error: {tmp_path / 'none.jsonl'}: no such JSONL file"


def test_eval_scaling_command(tmp_path, capsys):
    runs = [{"attention": kind, "params": n, "tokens": 1e9, "seed": seed,
             "loss": 2.0 + 50 * (n * (1.6 if kind == "diff" else 1)) ** -0.3 + 0.002 * (seed - 1)}
            for kind in ("standard", "diff") for n in (1e6, 4e6, 1.6e7, 6.4e7) for seed in (0, 1, 2)]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    assert main(["eval", "scaling", "--results", str(tmp_path / "runs.json"), "--out", str(tmp_path / "eval")]) == 0
    data = json.loads((tmp_path / "eval" / "scaling.json").read_text())
    assert data["matching"]["diff"]["fraction"] == pytest.approx(1 / 1.6, rel=0.02)
    assert data["matching"]["diff"]["identified"] is True
    assert (tmp_path / "eval" / "scaling.png").exists()
    assert "0.62×" in capsys.readouterr().out


@pytest.mark.slow  # every evaluation on two models
def test_run_suite_quick_on_two_models(checkpoints, tmp_path):
    ckpts, _ = checkpoints
    result = run_suite(ckpts, tmp_path, quick=True, text=EvalText([WORDS]), progress=False)
    assert list(result.sections) == list(EVALUATIONS)
    for name in EVALUATIONS:
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert set(data["models"]) == {"standard", "diff"}, (name, data["errors"])
        assert (tmp_path / f"{name}.png").exists()
        assert "paper" in result.sections[name].lower()
    markdown = result.markdown(relative_to=tmp_path)
    assert "![needle](needle.png)" in markdown and "### Multi-needle retrieval" in markdown
    with pytest.raises(ValueError, match="unknown evaluation"):
        run_suite(ckpts, tmp_path, evaluations=["nope"])


def test_report_sections_link_plots_relative_to_the_report(monkeypatch, tmp_path):
    from diff_transformer.evaluation import SuiteResult, report_sections, suite

    seen = {}

    def fake_suite(checkpoints, out_dir, **kwargs):
        seen["out_dir"] = out_dir
        return SuiteResult(sections={"mqar": "table"}, data={"mqar": {"title": "MQAR"}},
                           images={"mqar": out_dir / "mqar.png"})

    monkeypatch.setattr(suite, "run_suite", fake_suite)
    sections = report_sections({"diff": tmp_path / "diff"}, tmp_path)
    assert seen["out_dir"] == tmp_path / "eval"
    assert sections[0].startswith("## ") and "### MQAR\n\ntable" in sections[1] and "(eval/mqar.png)" in sections[1]


def _snapshot(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # an evaluation run three times
def test_an_earlier_result_is_replaced_only_with_overwrite(checkpoints, tmp_path, capsys):
    """eval --out over an earlier result of the same evaluation is refused before any model loads,
    with the files intact; another evaluation adds its result beside it; --overwrite (overwrite=True
    in run_suite) replaces it."""
    from diff_transformer.files import OutputPathError

    ckpts, _ = checkpoints
    out = tmp_path / "eval"
    argv = ["eval", "outliers", "--checkpoint", str(ckpts["diff"]), "--out", str(out), "--quick", "--no-progress"]
    assert main([*argv, "--label", "first"]) == 0
    capsys.readouterr()
    before = _snapshot(tmp_path)
    assert main([*argv, "--label", "second"]) == 2
    assert capsys.readouterr().err == (f"error: {out}: already holds an earlier result (outliers.json, outliers.png); "
                                       "pass --overwrite (overwrite=True) to replace it, or choose another --out\n")
    with pytest.raises(OutputPathError, match="already holds an earlier result"):
        run_suite({"second": ckpts["diff"]}, out, evaluations=["outliers"], quick=True, progress=False)
    assert _snapshot(tmp_path) == before
    assert main([*argv, "--label", "second", "--overwrite"]) == 0
    assert set(json.loads((out / "outliers.json").read_text())["models"]) == {"second"}
    run_suite({"third": ckpts["diff"]}, out, evaluations=["outliers"], quick=True, progress=False, overwrite=True)
    assert set(json.loads((out / "outliers.json").read_text())["models"]) == {"third"}


def test_compare_replaces_the_results_of_its_own_earlier_evaluations(monkeypatch, tmp_path):
    """compare's evaluations go into OUT/eval, which is the comparison's own: a rerun replaces them."""
    import types

    import diff_transformer.experiments as experiments
    from diff_transformer.evaluation import report_sections, suite

    seen = {}

    def fake_compare(config, out, **kwargs):
        seen.update(kwargs["evaluation"].keywords)
        return types.SimpleNamespace(wall_seconds=1.0)

    monkeypatch.setattr(experiments, "compare", fake_compare)  # what the command calls
    assert main(["compare", "--out", str(tmp_path / "cmp"), "--steps", "1"]) == 0
    assert seen["overwrite"] is True
    monkeypatch.setattr(suite, "run_suite", lambda checkpoints, out_dir, **kwargs: seen.update(suite=kwargs) or
                        suite.SuiteResult())
    report_sections({"diff": tmp_path / "diff"}, tmp_path)
    assert seen["suite"]["overwrite"] is True


@pytest.mark.slow  # evaluations end to end (5 s)
@pytest.mark.parametrize("failing", ["plot", "json"])
def test_an_evaluations_json_and_plot_appear_together_or_not_at_all(failing, checkpoints, tmp_path, capsys,
                                                                   monkeypatch):
    """A disk that fills while an evaluation writes its result: one error line naming the file, and
    neither file of the new result, whichever fails; an earlier result replaced with --overwrite is
    left whole; a new output directory is not left behind."""
    import errno

    from matplotlib.figure import Figure

    from diff_transformer.evaluation import output

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    ckpts, _ = checkpoints
    out = tmp_path / "eval"
    argv = ["eval", "outliers", "--checkpoint", str(ckpts["diff"]), "--out", str(out), "--quick", "--no-progress"]
    failing_file = out / f"outliers.{'png' if failing == 'plot' else 'json'}"
    with monkeypatch.context() as patch:
        patch.setattr(*((Figure, "savefig") if failing == "plot" else (output, "_json_text")), full_disk)
        assert main(argv) == 2
        assert capsys.readouterr().err == f"error: {failing_file}: No space left on device\n"
        assert not out.exists()
    assert main(argv) == 0
    capsys.readouterr()
    before = _snapshot(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(*((Figure, "savefig") if failing == "plot" else (output, "_json_text")), full_disk)
        assert main([*argv, "--overwrite"]) == 2
    assert capsys.readouterr().err == f"error: {failing_file}: No space left on device\n"
    assert _snapshot(tmp_path) == before  # the earlier pair, byte for byte, and no temporary


def test_a_result_without_a_plot_replaces_the_earlier_plot_too(checkpoints, tmp_path):
    """In the suite, an evaluation that could run on no model writes its JSON (the errors) and no
    plot: replacing an earlier result, the earlier plot goes too, so the two never disagree."""
    ckpts, _ = checkpoints
    run_suite({"diff": ckpts["diff"]}, tmp_path, evaluations=["mqar"], quick=True, progress=False)
    assert (tmp_path / "mqar.png").exists()
    run_suite({"diff": ckpts["diff"]}, tmp_path, evaluations=["mqar"], quick=True, progress=False, overwrite=True,
              options={"mqar": {"seq_lens": [100_000]}})
    data = json.loads((tmp_path / "mqar.json").read_text())
    assert data["models"] == {} and list(data["errors"]) == ["diff"]
    assert not (tmp_path / "mqar.png").exists()
