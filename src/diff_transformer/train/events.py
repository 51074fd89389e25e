"""TensorBoard scalars, written by the calling thread.

TensorBoard's own writer (``SummaryWriter``) writes from a background thread: a full disk there
prints a traceback from that thread and reaches the training loop, if at all, at a later call.
:class:`EventFile` writes the same records (TensorBoard's event-file format: length, CRC, an
``Event`` protocol buffer, CRC) synchronously, so a failed write is an OSError naming the file,
raised where it happened, and what the failed write had added to the file is cut off again.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from pathlib import Path

from ..files import naming_os_errors

_files_opened = itertools.count()  # keeps two event files of one process and second apart


class EventFile:
    """An event file in ``directory``, created with its first scalars (a run that logs nothing
    leaves no file). ``purge_step``: a resumed run's first step; TensorBoard then drops the
    events an earlier invocation logged from that step on."""

    def __init__(self, directory: str | Path, purge_step: int | None = None) -> None:
        self.directory = Path(directory)
        self.purge_step = purge_step
        self.path = self.directory / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                                      f"{os.getpid()}.{next(_files_opened)}")
        self._file = None

    def _open(self) -> list[bytes]:
        """Create the file; returns the records that open it (file version, purge marker)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "xb")
        step = 0 if self.purge_step is None else self.purge_step
        records = [Event(wall_time=time.time(), step=step, file_version="brain.Event:2")]
        if self.purge_step is not None:
            records.append(Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))
        return [event.SerializeToString() for event in records]

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        """One scalar per tag at ``step``, flushed to the file before returning."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
        created = not self.directory.exists()
        with naming_os_errors(self.path):
            records = self._open() if self._file is None else []
            records.append(Event(wall_time=time.time(), step=step, summary=summary).SerializeToString())
            size = self._file.tell()
            try:
                writer = RecordWriter(self._file)
                for record in records:
                    writer.write(record)
                self._file.flush()
            except BaseException:
                self._cut_back(size, created)
                raise

    def _cut_back(self, size: int, created: bool) -> None:
        """After a failed write: the file as it was before it (none, if it was new)."""
        with contextlib.suppress(OSError):
            self._file.close()  # flushing what is buffered fails again: nothing more is written
        self._file = None
        with contextlib.suppress(OSError):
            if size == 0:
                self.path.unlink(missing_ok=True)
                if created:
                    self.directory.rmdir()
            else:
                os.truncate(self.path, size)
                self._file = open(self.path, "ab")

    def close(self) -> None:
        if self._file is not None:
            with naming_os_errors(self.path):
                self._file.close()
            self._file = None
