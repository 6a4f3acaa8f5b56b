"""The one error type a user can cause: it names the stage or the cause, and the CLI prints it as one line."""
from __future__ import annotations


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
