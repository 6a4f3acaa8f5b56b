"""The lab notebook: one entry per LLM candidate (a `notebook` event in the trace), and its compact view for later
proposals, `review` and the report.

An entry's `summary` is one paragraph: the hypothesis, the files, the stage reached, the speedup with its interval,
and the outcome; a parity or audit failure adds where the tokens diverged. The outcome states the decision's facts
only (one benchmark is one measurement: a rule does not conclude "not where the time goes" from it); what the result
teaches is the model's own `reflection`, written in its next conversation (propose's `reflection`), which writes the
entry again with it. The compact view is newest first, with what to choose next at its head (a hot spot not yet
tried, a refinement of a near miss, or a repair), so that a clipped notebook loses the oldest entries. `candidate`
gives any one decided candidate whole, for the tool of that name.
"""
from __future__ import annotations

import json

from agent.proposers.base import Attempt
from agent.stages.stats import accepts
from traces.schema import Decision, NotebookEntry, Proposal

FAILED_TO_RUN = {"surface", "apply", "build", "start", "liveness"}


def near_miss(entry: NotebookEntry, min_speedup: float) -> bool:
    """Got through parity and the audit, and was faster, but not significantly enough to keep."""
    return (entry.verdict != "keep" and entry.stage in ("benchmark", "decision") and entry.speedup is not None
            and entry.speedup > 1.0 and (entry.ci_low is None or not accepts(entry.ci_low, min_speedup)))


def learned(decision: Decision, min_speedup: float) -> str:
    reason = decision.reason.strip().splitlines()[0][:240] if decision.reason.strip() else ""
    if decision.verdict == "keep":
        return f"kept: {decision.speedup:.3f}x; the branch now includes it, build on it" if decision.speedup \
            else "kept; the branch now includes it"
    if decision.stage in FAILED_TO_RUN:
        return f"it did not run ({decision.stage}: {reason}); repair it, or drop the idea"
    if decision.stage == "parity":
        return "it changes the output tokens: the computation is not the same; make it bitwise identical or drop it"
    if decision.stage == "audit":
        return ("identical tokens at parity but the audit under load rejects it (e.g. right alone, wrong in a "
                "batch): make it correct for every batch composition")
    if decision.speedup is not None and decision.speedup > 1.0:
        return (f"same tokens, {decision.speedup:.3f}x but not significant (needs {min_speedup:g}x at the lower "
                f"bound): a near miss, refine it to remove more of the same work")
    if decision.speedup is not None:
        return (f"same tokens, {decision.speedup:.3f}x: not faster in this one measurement (judge the interval "
                f"before calling the spot cold)")
    return f"rejected at {decision.stage}: {reason}"


def entry(proposal: Proposal, decision: Decision, hypothesis: str, min_speedup: float) -> NotebookEntry:
    files = list(proposal.meta.get("llm", {}).get("files", []))
    interval = ""
    if decision.speedup is not None:
        interval = f", speedup {decision.speedup:.3f}x"
        if decision.ci_low is not None and decision.ci_high is not None:
            interval += f" [{decision.ci_low:.3f}, {decision.ci_high:.3f}]"
    divergence = decision.reason.strip()[:600] if decision.stage in ("parity", "audit") else ""
    what = learned(decision, min_speedup)
    flags = (f" Engine args: {', '.join(f'{k}={v}' for k, v in sorted(proposal.engine_args.items()))}."
             if proposal.engine_args else "")
    paragraph = (f"Candidate {proposal.candidate}: {proposal.summary.strip()}. "
                 + (f"Hypothesis: {hypothesis.strip()} " if hypothesis.strip() else "")
                 + f"Files: {', '.join(files) or 'none'}.{flags} Reached: {decision.verdict} at "
                 + f"{decision.stage}{interval}. "
                 + (f"Divergence: {divergence} " if divergence else "")
                 + f"Outcome: {what}.")
    return NotebookEntry(candidate=proposal.candidate, summary=paragraph, hypothesis=hypothesis.strip()[:2000],
                         files=files, verdict=decision.verdict, stage=decision.stage, speedup=decision.speedup,
                         ci_low=decision.ci_low, ci_high=decision.ci_high, learned=what, divergence=divergence)


