"""diff_transformer.files: one way to write a file atomically, used by every writer."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from diff_transformer.files import ending_signals_to_catch, write_atomically, write_text_atomically


def test_replaces_the_file_whole_with_the_usual_mode(tmp_path):
    target = tmp_path / "deep" / "report.md"
    write_text_atomically(target, "first")
    write_text_atomically(target, "second")
    assert target.read_text() == "second"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in target.parent.iterdir()] == ["report.md"]  # no temporary file left


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "metrics.json"
    target.write_text("old")
    seen: list[Path] = []

    def fails(tmp: Path) -> None:
        seen.append(tmp)
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_atomically(target, fails)
    assert target.read_text() == "old"
    assert seen[0].parent == tmp_path and seen[0].suffix == ".json"  # beside the target, its suffix kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_a_job_catches_sighup_only_where_it_is_not_ignored():
    previous = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert set(ending_signals_to_catch()) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: closing the terminal keeps it running
        assert set(ending_signals_to_catch()) == {signal.SIGINT, signal.SIGTERM}
    finally:
        signal.signal(signal.SIGHUP, previous)
