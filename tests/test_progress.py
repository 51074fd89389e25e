"""Progress output: a tqdm bar on a terminal, periodic plain lines in a file or pipe."""

from __future__ import annotations

import io

import pytest

from diff_transformer.progress import ENV, LineProgress, progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_a_line_every_tenth_and_at_the_end():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(total=50, desc="diff", unit="step", file=out, clock=clock)
    for _ in range(50):
        clock.now += 0.1
        bar.update(1)
    bar.set_postfix({"loss": "2.31"})
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 10  # 5, 10, ..., 50: each 10%; close adds nothing new
    assert lines[0] == "diff: 5/50 step (10%), 0 s elapsed"  # half a second: too soon for a rate
    assert lines[3] == "diff: 20/50 step (40%), 10 step/s, 2 s elapsed, ~3 s left"
    assert lines[-1].startswith("diff: 50/50 step (100%)")


def test_a_slow_loop_gets_a_line_every_interval():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(total=10_000, desc="run", unit="step", file=out, clock=clock, interval=30)
    for _ in range(5):
        clock.now += 31
        bar.update(1)
    bar.set_postfix(loss="1.50")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 5  # one per 30 s; the last update was already printed
    assert lines[2] == "run: 3/10,000 step (0%), 0.0323 step/s, 93 s elapsed, ~86.1 h left"  # 9,997 × 31 s
    bar = LineProgress(total=10, desc="x", file=out, clock=clock)
    bar.update(1)
    bar.close()  # the final count is printed even below 10% and before the interval
    assert out.getvalue().splitlines()[-1].startswith("x: 1/10 it (10%)")


def test_no_rate_before_a_second_has_passed_then_sane_figures():
    """A fast loop's first lines carry no rate or time left (over milliseconds they are noise: 2.09e+10 B/s,
    ~0 s left); later rates are plain numbers with thousands separators, durations in minutes or hours."""
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(total=200_000, desc="fast", unit="tok", file=out, clock=clock)
    clock.now = 0.004
    bar.update(100_000)
    clock.now = 4.0
    bar.update(50_000)
    assert out.getvalue().splitlines() == [
        "fast: 100,000/200,000 tok (50%), 0 s elapsed",
        "fast: 150,000/200,000 tok (75%), 37,500 tok/s, 4 s elapsed, ~1 s left",  # 150,000 / 4 s; 50,000 left
    ]
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(total=10, desc="slow", unit="step", file=out, clock=clock)
    clock.now = 600.0
    bar.update(1)
    assert out.getvalue().strip() == "slow: 1/10 step (10%), 0.00167 step/s, 10.0 min elapsed, ~90.0 min left"


def test_unit_scale_writes_si_prefixes():
    out, clock = io.StringIO(), FakeClock()
    bar = LineProgress(total=2_140_000, desc="tokenizing", unit="B", unit_scale=True, file=out, clock=clock)
    clock.now = 2.0
    bar.update(1_000_000)
    assert out.getvalue().strip() == "tokenizing: 1 MB/2.14 MB (47%), 500 kB/s, 2 s elapsed, ~2 s left"
    assert isinstance(progress(total=3, unit="B", unit_scale=True, file=io.StringIO()), LineProgress)
    assert progress(total=3, unit="B", unit_scale=True, file=io.StringIO()).unit_scale


def test_iterating_and_resuming_from_an_initial_count():
    out, clock = io.StringIO(), FakeClock()
    assert list(LineProgress(range(3), desc="items", file=out, clock=clock)) == [0, 1, 2]
    assert out.getvalue().splitlines()[-1].startswith("items: 3/3 it (100%)")
    out = io.StringIO()
    bar = LineProgress(total=10, initial=8, unit="step", file=out, clock=clock)
    clock.now += 2
    bar.update(2)
    assert out.getvalue().strip() == "10/10 step (100%), 1 step/s, 2 s elapsed"  # rate of this run's 2 steps


def test_the_helper_picks_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    from tqdm.auto import tqdm

    monkeypatch.delenv(ENV, raising=False)
    bar = progress(total=3, file=TTY())
    assert isinstance(bar, tqdm)
    bar.close()
    assert isinstance(progress(total=3, file=io.StringIO()), LineProgress)
    monkeypatch.setenv(ENV, "bar")
    bar = progress(total=3, file=io.StringIO())
    assert isinstance(bar, tqdm)
    bar.close()
    monkeypatch.setenv(ENV, "off")
    out = io.StringIO()
    with progress(total=3, file=TTY()) as quiet:
        quiet.update(3)
    assert out.getvalue() == "" and isinstance(quiet, LineProgress) and quiet.disable


@pytest.mark.parametrize("disable", [True, False])
def test_disable_prints_nothing(disable, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    out = io.StringIO()
    for _ in progress(range(4), desc="q", file=out, disable=disable):
        pass
    assert (out.getvalue() == "") == disable