def reflected(old: NotebookEntry, reflection: str) -> NotebookEntry:
    """The entry written again with the model's reflection on it (which replaces the first in the notebook)."""
    text = reflection.strip()[:1000]
    return old.model_copy(update={"reflection": text, "summary": f"{old.summary} Reflection: {text}"})


def compact(entries: list[NotebookEntry], min_speedup: float, hot_files: list[str] = (), limit: int = 12) -> str:
    """The notebook for a prompt: what to try next, then the latest entries newest first, one paragraph each (a
    clipped notebook loses the oldest)."""
    if not entries:
        body = ["(no entries yet: this is the first candidate)"]
    else:
        body = [e.summary[:1200] for e in reversed(entries[-limit:])]
        if len(entries) > limit:
            body.append(f"({len(entries) - limit} earlier entries left out: `candidate` gives any of them)")
    lines: list[str] = []
    tried = {f for e in entries for f in e.files}
    untried = [f for f in hot_files if f not in tried][:5]
    near = [e.candidate for e in entries if near_miss(e, min_speedup)]
    broken = [e.candidate for e in entries if e.stage in FAILED_TO_RUN | {"parity", "audit"} and e.verdict != "keep"]
    lines.append("Next, choose explicitly: "
                 + "; ".join(x for x in (
                     f"a hot spot not yet tried ({', '.join(untried)})" if untried else "a hot spot not yet tried",
                     f"a refinement of a near miss (candidates {', '.join(map(str, near))})" if near else "",
                     f"a repair (candidates {', '.join(map(str, broken[-3:]))})" if broken else "") if x)
                 + ". Say which in propose's `plan`.")
    return "\n".join(lines + body)


def candidate(history: list[Attempt], entries: list[NotebookEntry], number: int) -> str:
    """One decided candidate in full: the change (diff, engine args, plan, hypothesis) and the evidence on it (the
    decision, its stage's reason: the parity divergence, the audit's finding, the build or start error), with the
    model's reflection on it."""
    attempt = next((a for a in history if a.proposal.candidate == number), None)
    entry = next((e for e in entries if e.candidate == number), None)
    if attempt is None:
        known = sorted(a.proposal.candidate for a in history)
        return f"error: no decided candidate {number}; the decided ones: {', '.join(map(str, known)) or 'none yet'}"
    p, d = attempt.proposal, attempt.decision
    info = p.meta.get("llm", {}) if isinstance(p.meta.get("llm"), dict) else {}
    lines = [f"Candidate {number} [{p.proposer}]: {p.summary}"]
    for label, key in (("Plan", "plan"), ("Hypothesis", "hypothesis"), ("Repair of candidate", "repair_of")):
        if info.get(key) not in (None, ""):
            lines.append(f"{label}: {info[key]}")
    if p.engine_args:
        lines.append(f"Engine args: {json.dumps(p.engine_args, sort_keys=True)}")
    numbers = ""
    if d.speedup is not None:
        numbers = f", speedup {d.speedup:.3f}x"
        if d.ci_low is not None and d.ci_high is not None:
            numbers += f" [{d.ci_low:.3f}, {d.ci_high:.3f}]"
    lines.append(f"Decision: {d.verdict} at {d.stage}{numbers}")
    lines.append(f"Evidence ({d.stage}): {d.reason.strip()[:4000] or '(none)'}")
    if entry is not None and entry.reflection:
        lines.append(f"Reflection: {entry.reflection}")
    lines.append("Diff:\n" + (p.patch.strip() or "(no code change)"))
    return "\n".join(lines)
