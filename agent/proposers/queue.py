"""Evaluate a folder of patch files in name order (e.g. upstream pull requests as .patch files)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import yaml

from agent.proposers.base import Attempt, ProposalContext, ProposerExhausted
from traces.errors import NightshiftError
from traces.schema import DuplicateDropped, Proposal, Record


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


ARGS_HEADER = "Nightshift-Engine-Args:"


def has_diff(text: str) -> bool:
    return any(line.startswith(("diff --git", "--- ")) for line in text.splitlines())


def engine_args(path: Path, preamble: list[str]) -> dict:
    """Serving flags a patch asks for, from a `Nightshift-Engine-Args: {max_num_seqs: 32}` line before its diff."""
    line = next((line for line in preamble if line.startswith(ARGS_HEADER)), None)
    if line is None:
        return {}
    try:
        args = yaml.safe_load(line[len(ARGS_HEADER):])
    except yaml.YAMLError as exc:
        raise QueueError(f"{path}: {ARGS_HEADER} is not YAML: {exc}") from None
    if not isinstance(args, dict):
        raise QueueError(f"{path}: {ARGS_HEADER} must be a mapping, e.g. {{max_num_seqs: 32}}")
    return args


class QueueProposer:
    name = "queue"
    spend_usd = 0.0

    @classmethod
    def from_task(cls, task) -> QueueProposer:
        return cls(task.proposer.patches)

    def __init__(self, folder: Path):
        folder = Path(folder)
        if not folder.is_dir():
            raise QueueError(f"patch folder not found: {folder}")
        self.pending = sorted(p for p in folder.iterdir() if p.suffix in (".patch", ".diff"))
        if not self.pending:
            raise QueueError(f"no .patch or .diff files in {folder}")
        for path in self.pending:
            args = engine_args(path, path.read_text().split("\ndiff --git", 1)[0].splitlines())
            if args and not has_diff(path.read_text()):
                continue  # serving flags only
            check_patch(path)

    def propose(self, ctx: ProposalContext) -> Proposal:
        if not self.pending:
            raise ProposerExhausted("every patch in the queue was evaluated")
        path = self.pending.pop(0)
        text = path.read_text()
        preamble = text.split("\ndiff --git", 1)[0].splitlines()
        subject = next((line[len("Subject:"):].strip() for line in preamble if line.startswith("Subject:")), path.stem)
        return Proposal(candidate=ctx.candidate, proposer=self.name, summary=subject,
                        patch=text if has_diff(text) else "",
                        engine_args=engine_args(path, preamble), meta={"file": path.name})

    def observe(self, attempt: Attempt) -> None:
        pass

    def restore(self, records: list[Record]) -> None:
        """The queue's position: the files already proposed are done."""
        done = {r.event.meta.get("file") for r in records  # a dropped duplicate was taken from the queue too
                if isinstance(r.event, (Proposal, DuplicateDropped)) and r.event.proposer == self.name}
        self.pending = [p for p in self.pending if p.name not in done]
