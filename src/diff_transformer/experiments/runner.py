"""The one runner of every study: trains the runs of a phase, ``at_once`` at a time, and returns each
run's result by its :class:`~.study.RunKey`.

Two kinds of job:

- :class:`TrainingJob`, a run of the trainer in its own process (``python -m diff_transformer train``,
  or ``nproc`` processes under torchrun), so that its peak memory is its own and no model inherits
  another's state. A one-process run on a machine without a GPU is forked from a warm interpreter
  that has imported torch and the trainer and done nothing else (:mod:`.warm`): it starts in
  milliseconds, not seconds. Its directory holds its exact config (config.yaml), its logs and its
  checkpoint; its result is its summary.json (:class:`~.results.TrainingRun`).
- :class:`PoolJob`, a small run (the retrieval experiment's) called in a worker process of a pool
  (in this process when one runs at a time); its result, a dataclass, is saved as JSON.

What is never replaced or lost: with ``resume``, a finished run is reused and an interrupted one
continues from its checkpoint; without it, an earlier run of the same key is replaced, said aloud.
SIGINT/SIGTERM are passed once to every running training process (each in its own session, so a
terminal's Ctrl-C reaches only the runner), which saves a checkpoint; a pool run in progress
finishes and is saved; nothing further starts, and :class:`StudyInterrupted` says how to resume.
A failed run stops the runs beside it the same way.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import yaml

from ..files import check_output_dir, claim_output_dir, ending_signals_to_catch, write_text_atomically
from ..train.budget import RunLength, flops_per_token
from ..train.config import TrainConfig
from ..train.state import find_checkpoint, saved_step, saved_train_seconds
from ..train.trainer import STUDY_RUN_ENV, SUMMARY_FILE, TrainingError
from .results import TrainingRun, json_text, read_summary, read_training_run
from .study import RunKey
from .warm import WarmInterpreter, WarmProcess, runs_warm


class StudyInterrupted(RuntimeError):
    """A signal stopped the study; the interrupted runs saved a checkpoint. ``exit_status``:
    128 + the signal (130 SIGINT, 143 SIGTERM), what the command returns."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signum


# Exit status -> the signal that stopped a training process: 128 + signal where it answered it (saved a
# checkpoint, or stopped while starting), -signal where the signal itself ended it.
_INTERRUPTED = {code: s for s in (signal.SIGINT, signal.SIGTERM) for code in (128 + s, -s)}


