"""The one error type a user can cause: it names the stage or the cause, and the CLI prints it as one line."""
from __future__ import annotations

import signal


class NightshiftError(Exception):
    """Bad input or a broken environment, never a bug: `nightshift` prints it as one red line and exits 2.

    `stage` names where it happened (a trace Stage, or a setup step such as "task" or "checkout")."""

    stage: str = "setup"

    def __init__(self, message: str = "", stage: str | None = None):
        super().__init__(message)
        if stage is not None:
            self.stage = stage


def leaves_resumable(exc: BaseException) -> bool:
    """Whether a run stopped by `exc` can go on with `nightshift run --resume`: a check that refused (the
    environment, not the run, is at fault) or a signal (SIGTERM, Ctrl-C). A bug ends the run."""
    return isinstance(exc, (NightshiftError, SystemExit, KeyboardInterrupt))


def end_reason(exc: BaseException) -> str:
    """The `run_finished` reason for a run that `exc` ended: a signal (agent.face.cli turns SIGTERM into
    SystemExit(128 + 15)) and Ctrl-C read as stops, anything else as an error."""
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code > 128:
        try:
            name = signal.Signals(exc.code - 128).name
        except ValueError:
            name = f"signal {exc.code - 128}"
        return f"stopped by {name}"
    if isinstance(exc, KeyboardInterrupt):
        return "stopped by Ctrl-C"
    return f"error: {type(exc).__name__}: {exc}"
