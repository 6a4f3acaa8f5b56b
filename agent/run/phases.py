"""Where a run is after each trace record: the one table from event kind to stage.

`nightshift status` (agent/face/ops.py), the live view (agent/face/view.py), each worker's status file
(agent/run/worker.py) and the decision recorded for a candidate whose worker died (agent/run/loop.py) all read it,
so they never disagree. `stage` is the candidate's stage (traces/schema.py `Stage`) that the next step belongs to,
None where no candidate is being judged; `doing` says in words what the run is doing until its next record."""
from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from traces.schema import Stage


@dataclass(frozen=True)
class Phase:
    stage: Stage | None
    doing: str


AFTER: dict[str, Phase] = {
    "run_started": Phase(None, "starting the baseline servers"),
    "resumed": Phase(None, "resumed: restarting the baseline servers"),
    "self_parity": Phase(None, "measuring the baseline"),
    "noise_floor": Phase(None, "measuring the baseline"),
    "llm_call": Phase("proposal", "proposing"),
    "tool_call": Phase("proposal", "proposing"),
    "notebook": Phase("proposal", "proposing"),
    "proposal_invalid": Phase("proposal", "proposing again"),
    "duplicate_dropped": Phase("proposal", "proposing again (the last proposal duplicated one in flight)"),
    "proposal": Phase("surface", "applying the patch"),
    "patch_applied": Phase("build", "building"),
    "build": Phase("start", "starting the candidate's servers, then parity"),
    "parity": Phase("benchmark", "benchmarking"),
    "error_spent": Phase("benchmark", "benchmarking (its share of the night's error budget recorded)"),
    "sample": Phase("benchmark", "benchmarking"),
    "incumbent_restarted": Phase("benchmark", "benchmarking again (the incumbent's server failed and was replaced)"),
    "benchmark": Phase("audit", "auditing"),
    "audit": Phase("decision", "deciding"),
    "decision": Phase(None, "proposing the next candidate (or trying the gate on a null)"),
    "null_check": Phase(None, "proposing the next candidate"),
    "commit": Phase(None, "proposing the next candidate"),
    "remeasured": Phase("start", "measuring again against the new head"),
    "incumbent_reverted": Phase(None, "reverting the branch (the incumbent failed its audit)"),
    "reverted": Phase("start", "measuring again against the reverted head"),
    "run_finished": Phase(None, "finished"),
}
"""Every event kind of traces/schema.py (tests/run/test_phases.py checks that none is missing)."""

STAGES: tuple[str, ...] = get_args(Stage)


def phase_after(event) -> Phase:
    """Where the run is once `event` is recorded; a few records say more than their kind."""
    kind = event.kind
    if kind == "parity" and not event.ok:
        return Phase("decision", "recording the rejection")
    if kind == "decision" and event.verdict == "keep":
        return Phase(None, "committing")
    if kind == "audit" and getattr(event, "calibration", False):
        return Phase(None, "measuring the baseline")
    return AFTER.get(kind, Phase(None, kind))


def stage_after(event, current: str) -> str:
    """A worker's stage once it emitted `event` (its own markers, such as starting or idle, are kept otherwise)."""
    stage = phase_after(event).stage
    return stage if stage is not None else current


def stage_at_death(stage: str | None) -> Stage:
    """The stage recorded for a candidate whose worker died with `stage` in its status file."""
    return stage if stage in STAGES and stage != "proposal" else "start"
