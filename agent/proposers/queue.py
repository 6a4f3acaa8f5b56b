"""Evaluate a folder of patch files in name order (e.g. upstream pull requests as .patch files)."""
from __future__ import annotations

from pathlib import Path

from agent.proposers.base import Attempt, ProposalContext, ProposerExhausted
from traces.schema import Proposal


class QueueProposer:
    name = "queue"

    def __init__(self, folder: Path):
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"patch folder not found: {folder}")
        self.pending = sorted(p for p in folder.iterdir() if p.suffix in (".patch", ".diff"))
        if not self.pending:
            raise FileNotFoundError(f"no .patch or .diff files in {folder}")

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
