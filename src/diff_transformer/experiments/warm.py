"""A study's training processes forked from a warm interpreter instead of started fresh.

A fresh ``python -m diff_transformer train`` spends about 4 s (2-core machine) importing torch, the
trainer and dynamo (torch.optim imports it at the first step) before its first step: a tenth of a
small study run. The runner starts one :class:`WarmInterpreter` per phase (a Python running
:func:`serve`), with the environment every run of the phase gets. It imports
those modules, runs no tensor operation (so no thread pool exists yet and a fork is safe, as for
multiprocessing's forkserver), and forks one child per command it is sent. Each child is what a fresh
``python -c SCRIPT ARGS`` or ``python -m MODULE ARGS`` would be: its own session, stdin from
/dev/null, the interpreter's stdout and stderr, Python's default SIGINT handler, its exit status by
the same rules (an exception's traceback and 1; ``SystemExit``'s code; killed by a signal: minus it).
It starts with nothing a fresh process would not have: the warm interpreter never builds a model.

Protocol (JSON lines): the runner writes ``{"argv": [...]}`` (the command without ``python``) to the
interpreter's stdin; the interpreter answers on its reply pipe ``{"pid": N}`` for each fork and
``{"pid": N, "status": S}`` when that child ends (``os.waitstatus_to_exitcode``). EOF on stdin: it
exits once its children have.
"""

from __future__ import annotations

import builtins
import json
import os
import select
import signal
import subprocess
import sys
import time
import types
from typing import Mapping

# What every training run imports before its first step (the trainer, its data and checkpoint code, the
# CLI) and torch._dynamo, which torch.optim imports at the first optimizer step.
PRELOAD = ("torch", "torch._dynamo", "diff_transformer.cli", "diff_transformer.cli.train",
           "diff_transformer.train.trainer", "diff_transformer.data", "diff_transformer.checkpoint")


class WarmInterpreter:
    """The runner's side: :meth:`start` forks a child for a command and returns a process object
    with the parts of :class:`subprocess.Popen` the runner uses."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._replies_read, replies_write = os.pipe()
        serve = f"from {__name__} import serve; serve({replies_write})"  # -c: -m would import this twice
        self._process = subprocess.Popen(
            [sys.executable, "-c", serve], stdin=subprocess.PIPE, env=dict(env),
            pass_fds=(replies_write,), start_new_session=True)  # a terminal's Ctrl-C is the runner's
        os.close(replies_write)
        self._buffer = b""
        self._children: dict[int, WarmProcess] = {}  # every child, by pid
        self._forked: list[WarmProcess] = []  # children whose "pid" line was read and not yet returned

    def start(self, command: list[str]) -> WarmProcess:
        """Fork a child for ``command`` (``[sys.executable, "-c" | "-m", ...]``); its process."""
        if not runs_warm(command):
            raise ValueError(f"not a Python -c or -m command: {command[:2]}")
        self._process.stdin.write((json.dumps({"argv": command[1:]}) + "\n").encode())
        self._process.stdin.flush()
        while not self._forked:  # its "pid" line (the interpreter answers in order), past other children's ends
            self._read(block=True)
        return self._forked.pop(0)

    def update(self) -> None:
        """Read what ended since the last call (without waiting)."""
        self._read(block=False)

    def close(self) -> None:
        """No more commands; wait for the interpreter to end (after its children)."""
        if self._process.stdin and not self._process.stdin.closed:
            self._process.stdin.close()
        self._process.wait()
        os.close(self._replies_read)

    def _read(self, block: bool) -> None:
        """Apply the complete reply lines available, in order (waiting for at least one with ``block``):
        a "pid" line is a new child, a "status" line a child's end."""
        while True:
            ready, _, _ = select.select([self._replies_read], [], [], None if block else 0)
            if not ready:
                return
            chunk = os.read(self._replies_read, 65536)
            if not chunk:
                code = self._process.wait()
                raise RuntimeError(f"the warm interpreter that starts the study's runs ended (exit status "
                                   f"{code}); see the messages above")
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                reply = json.loads(line)
                if "status" in reply:
                    self._children[reply["pid"]].returncode = reply["status"]
                else:
                    child = self._children[reply["pid"]] = WarmProcess(reply["pid"], self)
                    self._forked.append(child)
            block = block and not lines


class WarmProcess:
    """A child of the warm interpreter, as the runner sees it (``pid``, ``poll``, ``wait``,
    ``send_signal``, ``returncode``, as :class:`subprocess.Popen`)."""

    def __init__(self, pid: int, interpreter: WarmInterpreter) -> None:
        self.pid, self.returncode, self._interpreter = pid, None, interpreter

    def poll(self) -> int | None:
        if self.returncode is None:
            self._interpreter.update()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # ended meanwhile; its status is on its way
                pass


def runs_warm(command: list[str]) -> bool:
    """Whether ``command`` is this Python running ``-c SCRIPT`` or ``-m MODULE``."""
    return len(command) >= 3 and command[0] == sys.executable and command[1] in ("-c", "-m")


# --- the interpreter's side -------------------------------------------------------------------------


def serve(replies: int) -> None:
    """The warm interpreter: import :data:`PRELOAD`, then fork a child for each request on stdin
    and report its pid and its end on the file descriptor ``replies``."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # in its own session; the runner passes signals on
    requests, buffer, children, closed = sys.stdin.fileno(), b"", set(), False
    while not closed or children:
        ready, _, _ = select.select([] if closed else [requests], [], [], 0.02)
        if ready:
            chunk = os.read(requests, 65536)
            closed = not chunk
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                pid = os.fork()
                if pid == 0:
                    _become(json.loads(line)["argv"], (requests, replies))  # never returns
                children.add(pid)
                os.write(replies, (json.dumps({"pid": pid}) + "\n").encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            os.write(replies, (json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}) + "\n").encode())


def _become(argv: list[str], protocol_fds: tuple[int, int]) -> None:
    """In the forked child: become ``python *argv`` started fresh. Its end (SystemExit, an exception
    or a signal) ends the process as it would end that one: nothing here catches it."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # in place of the requests (stdin)
    for fd in {devnull, *protocol_fds} - {0}:
        os.close(fd)
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    flag, target, *args = argv
    if flag == "-c":
        sys.argv = ["-c", *args]
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)
    else:
        import runpy

        sys.argv = [target, *args]  # runpy puts the module's file first, as python -m does
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    raise SystemExit(0)

