"""Evaluate a folder of patch files in name order (e.g. upstream pull requests as .patch files)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from agent.proposers.base import Attempt, ProposalContext, ProposerExhausted
from traces.errors import NightshiftError
from traces.schema import Proposal


class QueueError(NightshiftError, ValueError):
    """The patch folder is missing, empty, or holds a file that is not a patch."""

    stage = "proposer"


def check_patch(path: Path) -> None:
    """Raises QueueError unless git can parse `path` as a patch (whether it applies is judged later)."""
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise QueueError(f"{path}: not a patch (not UTF-8 text)") from None
    with tempfile.TemporaryDirectory(prefix="nightshift-patch-") as cwd:
        proc = subprocess.run(["git", "apply", "--numstat", "-"], input=text, capture_output=True, text=True,
                              cwd=cwd, env={**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(cwd)})
    if proc.returncode:
        cause = (proc.stderr.strip().splitlines() or [f"git apply exit {proc.returncode}"])[-1]
        cause = re.sub(r"^(error|fatal): ", "", re.sub(r" \(allow with .*\)$", "", cause))
        raise QueueError(f"{path}: not a patch git can read ({cause})")


class QueueProposer:
    name = "queue"
    spend_usd = 0.0

    def __init__(self, folder: Path):
        folder = Path(folder)
        if not folder.is_dir():
            raise QueueError(f"patch folder not found: {folder}")
        self.pending = sorted(p for p in folder.iterdir() if p.suffix in (".patch", ".diff"))
        if not self.pending:
            raise QueueError(f"no .patch or .diff files in {folder}")
        for path in self.pending:
            check_patch(path)

    def propose(self, ctx: ProposalContext) -> Proposal:
        if not self.pending:
            raise ProposerExhausted("every patch in the queue was evaluated")
        path = self.pending.pop(0)
        text = path.read_text()
        subject = next((line[len("Subject:"):].strip() for line in text.splitlines()
                        if line.startswith("Subject:")), path.stem)
        return Proposal(candidate=ctx.candidate, proposer=self.name, summary=subject, patch=text,
                        meta={"file": path.name})

    def observe(self, attempt: Attempt) -> None:
        pass
