"""The incumbent checked: a kept change that turns wrong later is found and taken back.

Every candidate's audit also judges the control, the incumbent's outputs of the same benchmark, against the run's
A/A alone (agent/stages/token_audit.py `control_verdict`). A failed control is confirmed on fresh prompts: the
incumbent's server (the one that failed, not a fresh one) runs the A/A's passes again and they are audited
(a TokenAudit with `incumbent`). Confirmed, the keep that made the branch head is taken back: an
`incumbent_reverted` record, a new commit restoring the tree of the commit before that keep (its
`Nightshift-Trace-Event` trailer names the record; history is never rewritten), a `reverted` record, and the
incumbent served from it. The candidate whose benchmark found it is measured again on the new head (`remeasured`).
At the end of a run the branch head is audited once more on fresh prompts (a failure confirmed on fresh prompts
again), and taken back the same way. The magnitude test's honest deficits are the A/A's and the base tree's own
controls of the run (token_audit.base_controls), not the A/A's alone.
A baseline that fails twice has no keep to take back: the run stops (the reference itself is in doubt)."""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Callable

from agent.run.incumbent import Incumbent, IncumbentFailed
from agent.run.setup import RunSetup
from agent.stages import bench
from agent.stages.token_audit import audit_passed, describe, run_audit
from sandbox.base import Server
from traces import read_trace
from traces.schema import Commit, Decision, IncumbentReverted, Reverted, TokenAudit

ENV = {"GIT_AUTHOR_NAME": "nightshift", "GIT_AUTHOR_EMAIL": "nightshift@localhost",
       "GIT_COMMITTER_NAME": "nightshift", "GIT_COMMITTER_EMAIL": "nightshift@localhost"}


@dataclass
class Keep:
    commit: str
    candidate: int
    speedup: float


def lineage(records) -> list[Keep]:
    """The keeps in effect on the branch, oldest first: each `commit` adds one, each `reverted` takes the last back."""
    by_sha = {r.sha256: r.event for r in records}
    keeps: list[Keep] = []
    for record in records:
        event = record.event
        if isinstance(event, Commit):
            decision = by_sha.get(event.decision_sha256)
            keeps.append(Keep(event.commit, event.candidate,
                              decision.speedup if isinstance(decision, Decision) and decision.speedup else 1.0))
        elif isinstance(event, Reverted) and keeps:
            keeps.pop()
    return keeps


def revert_message(run_id: str, event: IncumbentReverted, sha: str) -> str:
    return (f"nightshift: revert candidate {event.kept_by}: its server failed the token audit\n\n"
            f"The incumbent served from {event.failed_commit[:12]} failed its audit against the A/A of run "
            f"{run_id}{'' if not event.candidate else f' in the benchmark of candidate {event.candidate}'} and again "
            f"on fresh prompts; the tree of {event.restored[:12]} is restored.\n\n"
            f"Nightshift-Reverts: {event.failed_commit}\n"
            f"Nightshift-Trace-Event: {sha}\n")


class Recheck:
    def __init__(self, setup: RunSetup, reference: Server, incumbent: Incumbent, calibration: TokenAudit | None,
                 emit: Callable, on_revert: Callable[[float], None] = lambda speedup: None,
                 honest: list[TokenAudit] | None = None):
        self.s, self.reference, self.incumbent, self.calibration = setup, reference, incumbent, calibration
        self.emit, self.on_revert = emit, on_revert
        self.honest = honest if honest is not None else []
        """The base tree's controls audited so far (the Judge's list): pooled with the A/A as honest deficits."""

    def audit_incumbent(self, n: int, confirmation: int = 0) -> TokenAudit:
        """The incumbent's server on fresh prompts under the benchmark load, as many passes as the A/A, judged against
        the A/A alone."""
        task = self.s.task
        seeds = [secrets.randbits(63) for _ in range(bench.audit_calibration_passes(task) + 1)]
        passes = asyncio.run(bench.calibration_passes(task, self.incumbent.server, self.s.vocab_size, seeds))
        bench.save_passes(self.s.run_dir / "outputs", f"incumbent-{n}-{confirmation}", passes)
        event = run_audit(n, self.reference, [o for p in passes for o in p.requests()], task.audit,
                          task.benchmark.request_timeout_s, task.acceptance.confidence, None, self.calibration,
                          confirmation, vocab_size=self.s.vocab_size, expected_tokens=task.workload.output_len,
                          incumbent=True, commit=self.s.workspace.head(), honest=list(self.honest))
        self.emit(event)
        return event

    def flagged(self, n: int, confirmation: int, audit: TokenAudit) -> bool:
        """The control of candidate n's benchmark failed: True if the incumbent stands (its audit on fresh prompts
        passed), False once the branch went back."""
        again = self.audit_incumbent(n, confirmation)
        if audit_passed(again):
            return True
        self.revert(n, confirmation, again, f"in the benchmark of candidate {n}: {audit.control_verdict.reason}; "
                                            f"on fresh prompts: {describe(again)}")
        return False

    def final(self) -> None:
        """The end of a run: the branch head audited once more on fresh prompts; a failure is confirmed on fresh
        prompts again, as a flagged control is (an honest head fails both at most (1 - confidence)^2 of runs), and
        the head taken back while both fail."""
        while lineage(read_trace(self.s.run_dir / "trace.jsonl")):
            event = self.audit_incumbent(0)
            if audit_passed(event):
                return
            again = self.audit_incumbent(0, 1)
            if audit_passed(again):
                return
            self.revert(0, 1, again, f"at the end of the run, on fresh prompts: {describe(event)}; and again: "
                                     f"{describe(again)}")

    def revert(self, n: int, confirmation: int, failed: TokenAudit, reason: str) -> str:
        keeps = lineage(read_trace(self.s.run_dir / "trace.jsonl"))
        head = self.s.workspace.head()
        if not keeps:
            raise IncumbentFailed(f"the baseline's own server fails the token audit against the run's A/A ({reason}): "
                                  f"there is no keep to take back, and the reference it shares a tree with is in "
                                  f"doubt; resume the run (nightshift run --resume) on a machine that passes")
        last = keeps.pop()
        restored = keeps[-1].commit if keeps else self.s.base_commit
        event = IncumbentReverted(candidate=n, confirmation=confirmation, failed_commit=head, kept_by=last.candidate,
                                  restored=restored, audit_seed=failed.sample_seed, speedup=last.speedup,
                                  reason=reason)
        sha = self.emit(event)
        repo, branch = self.s.workspace.repo, self.s.workspace.branch
        tree = repo.git.rev_parse(f"{restored}^{{tree}}")
        commit = repo.git.commit_tree(tree, "-p", head, "-m", revert_message(self.s.run_id, event, sha), env=ENV)
        repo.git.update_ref(f"refs/heads/{branch}", commit, head)
        self.emit(Reverted(candidate=last.candidate, branch=branch, commit=commit, reverts=head, event_sha256=sha))
        self.on_revert(last.speedup)
        self.incumbent.restore(commit, f"incumbent-{commit[:12]}")
        return commit