def threads_per_job(at_once: int) -> int:
    """The CPU threads each of ``at_once`` runs gets: the cores shared out, at least one."""
    return max(1, (os.cpu_count() or at_once) // at_once)


@dataclass
class TrainingJob:
    """A run of the trainer: ``config`` is its exact config (this model, seed, learning rate and
    directories), written to LOG_DIR/config.yaml before it starts."""

    key: RunKey
    label: str
    log_dir: Path
    model: str
    config: TrainConfig

    def reuse(self, resume: bool) -> TrainingRun | None:
        """With ``resume``, the result of a run that already finished its steps (with its checkpoint)."""
        if not resume:
            return None
        summary = read_summary(self.log_dir)
        if (summary is not None and summary.status == "completed"
                and RunLength.of(self.config).spent(summary.steps, summary.train_seconds)
                and find_checkpoint(self.log_dir / "checkpoint") is not None):
            return read_training_run(self.key, self.log_dir)
        return None

    def command(self, resume: bool, nproc: int) -> list[str]:
        """Prepare the run's directory (continue an interrupted run with ``resume``, else replace an
        earlier one) and write its config; the command that trains it."""
        checkpoint = find_checkpoint(self.log_dir / "checkpoint")
        # A run killed after its last save but before its summary: its checkpoint is finished, and a
        # resumed run would find nothing to do and write no summary; it is trained again instead.
        finished = checkpoint is not None and RunLength.of(self.config).spent(saved_step(checkpoint) or 0,
                                                                             saved_train_seconds(checkpoint) or 0.0)
        continuing = resume and checkpoint is not None and not finished
        if not continuing:
            clear_run(self.log_dir, self.label)
        config_file = claim_output_dir(self.log_dir, "train-run") / "config.yaml"
        write_text_atomically(config_file, yaml.safe_dump(self.config.to_dict(), sort_keys=False))
        (self.log_dir / SUMMARY_FILE).unlink(missing_ok=True)  # an interrupted run's summary is not a result
        command = [sys.executable, "-m"]
        if nproc > 1:
            command += ["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
        command += ["diff_transformer", "train", "--config", str(config_file), "--model", self.model]
        return command + (["--resume"] if continuing else [])

    def cost(self) -> float:
        """The training FLOPs it is planned to spend (0 where that is not known in advance: a budget in
        seconds, an attention kind without a FLOPs term): the runner starts the costliest first."""
        length = RunLength.of(self.config)
        model_config = self.config.model(self.model).model_config()
        seq_len = self.config.data.seq_len or model_config.max_seq_len
        per_token = flops_per_token(model_config, seq_len)
        if length.steps is None or per_token is None:
            return 0.0
        return per_token * length.steps * self.config.data.batch_size * seq_len

    def result(self, exit_status: int) -> TrainingRun:
        """The finished run; a run that neither completed nor diverged is a TrainingError."""
        run = read_training_run(self.key, self.log_dir)
        if run is None or run.summary.status not in ("completed", "diverged"):
            status = f", status {run.summary.status}" if run else ""
            raise TrainingError(f"{self.label}: training failed (exit code {exit_status}{status}); see the messages "
                                "above")
        return run


@dataclass
class PoolJob:
    """A small run: ``function(*arguments)`` returns a dataclass that ``load(data)`` reads back from
    its JSON file ``path``."""

    key: RunKey
    label: str
    path: Path
    function: Callable[..., Any]
    arguments: tuple
    load: Callable[[dict], Any]

    def reuse(self, resume: bool) -> Any | None:
        if resume and self.path.is_file():
            return self.load(json.loads(self.path.read_text()))
        return None

    def save(self, result: Any) -> Any:
        write_text_atomically(self.path, json_text(result))
        return result


Job = TrainingJob | PoolJob


def clear_run(log_dir: Path, label: str) -> None:
    """Remove an earlier run of this key (said aloud: nothing is replaced silently); only a training
    run of the project is removed."""
    if log_dir.exists():
        check_output_dir(log_dir, "train-run", overwrite=True)
        print(f"{label}: replacing the earlier run in {log_dir}", file=sys.stderr)
        shutil.rmtree(log_dir)


def run_jobs(jobs: Sequence[Job], *, resume: bool = False, at_once: int = 1, nproc: int = 1,
             progress: bool = True, describe: Callable[[Job, Any], str] | None = None) -> dict[RunKey, Any]:
    """Every job's result, by key, in the order of ``jobs``: reused (``resume``), or run ``at_once`` at a
    time, the costliest training runs started first. ``describe(job, result)`` is the line printed as
    each finishes (with ``progress``). A diverged training run is a result; any other failure a
    TrainingError, after the running jobs have stopped."""
    results: dict[RunKey, Any] = {}
    queue: list[Job] = []
    for job in jobs:
        done = job.reuse(resume)
        if done is not None:
            if progress:
                print(f"{job.label}: already done, reusing {getattr(job, 'log_dir', None) or job.path}",
                      file=sys.stderr)
            results[job.key] = done
        else:
            queue.append(job)
    # The costliest training runs first (a stable sort: pool jobs keep their order), so that one long
    # run does not start last and leave the other cores idle while it finishes.
    queue.sort(key=lambda job: -job.cost() if isinstance(job, TrainingJob) else 0.0)
    if queue:
        _Runner(at_once, nproc, resume, progress, describe).run(queue, results)
    return {job.key: results[job.key] for job in jobs}


class _Runner:
    def __init__(self, at_once: int, nproc: int, resume: bool, progress: bool,
                 describe: Callable[[Job, Any], str] | None) -> None:
        self.at_once, self.nproc, self.resume, self.progress, self.describe = at_once, nproc, resume, progress, describe
        self.received: list[int] = []
        self.processes: dict[int, tuple[TrainingJob, subprocess.Popen | WarmProcess]] = {}
        self.warm: WarmInterpreter | None = None  # started with the first one-process training run
        self.futures: dict[concurrent.futures.Future, PoolJob] = {}
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.stopped: list[int] = []  # signals that stopped training processes (exit status 130 / 143)
        self.signalled: set[int] = set()  # the pids the signal received was passed to

    def _forward(self, signum, frame) -> None:
        if not self.received:
            self.received.append(signum)
            for _, process in list(self.processes.values()):
                self._stop(process)

    def _stop(self, process: subprocess.Popen | WarmProcess) -> None:
        """Pass the signal received to a training process, once (a second SIGINT would stop it at once,
        without its checkpoint)."""
        if process.pid not in self.signalled:
            self.signalled.add(process.pid)
            process.send_signal(signal.SIGINT if self.received[0] == signal.SIGINT else signal.SIGTERM)

    def run(self, queue: list[Job], results: dict[RunKey, Any]) -> None:
        total, finished = len(queue), 0
        if self.progress and self.at_once > 1:
            print(f"{total} runs, {self.at_once} at a time", file=sys.stderr, flush=True)
        previous = {s: signal.signal(s, self._forward) for s in ending_signals_to_catch()}
        try:
            while queue or self.processes or self.futures:
                while queue and self._running() < self.at_once and not self.received:
                    self._start(queue.pop(0))
                if self.received and not self._running():
                    break
                for job, result in self._collect():
                    finished += 1
                    results[job.key] = result
                    if self.progress and self.describe is not None:
                        print(f"[{finished}/{total}] {self.describe(job, result)}", file=sys.stderr, flush=True)
                time.sleep(0.05)
        except BaseException:  # a failed run: the others save a checkpoint and stop too
            for _, process in self.processes.values():
                process.send_signal(signal.SIGTERM)
            for _, process in self.processes.values():
                process.wait()
            raise
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True, cancel_futures=True)
            if self.warm is not None:
                self.warm.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.received or self.stopped:
            signum = self.received[0] if self.received else self.stopped[0]
            raise StudyInterrupted(f"interrupted by {signal.Signals(signum).name}: the running runs saved a "
                                   "checkpoint; rerun the same command with --resume", signum)

    def _running(self) -> int:
        return len(self.processes) + len(self.futures)

    def _start(self, job: Job) -> None:
        if isinstance(job, TrainingJob):
            command = job.command(self.resume, self.nproc)
            if not self.progress or self.describe is not None:  # the run's own summary line would repeat ours
                command.append("--quiet")
            env = {**os.environ, STUDY_RUN_ENV: "1"}  # a stop is said once, by the study (README)
            if self.at_once > 1:
                threads = str(threads_per_job(self.at_once))
                env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
            elif self.progress:
                print(f"{job.label}: {'resuming' if '--resume' in command else 'training'} -> {job.log_dir}",
                      file=sys.stderr, flush=True)
            # Forked only where no GPU is visible: CUDA does not survive a fork of a process that has
            # queried it, and a GPU run's start is a small part of its cost.
            if runs_warm(command) and self.nproc == 1 and not torch.cuda.is_available():
                if self.warm is None:
                    self.warm = WarmInterpreter(env)  # every run of the phase has the same environment
                process = self.warm.start(command)
            else:
                process = subprocess.Popen(command, start_new_session=True, env=env)
            self.processes[process.pid] = (job, process)
            if self.received:  # the signal came while it was being started: it stops too
                self._stop(process)
        elif self.at_once == 1:  # one at a time: here, without a worker's start-up
            self.futures[_run_here(job)] = job
        else:
            if self.pool is None:
                context = multiprocessing.get_context("spawn")  # no fork of a process holding torch's threads
                self.pool = concurrent.futures.ProcessPoolExecutor(
                    self.at_once, mp_context=context, initializer=_worker_init,
                    initargs=(threads_per_job(self.at_once),))
            self.futures[self.pool.submit(job.function, *job.arguments)] = job

    def _collect(self) -> list[tuple[Job, Any]]:
        done = []
        for pid, (job, process) in list(self.processes.items()):
            code = process.poll()
            if code is None:
                continue
            del self.processes[pid]
            if code in _INTERRUPTED:
                self.stopped.append(_INTERRUPTED[code])
                continue
            done.append((job, job.result(code)))
        for future, job in list(self.futures.items()):
            if future.done():
                del self.futures[future]
                done.append((job, job.save(future.result())))
        return done


def _run_here(job: PoolJob) -> concurrent.futures.Future:
    """A pool job run in this process: a finished future (a signal meanwhile stops what follows)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(job.function(*job.arguments))
    except Exception as exc:  # raised where the result is read
        future.set_exception(exc)
    return future


def _worker_init(threads: int) -> None:
    """A pool worker: ``threads`` CPU threads; Ctrl-C is the parent's to handle (a run in progress
    finishes and is saved, the rest are cancelled)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
