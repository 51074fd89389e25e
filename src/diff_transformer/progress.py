"""Progress output for long loops: a tqdm bar on a terminal, plain lines in a log file or pipe.

    for item in progress(items, desc="needle diff"):          # like tqdm(items, ...)
        ...
    with progress(total=steps, desc="diff", unit="step") as bar:
        bar.update(1); bar.set_postfix({"loss": "2.31"})

When stderr is not a terminal a tqdm bar writes every carriage-return redraw into the log; here
it is replaced by one line at most every ``interval`` seconds (30) or 10% of the total, whichever
comes first, plus a final line:

    diff: 120/1000 step (12%), 4.1 step/s, 29 s elapsed, ~3.6 min left; loss=2.31 val=2.40
    tokenizing: 2.1 MB/9.8 MB (21%), 1.0 MB/s, 2 s elapsed, ~8 s left       (unit_scale=True)

The rate and the time left appear once MIN_RATE_SECONDS have passed: a rate measured over a
few milliseconds says nothing.

DIFF_TRANSFORMER_PROGRESS=bar|lines|off overrides the choice.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterable, TextIO

ENV = "DIFF_TRANSFORMER_PROGRESS"
MIN_RATE_SECONDS = 1.0
SI_PREFIXES = ("", "k", "M", "G", "T", "P")


def _mode(stream: TextIO) -> str:
    chosen = os.environ.get(ENV, "").strip().lower()
    if chosen in ("bar", "lines", "off"):
        return chosen
    try:
        return "bar" if stream.isatty() else "lines"
    except (AttributeError, ValueError):  # a closed or unusual stream
        return "lines"


def progress(iterable: Iterable | None = None, *, total: int | float | None = None, desc: str = "", unit: str = "it",
             disable: bool = False, leave: bool = True, initial: int = 0, file: TextIO | None = None,
             interval: float = 30.0, **tqdm_options: Any):
    """A tqdm bar when ``file`` (default stderr) is a terminal, else a :class:`LineProgress`."""
    stream = file if file is not None else sys.stderr
    mode = "off" if disable else _mode(stream)
    if mode == "bar":
        try:
            from tqdm.auto import tqdm
        except ModuleNotFoundError:  # the core without the train extra (bench): plain lines
            mode = "lines"
    if mode == "bar":
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, initial=initial, file=stream,
                    **tqdm_options)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial, file=stream,
                        interval=interval, disable=mode == "off", unit_scale=bool(tqdm_options.get("unit_scale")))


class LineProgress:
    """tqdm's interface (iteration, update, set_postfix, set_description, close, with) printing a
    plain line every ``interval`` seconds or every 10% of ``total``, and one at the end.
    ``unit_scale`` writes counts and rates with SI prefixes (2.1 MB, 1.0 MB/s), as tqdm's option."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | float | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, file: TextIO | None = None, interval: float = 30.0,
                 disable: bool = False, unit_scale: bool = False, clock=time.monotonic) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.initial = initial
        self.file, self.interval, self.disable, self.unit_scale = file, interval, disable, unit_scale
        self.postfix = ""
        self._clock = clock
        self._start = self._last_time = clock()
        self._last_n = initial
        self._closed = False

    # --- tqdm's interface -------------------------------------------------------------------------

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int | float = 1) -> None:
        self.n += n
        now = self._clock()
        step = (self.total or 0) / 10
        if now - self._last_time >= self.interval or (step and self.n - self._last_n >= step):
            self._emit(now)

    def set_postfix(self, postfix: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(postfix or {}), **kwargs}
        self.postfix = " ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        pass

    def write(self, text: str) -> None:
        if not self.disable:
            print(text, file=self.file or sys.stderr, flush=True)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.n != self._last_n or self.n == self.initial:
            self._emit(self._clock())

    # --- the line ---------------------------------------------------------------------------------

    def line(self, now: float | None = None) -> str:
        now = self._clock() if now is None else now
        elapsed = now - self._start
        done = self.n - self.initial
        if self.unit_scale:
            count = f"{_si(self.n)}{self.unit}"
            parts = [f"{count}/{_si(self.total)}{self.unit}" if self.total else count]
        else:
            count = f"{_number(self.n)}/{_number(self.total)}" if self.total else _number(self.n)
            parts = [f"{count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        timed = elapsed >= MIN_RATE_SECONDS and done > 0
        if timed:
            rate = done / elapsed
            parts.append(f"{_si(rate)}{self.unit}/s" if self.unit_scale else f"{_rate(rate)} {self.unit}/s")
        parts.append(f"{_duration(elapsed)} elapsed")
        if timed and self.total and self.n < self.total:
            parts.append(f"~{_duration((self.total - self.n) * elapsed / done)} left")
        text = ", ".join(parts)
        prefix = f"{self.desc}: " if self.desc else ""
        return prefix + text + (f"; {self.postfix}" if self.postfix else "")

    def _emit(self, now: float) -> None:
        self._last_time, self._last_n = now, self.n
        if not self.disable:
            print(self.line(now), file=self.file or sys.stderr, flush=True)


def _number(x: int | float | None) -> str:
    if x is None:
        return "?"
    return f"{x:,}" if float(x).is_integer() else f"{x:,.1f}"


def _rate(x: float) -> str:
    """3 significant digits, whole numbers with thousands separators from 1,000 on (never 1e+04)."""
    return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"


def _si(x: float | None) -> str:
    """x with an SI prefix and a space before the unit that follows: 2140000 -> "2.14 M"."""
    if x is None:
        return "? "
    power = 0
    while abs(x) >= 999.5 and power < len(SI_PREFIXES) - 1:
        x, power = x / 1000, power + 1
    return f"{x:.3g} {SI_PREFIXES[power]}"


def _duration(seconds: float) -> str:
    """Seconds up to two minutes, minutes up to two hours, then hours: "93 s", "3.6 min", "86.1 h"."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
