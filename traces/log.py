"""Append-only, hash-chained JSONL.

Each line starts with its own sha256 (computed with that field blank) and records the sha256 of
the line before it, so one changed byte is caught at the line that holds it."""
from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

from pydantic import ValidationError

from traces.errors import NightshiftError
from traces.schema import AnyEvent, Record

GENESIS = "0" * 64
_PREFIX = b'{"sha256":"'


class TraceError(NightshiftError):
    stage = "trace"

    def __init__(self, line: int, message: str):
        super().__init__(f"trace line {line}: {message}")
        self.line = line


def _blank_hash(line: bytes) -> tuple[str, str]:
    """(the sha256 the line claims, the sha256 of the line with that field blank)."""
    if not line.startswith(_PREFIX) or line[len(_PREFIX) + 64:len(_PREFIX) + 66] != b'",':
        return "", ""
    claimed = line[len(_PREFIX):len(_PREFIX) + 64].decode("ascii", "replace")
    blank = _PREFIX + b'",' + line[len(_PREFIX) + 66:]
    return claimed, hashlib.sha256(blank).hexdigest()


_appending = 0
_deferred: list[BaseException] = []


_pending: BaseException | None = None
"""The stop a signal handler raised (interrupt) until the run's top has taken it (taken): should code between the
handler and the top swallow it, the next safe point raises it again (raise_pending). Seen once: a run sent SIGTERM at
its first benchmark pass on a loaded 2-core host ran on to its end and exited 0."""


def interrupt(exc: BaseException) -> None:
    """Raise `exc` now, or, while a record is being written, as soon as it is whole and counted: a signal handler's
    way out of a run (SIGTERM), so the record that closes the run never repeats a sequence number."""
    global _pending
    _pending = exc
    if _appending:
        _deferred.append(exc)
        return
    raise exc


def raise_pending() -> None:
    """At a point where nothing is on its way out (between benchmark passes, between candidates): a stop that was
    raised and has not reached the run's top is raised again."""
    if _pending is not None:
        raise _pending


def taken(exc: BaseException) -> None:
    """The run's top caught `exc`: the pending stop, if it is that one, is delivered."""
    global _pending
    if exc is _pending:
        _pending = None


class TraceWriter:
    """Writes one record per event, flushed and fsynced before `append` returns. A signal handler that stops the
    run calls `interrupt`, which waits for the record being written."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq, self.last_sha256 = 0, GENESIS
        if self.path.exists() and self.path.stat().st_size:
            records = read_trace(self.path)
            self.seq, self.last_sha256 = len(records), records[-1].sha256
        self._file = open(self.path, "ab")

    def append(self, event: AnyEvent) -> str:
        global _appending
        _appending += 1
        try:
            return self._append(event)
        finally:
            _appending -= 1
            if not _appending and _deferred:
                exc = _deferred.pop(0)
                _deferred.clear()
                raise exc

    def _append(self, event: AnyEvent) -> str:
        record = Record(seq=self.seq, time=time.time(), prev_sha256=self.last_sha256, event=event)
        record.sha256 = hashlib.sha256(record.model_dump_json().encode()).hexdigest()
        line = record.model_dump_json().encode() + b"\n"
        crash = _crash_point(event)
        if crash in ("before", "tear"):
            self._write(line[:len(line) // 2] if crash == "tear" else b"")
            os.kill(os.getpid(), signal.SIGKILL)
        self._write(line)
        if crash == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        self.seq += 1
        self.last_sha256 = record.sha256
        return record.sha256

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


CRASH_ENV = "NIGHTSHIFT_TEST_CRASH"
"""Crash tests only: `after:KIND:CANDIDATE` SIGKILLs the harness right after that event's record is on disk,
`before:...` right before it is written, `tear:...` halfway through writing it."""


def _crash_point(event: AnyEvent) -> str:
    spec = os.environ.get(CRASH_ENV, "")
    if not spec:
        return ""
    when, kind, candidate = (spec.split(":") + ["", ""])[:3]
    matches = event.kind == kind and candidate in ("", "*", str(getattr(event, "candidate", 0)))
    return when if matches else ""


def read_trace(path: Path) -> list[Record]:
    """Parse and verify the whole chain. Raises TraceError naming the first bad line (1-based)."""
    return parse_trace(Path(path).read_bytes())


def read_trace_so_far(path: Path) -> tuple[list[Record], bool]:
    """A trace that may still be written: (the verified complete lines, whether a last line was torn).

    A last line without its newline is a write in progress and is left out; every complete line is
    verified as `read_trace` does."""
    data = Path(path).read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    return parse_trace(complete), len(complete) < len(data)


def parse_trace(data: bytes) -> list[Record]:
    if not data:
        raise TraceError(1, "empty trace")
    lines = data.split(b"\n")
    if lines[-1] != b"":
        raise_at = len(lines)
    else:
        lines, raise_at = lines[:-1], 0
    records: list[Record] = []
    prev = GENESIS
    for index, line in enumerate(lines):
        number = index + 1
        if number == raise_at:
            raise TraceError(number, "torn last line: the run stopped while writing it")
        claimed, actual = _blank_hash(line)
        if not claimed or claimed != actual:
            raise TraceError(number, "record hash mismatch: the line was altered")
        try:
            record = Record.model_validate_json(line)
        except ValidationError as exc:
            raise TraceError(number, f"not a valid record: {exc.errors()[0]['msg']}") from None
        if record.seq != index:
            raise TraceError(number, f"sequence number {record.seq}, expected {index}")
        if record.prev_sha256 != prev:
            raise TraceError(number, "hash chain broken: prev_sha256 does not match the line before")
        prev = record.sha256
        records.append(record)
    if records[0].event.kind != "run_started":
        raise TraceError(1, "first record is not run_started")
    return records
