"""Replay: re-derive every recorded decision from the trace and check the branch against it."""
