"""A study's training processes forked from a warm interpreter (experiments.warm): each child behaves
as the same command started fresh, which is the oracle here (``subprocess.run`` of it)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from diff_transformer.experiments.warm import PRELOAD, WarmInterpreter, runs_warm
from test_train import byte_dataset, debug_data  # noqa: F401  (byte_dataset is a fixture)

# What a process can tell of how it was started, written as JSON to the file its first argument names.
REPORT = """
import json, os, sys
stdin = sys.stdin.read()
json.dump({"argv": sys.argv[1:], "name": __name__, "session_leader": os.getsid(0) == os.getpid(),
           "stdin": stdin, "env": os.environ.get("WARM_TEST", ""),
           "sigint": str(__import__("signal").getsignal(2))}, open(sys.argv[1], "w"))
"""

ENDINGS = {  # a script -> how it ends
    "falls off its end": "x = 1",
    "SystemExit(3)": "raise SystemExit(3)",
    "SystemExit('a message')": "raise SystemExit('a message')",
    "an exception": "raise ValueError('broken')",
    "SIGTERM, no handler": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
    "SIGINT, Python's handler": "import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(5)",
}


@pytest.fixture(scope="module")
def modules(tmp_path_factory):
    """A folder on the path of both kinds of process, with a module that reports how it was started."""
    folder = tmp_path_factory.mktemp("modules")
    (folder / "report_module.py").write_text(REPORT)
    return folder


@pytest.fixture(scope="module")
def warm(modules):
    interpreter = WarmInterpreter(environment(modules))
    yield interpreter
    interpreter.close()


def environment(modules) -> dict[str, str]:
    return {**os.environ, "WARM_TEST": "set", "PYTHONPATH": os.pathsep.join(
        [str(modules), *filter(None, [os.environ.get("PYTHONPATH")])])}


def fresh(command: list[str], modules) -> subprocess.CompletedProcess:
    """The oracle: ``command`` in a fresh process, as the runner starts one, with what the warm interpreter
    imports imported first (dynamo, for one, makes an uncaught KeyboardInterrupt exit 1, not -SIGINT)."""
    if command[1] == "-c":
        command = [*command[:2], f"import {', '.join(PRELOAD)}\n{command[2]}", *command[3:]]
    return subprocess.run(command, capture_output=True, text=True, env=environment(modules),
                          stdin=subprocess.DEVNULL, start_new_session=True, timeout=120)


def test_a_forked_child_is_started_as_the_fresh_process_would_be(warm, modules, tmp_path):
    for flag, target in (("-c", REPORT), ("-m", "report_module")):
        command = [sys.executable, flag, target, str(tmp_path / f"{flag}-warm.json"), "an argument"]
        child = warm.start(command)
        assert child.wait(timeout=60) == 0
        command[3] = str(tmp_path / f"{flag}-fresh.json")
        assert fresh(command, modules).returncode == 0
        seen, expected = (json.loads((tmp_path / f"{flag}-{k}.json").read_text()) for k in ("warm", "fresh"))
        expected["argv"][0] = seen["argv"][0]  # each names its own file
        assert seen == expected
        assert seen["name"] == "__main__" and seen["session_leader"] and seen["stdin"] == ""
        assert seen["env"] == "set" and seen["argv"][1] == "an argument"
        assert "default_int_handler" in seen["sigint"]


@pytest.mark.slow  # a fresh process for each, importing torch
@pytest.mark.parametrize("ending", ENDINGS)
def test_a_forked_child_ends_with_the_fresh_processs_exit_status(ending, warm, modules):
    command = [sys.executable, "-c", ENDINGS[ending]]
    expected = fresh(command, modules).returncode
    child = warm.start(command)
    assert child.wait(timeout=60) == expected
    assert expected == {"falls off its end": 0, "SystemExit(3)": 3, "SystemExit('a message')": 1,
                        "an exception": 1, "SIGTERM, no handler": -signal.SIGTERM,
                        "SIGINT, Python's handler": 1}[ending]


def test_a_childs_output_goes_where_the_interpreters_went(capfd):
    interpreter = WarmInterpreter(os.environ)  # started here: its stdout and stderr are this test's
    try:
        child = interpreter.start([sys.executable, "-c", "print('out'); raise ValueError('broken')"])
        assert child.wait(timeout=60) == 1
    finally:
        interpreter.close()
    out, err = capfd.readouterr()
    assert out == "out\n" and "Traceback" in err and err.endswith("ValueError: broken\n")


def test_signals_reach_the_child_and_the_ends_of_several_are_read_in_any_order(warm, tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    first, second, quick = warm.start(sleeper), warm.start(sleeper), warm.start([sys.executable, "-c", "x = 1"])
    assert len({first.pid, second.pid, quick.pid}) == 3
    assert quick.wait(timeout=60) == 0 and first.poll() is None and second.poll() is None
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=60) == -signal.SIGTERM and first.poll() is None
    first.send_signal(signal.SIGINT)  # Python's handler: KeyboardInterrupt (1 once dynamo is imported)
    assert first.wait(timeout=60) == 1
    third = warm.start(sleeper)
    with pytest.raises(subprocess.TimeoutExpired):
        third.wait(timeout=0.2)
    third.send_signal(signal.SIGKILL)
    assert third.wait(timeout=60) == -signal.SIGKILL


def test_only_a_python_c_or_m_command_is_forked():
    assert runs_warm([sys.executable, "-m", "diff_transformer", "train"])
    assert runs_warm([sys.executable, "-c", "pass"])
    assert not runs_warm(["torchrun", "-m", "x"]) and not runs_warm([sys.executable, "script.py"])


def test_an_interpreter_that_cannot_start_says_so(tmp_path):
    interpreter = WarmInterpreter({**os.environ, "PYTHONPATH": "", "PYTHONNOUSERSITE": "1",
                                   "PYTHONSAFEPATH": "1", "PYTHONHOME": str(tmp_path)})  # no standard library
    with pytest.raises(RuntimeError, match=r"the warm interpreter .* ended \(exit status [1-9]"):
        interpreter.start([sys.executable, "-c", "pass"])
    interpreter.close()


@pytest.mark.slow  # two short training runs
def test_a_forked_training_run_equals_the_fresh_one_to_the_bit(warm, modules, byte_dataset, tmp_path):  # noqa: F811
    summaries = []
    for how in ("warm", "fresh"):
        config = tmp_path / f"{how}.yaml"
        config.write_text(yaml.safe_dump(debug_data(byte_dataset, tmp_path / how)))
        command = [sys.executable, "-m", "diff_transformer", "train", "--config", str(config), "--quiet"]
        started = time.monotonic()
        code = warm.start(command).wait(timeout=300) if how == "warm" else fresh(command, modules).returncode
        assert code == 0, how
        summaries.append(json.loads((tmp_path / how / "summary.json").read_text()))
        print(how, f"{time.monotonic() - started:.1f} s")
    warm_run, fresh_run = summaries
    assert warm_run["final_val_loss"] == fresh_run["final_val_loss"]
    assert warm_run["steps"] == fresh_run["steps"] == 6


def test_the_runner_forks_only_where_no_gpu_is_visible(monkeypatch, tmp_path):
    """CUDA does not survive a fork of a process that queried it: with a GPU visible the runner starts a
    fresh process, as before."""
    import torch

    from diff_transformer.experiments.runner import _Runner
    from test_compare import _process_jobs

    for gpu, kind in ((False, "WarmProcess"), (True, "Popen")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        runner = _Runner(1, 1, False, False, None)
        job = _process_jobs(tmp_path, "finish")[0]
        job.argv = [sys.executable, "-c", "pass"]
        runner._start(job)
        [(_, process)] = runner.processes.values()
        assert type(process).__name__ == kind and process.wait(timeout=60) == 0
        if runner.warm is not None:
            runner.warm.close()
