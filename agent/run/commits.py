"""The commit message of a kept candidate: its evidence as git trailers, which review and replay read."""
from __future__ import annotations

from agent.run.relaxed import describe
from agent.stages.token_audit import trailer
from traces.schema import Commit, Decision, Proposal, TokenAudit


def commit_message(task, run_id: str, proposal: Proposal, decision: Decision, decision_sha: str, parity_digest: str,
                   audits: list[TokenAudit], relaxed: list[dict] = ()) -> str:
    """`relaxed`: the checks the run loosened (agent/run/relaxed.py), one `Nightshift-Relaxed:` trailer each."""
    return (f"nightshift: {proposal.summary}\n\nCandidate {proposal.candidate} of run {run_id}, "
            f"proposed by {proposal.proposer}.\n\n"
            f"Nightshift-Speedup: {decision.speedup:.4f}x [{decision.ci_low:.4f}, {decision.ci_high:.4f}] "
            f"at {task.acceptance.confidence:.0%}\n"
            f"Nightshift-Parity: {parity_digest}\n"
            + (f"Nightshift-Audit: {trailer(audits)}\n" if audits else "")
            + "".join(f"Nightshift-Relaxed: {describe(entry)}\n" for entry in relaxed)
            + f"Nightshift-Trace-Event: {decision_sha}\n")


def commit_keep(setup, proposal: Proposal, decision: Decision, decision_sha: str, parity_digest: str,
                audits: list[TokenAudit], tree, args: dict, emit, found: str = "") -> str:
    """A keep onto the run branch (or `found` there already, by its trailer), then its `commit` record."""
    sha = found or setup.workspace.commit(tree, args, commit_message(setup.task, setup.run_id, proposal, decision,
                                                                     decision_sha, parity_digest, audits,
                                                                     setup.relaxed))
    emit(Commit(candidate=proposal.candidate, branch=setup.workspace.branch, commit=sha, decision_sha256=decision_sha))
    return sha
