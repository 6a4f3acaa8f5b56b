"""How the LLM's answers fared, stage by stage: counted from a run's events, by the proposer as it
goes (`LlmProposer.stats`) or from a trace afterwards (`llm_funnel`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, get_args

from agent.proposers.edits import same_lines
from agent.proposers.shims import keep_repeated_keys
from agent.proposers.tools import ProposeArgs
from traces.schema import Decision, Stage

STAGES: list[str] = list(get_args(Stage))
"""The loop's stages in order: a candidate rejected at one got through all before it."""
UNPARSED = ("parse", "empty", "truncated")
"""Codes of invalid answers whose edit blocks did not parse."""


def got_through(decision: Decision, stage: str) -> bool:
    order = STAGES.index
    return decision.verdict == "keep" or (decision.stage in STAGES and order(decision.stage) > order(stage))


def only_identities(arguments: str) -> bool:
    """A propose whose every SEARCH/REPLACE edit replaces a text by itself (and nothing else), read as the toolbox
    reads its arguments (`ProposeArgs`, shapes small models send included) and judged by the identity check's own
    rule (`same_lines`): an identity even where an earlier check (an ambiguous SEARCH) rejected it first."""
    try:
        args = ProposeArgs.model_validate(json.loads(arguments, object_pairs_hook=keep_repeated_keys))
    except (TypeError, ValueError):  # a pydantic ValidationError is a ValueError
        return False
    return (bool(args.edits) and not args.functions and not args.blocks.strip()
            and all(same_lines(e.search, e.replace) for e in args.edits))


@dataclass
class Funnel:
    """answers: LLM calls that returned text; parsed: answers whose blocks parsed; applied: answers
    that became a checked patch (a proposal); built / parity_passed / kept: those proposals that
    got through the loop's build, parity and decision stages."""

    llm_calls: int = 0
    failed_calls: int = 0
    tool_calls: int = 0
    valid_tool_calls: int = 0
    """Tool calls the harness could carry out (arguments valid, paths inside the tree); a rejected propose counts."""
    proposes: int = 0
    """Calls of `propose` with valid arguments."""
    identity_proposes: int = 0
    """Of those, the ones rejected because an edit changed nothing."""
    built: int = 0
    parity_passed: int = 0
    kept: int = 0
    invalid: dict[str, int] = field(default_factory=dict)
    """Invalid answers (and failed calls) by the first word of their reason."""
    rejected_at: dict[str, int] = field(default_factory=dict)
    tokens_in: int = 0
    tokens_out: int = 0
    spend_usd: float = 0.0
    candidates: set[int] = field(default_factory=set)

    @property
    def answers(self) -> int:
        return self.llm_calls - self.failed_calls

    @property
    def parsed(self) -> int:
        return self.answers - sum(self.invalid.get(code, 0) for code in UNPARSED)

    @property
    def applied(self) -> int:
        return len(self.candidates)

    def add(self, event: Any) -> None:
        kind = getattr(event, "kind", "")
        if kind == "llm_call":
            self.llm_calls += 1
            self.spend_usd += event.cost_usd
            if event.error is not None:
                self.failed_calls += 1
            else:
                self.tokens_in += event.usage.get("prompt_tokens", 0)
                self.tokens_out += event.usage.get("completion_tokens", 0)
        elif kind == "tool_call":
            self.tool_calls += 1
            valid = not event.result.startswith("error: ")
            self.valid_tool_calls += valid
            if event.name == "propose" and valid:
                self.proposes += 1
                self.identity_proposes += "\nidentity: FAILED" in event.result or only_identities(event.arguments)
        elif kind == "proposal_invalid":
            code = event.reason.split(":", 1)[0]
            self.invalid[code] = self.invalid.get(code, 0) + 1
        elif kind == "proposal" and event.proposer == "llm":
            self.candidates.add(event.candidate)
        elif kind == "decision" and event.candidate in self.candidates:
            self.built += got_through(event, "build")
            self.parity_passed += got_through(event, "parity")
            if event.verdict == "keep":
                self.kept += 1
            else:
                self.rejected_at[event.stage] = self.rejected_at.get(event.stage, 0) + 1

    def summary(self) -> dict[str, Any]:
        return {
            "llm_calls": self.llm_calls, "failed_calls": self.failed_calls, "answers": self.answers,
            "tool_calls": self.tool_calls, "valid_tool_calls": self.valid_tool_calls, "proposes": self.proposes,
            "non_identity_proposes": self.proposes - self.identity_proposes,
            "parsed": self.parsed, "applied": self.applied, "built": self.built,
            "parity_passed": self.parity_passed, "kept": self.kept, "invalid": dict(self.invalid),
            "rejected_at": dict(self.rejected_at), "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
            "spend_usd": round(self.spend_usd, 6),
        }


def llm_funnel(events: list[Any]) -> dict[str, Any]:
    """The funnel of a run's events, as numbers for the summary."""
    funnel = Funnel()
    for event in events:
        funnel.add(event)
    return funnel.summary()


if __name__ == "__main__":  # python -m agent.proposers.funnel runs/<id>/trace.jsonl
    import sys
    from pathlib import Path

    from traces.log import read_trace

    print(json.dumps(llm_funnel([r.event for r in read_trace(Path(sys.argv[1]))]), indent=1))
