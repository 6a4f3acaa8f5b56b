"""The LLM proposer: each proposal is a conversation with an LLM at an OpenAI-compatible endpoint, which reads the
incumbent vLLM tree and hands the loop a checked unified diff (and engine args).

Per `propose`:
  1. open the conversation (agent/proposers/opening.py): a fresh one, or, after its own last candidate failed at a
     stage a repair can fix, that candidate's conversation again with the stage's evidence;
  2. run it (agent/proposers/agent.py): with tools (`proposer.tools: native | text`) the model lists, greps and reads
     the tree, the profile, the notebook and any earlier candidate, and calls `propose`, which checks the change at
     once and answers like a compiler; without (`off`) the answer itself is the proposal;
  3. a conversation that ends without an accepted change is a `proposal_invalid`, and what follows it is decided
     here: with tools a fresh conversation; without, one follow-up in the same conversation saying what was wrong,
     then a fresh one (models repeat themselves within one), the same request again after a failed call. After
     `attempts_per_proposal` of them (outages of a conversation with tools not counted) ProposerExhausted.

Every LLM call is an `llm_call` event (its new messages only, agent/proposers/transcript.py), every tool call a
`tool_call`; the spend is checked against the run's caps before each call (agent/proposers/budget.py). After each
decision on one of its candidates the proposer writes a `notebook` entry (agent/proposers/notebook.py), into which
the model's next conversation writes its reflection.

The edit surface is enforced by code (here, and again by the loop), never by the prompt: whatever a file of the
checkout says, an edit outside the surface cannot become a proposal.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from agent.proposers import notebook, opening
from agent.proposers.agent import FAILED, TEXT_FALLBACK, Agent, Ended
from agent.proposers.base import Attempt, ProposalContext, ProposerExhausted
from agent.proposers.budget import Allowance, Spend
from agent.proposers.clients import (
    Completion, LlmError, LlmFatalError, Messages, Model, OpenAIModel, Price, Redactor, ReplayExhausted,
    complete_with_retries, expand_messages, messages_tokens,
)
from agent.proposers.edits import Patch
from agent.proposers.funnel import Funnel, llm_funnel
from agent.proposers.machine import machine_text
from agent.proposers.tools import Answer, Toolbox, proposal_key
from agent.proposers.transcript import CallLog, Transcript, assistant_message, result_message
from agent.world.task import LlmProposer as LlmSpec
from agent.world.task import Task
from traces.schema import AnyEvent, Decision, LlmCall, NotebookEntry, Proposal, ProposalInvalid, Record, ToolCall

RETRY_TEMPERATURE = 0.7
FOLLOW_UPS = 1
"""Follow-up turns after unusable answers in one conversation without read tools, before a fresh one."""
OUTAGE = FAILED + "transient: "
"""A conversation that ended so was ended by the endpoint (an outage outlasting its retries), not by the model."""
REPAIRABLE = {"apply", "build", "start", "parity", "liveness"}


@dataclass
class Conversation:
    messages: Messages
    candidate: int = 0
    repairs: int = 0
    follow_ups: int = 0
    reflect_on: int | None = None
    """The candidate whose result the opening asked the model to reflect on (propose's `reflection`)."""
    reflections: list[str] = field(default_factory=list)
    """The reflections the model's propose calls carried, in order."""


class LlmProposer:
    name = "llm"

    def __init__(self, spec: LlmSpec, task: Task, model: Model | None = None,
                 profile: Any = None, sleep: Callable[[float], None] | None = None):
        self.spec, self.task = spec, task
        self.model: Model = model if model is not None else OpenAIModel(
            endpoint(spec), served_model(spec), spec.api_key_env, timeout_s=spec.request_timeout_s,
            tool_choice=spec.tool_choice, extra_body=spec.extra_body, token_field=spec.answer_field,
            reasoning_effort=spec.reasoning_effort, answer_timeout_s=spec.answer_timeout_s)
        self.deadline = time.monotonic() + task.budget.wall_clock_s
        """When the run's wall clock is spent (time.monotonic): an outage is waited out until then, not after."""
        self.price = Price(spec.price.input_per_mtok, spec.price.output_per_mtok)
        self.spend = Spend(self.price, task.budget.max_llm_tokens, task.budget.max_usd)
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        self.redactor = Redactor([key])
        self.profile = profile
        """The incumbent's profile (agent/proposers/profile.py), its text where it could not be taken, or as given."""
        self._profile_fixed = profile is not None or not spec.profile
        self._profile_key: str | None = None
        """The profiled request's key: the tree's content, the incumbent's args, the workload (profile.request_key)."""
        self._model_path: Path | None = None
        self._sleep = sleep
        self.stats = Funnel()
        """This proposer's funnel so far, counted from the events it records and sees."""
        self.repairs = 0
        self.fresh = 0
        """Fresh conversations so far: each without read tools puts another of the hottest files first."""
        self._pending_repair: tuple[Conversation, Attempt] | None = None
        self._last: Conversation | None = None
        self._seen: dict[str, int] = {}
        self._invalid_log: list[str] = []
        self.notebook: list[NotebookEntry] = []
        self.calls = CallLog()
        self._emit: Callable[[AnyEvent], str] | None = None
        self._restoring = False
        self.protocol: str = spec.tools
        """How tools are offered now: `native` falls back to `text` for good when the endpoint refuses tools."""

    @classmethod
    def from_task(cls, task: Task, model: Model | None = None, **kwargs: Any) -> "LlmProposer":
        if not isinstance(task.proposer, LlmSpec):
            raise ValueError(f"task {task.name} has proposer kind {task.proposer.kind!r}, not 'llm'")
        return cls(task.proposer, task, model=model, **kwargs)

    @property
    def spend_usd(self) -> float:
        return self.spend.usd

    @property
    def tokens_in(self) -> int:
        return self.spend.tokens_in

    @property
    def tokens_out(self) -> int:
        return self.spend.tokens_out

    @property
    def tokens_used(self) -> int:
        return self.spend.tokens

    # ------------------------------------------------------------------------------------------- propose
    def propose(self, ctx: ProposalContext) -> Proposal:
        self._ensure_profile(ctx)
        self._emit = ctx.record
        convo, repair_of = self._opening(ctx)
        failures, answers = 0, 0
        while True:
            answers += 1  # at temperature 0 the same request gets the same answer: every later one is warmer
            temperature = self.spec.temperature if answers == 1 else self._warmer(self.spec.temperature)
            try:
                result = self._agent(ctx, convo).run(temperature)
            except Ended as ended:
                reason = str(ended)
                self._invalid(ctx, reason)
                self._reflect(ctx, convo)
                if reason.endswith(TEXT_FALLBACK):
                    self.protocol = "text"
                failures += not (self.spec.tools != "off" and reason.startswith(OUTAGE))
                if failures >= self.spec.attempts_per_proposal:
                    what = ("answers in a row were unusable" if self.spec.tools == "off" else
                            "conversations in a row ended without a proposal")
                    raise ProposerExhausted(f"{failures} LLM {what}; the last: {reason}") from None
                convo, repair_of = self._next(ctx, convo, reason), None
                continue
            self._reflect(ctx, convo)
            info: dict[str, Any] = {"answer": answers} if self.spec.tools == "off" else {
                "hypothesis": result.hypothesis, "plan": result.plan, "tools": self.protocol,
                "turns": sum(1 for m in convo.messages if m.get("role") == "assistant")}
            assert result.patch is not None
            return self._proposal(ctx, result.patch, convo, engine_args=result.engine_args, repair_of=repair_of,
                                  **info)

    def _opening(self, ctx: ProposalContext) -> tuple[Conversation, int | None]:
        """(the conversation, the candidate it repairs): a repair continues its candidate's conversation."""
        if self._pending_repair is None:
            return self._fresh(ctx), None
        convo, attempt = self._pending_repair
        self._pending_repair = None
        self.repairs += 1
        with_tools = self.spec.tools != "off"
        repair = Conversation(messages=[*convo.messages, {"role": "user",
                                                           "content": opening.repair(attempt, with_tools)}],
                              repairs=convo.repairs + 1)
        target = self._reflect_target() if with_tools else None
        repair.reflect_on = target.candidate if target is not None else None
        return repair, attempt.proposal.candidate

    def _fresh(self, ctx: ProposalContext) -> Conversation:
        self.fresh += 1
        machine = opening.clip(machine_text(self.task, ctx.run_dir, getattr(self.profile, "device", "")),
                               self.spec.context_tokens * 0.12)
        if self.spec.tools == "off":
            return Conversation(messages=opening.single_shot(self.task, ctx, self.fresh - 1, self.spec.context_tokens,
                                                             machine, self.profile, self._invalid_log))
        target = self._reflect_target()
        messages = opening.with_tools(self.task, ctx, self.protocol, self.spec.tool_budget.calls,
                                      self.spec.context_tokens, machine, opening.profile_text(self.profile),
                                      self._notebook_text(), target)
        return Conversation(messages=messages, reflect_on=target.candidate if target is not None else None)

    def _next(self, ctx: ProposalContext, convo: Conversation, reason: str) -> Conversation:
        """What follows a conversation that ended: without read tools, the same request again after a failed call,
        or one follow-up (the reply is in the conversation already) unless the answer was cut off; else afresh."""
        if self.spec.tools == "off":
            if reason.startswith(FAILED):
                return convo
            if convo.follow_ups < FOLLOW_UPS and not reason.startswith("truncated:"):
                convo.follow_ups += 1
                return convo
        return self._fresh(ctx)

    def _agent(self, ctx: ProposalContext, convo: Conversation) -> Agent:
        spec, surface = self.spec, self.task.edit_surface
        cap = f"{spec.answer_field} ({spec.answer_tokens})"
        protocol = "answer" if spec.tools == "off" else self.protocol
        transcript = Transcript(convo.messages, protocol, ctx.candidate, self.redactor, cap)
        if protocol == "answer":
            tools: Toolbox | Answer = Answer(Path(ctx.checkout), surface.include, surface.exclude, self._seen, cap)
            allowance = Allowance(self.price, spec.answer_tokens, spec.answer_field)
        else:
            tools = Toolbox(
                Path(ctx.checkout), surface.include, surface.exclude,
                profile=lambda: opening.profile_text(self.profile), notebook=self._notebook_text,
                branch_diff=ctx.branch_diff, seen=self._seen, incumbent_args=dict(ctx.incumbent_args),
                levers=list(surface.engine_args), lever_values=dict(surface.engine_values),
                candidates=lambda number: notebook.candidate(ctx.history, self.notebook, number),
                # importing a candidate's module runs its code on the host: only where its server runs there too
                # (backend local), never past a sandbox that contains it (docker, namespace)
                import_timeout_s=spec.import_timeout_s if self.task.sandbox.backend == "local" else 0.0,
                hide_env=(spec.api_key_env,) if spec.api_key_env else (), reflections=convo.reflections)
            budget = spec.tool_budget
            allowance = Allowance(self.price, spec.answer_tokens, spec.answer_field, calls=budget.calls,
                                  tokens=budget.tokens, usd=budget.usd, context=spec.context_tokens)
        return Agent(ask=lambda messages, temperature, offer: self.ask(ctx, messages, temperature, offer),
                     transcript=transcript, tools=tools, allowance=allowance, record=lambda e: self._record(ctx, e))

    # ----------------------------------------------------------------------------------------- the model
    def ask(self, ctx: ProposalContext, messages: Messages, temperature: float | None,
            offer: list[dict[str, Any]] | None = None) -> Completion:
        """One LLM call, retried through transient failures until the run's wall clock is spent (or max_retries);
        every attempt is an `llm_call` event, and every attempt's tokens (a failed one's too: a cut answer is billed)
        count toward the budget. An LLM that cannot be used at all ends the run (ProposerExhausted, fatal)."""
        if time.monotonic() >= self.deadline:
            raise ProposerExhausted(f"the run's wall clock (budget.wall_clock_s {self.task.budget.wall_clock_s:g}) "
                                    "is spent")
        answer = self.spec.answer_tokens
        self.spend.check(messages_tokens(messages), answer)
        params = {**({"temperature": temperature} if temperature is not None else {}),
                  self.spec.answer_field: answer, **self.model.params}
        recorded = json.loads(json.dumps(self.redactor.obj(messages)))

        def failed(error: LlmError, latency: float) -> None:
            usage = {k: int(v) for k, v in error.usage.items()}
            new, prefix, elided = self.calls.delta(recorded)
            self._record(ctx, LlmCall(candidate=ctx.candidate, model=self.model.name, params=params, messages=new,
                                      prefix=prefix, elided=elided, response=None, finish_reason=None, usage=usage,
                                      cost_usd=round(self.spend.add(usage), 8), latency_s=round(latency, 3),
                                      error=self.redactor.text(error.record())))

        left = max(0.0, self.deadline - time.monotonic())
        if self.spec.max_retries is not None:  # a bounded count, and never past the run's end
            left = min(left, self.spec.request_timeout_s * (self.spec.max_retries + 1))
        try:
            completion = complete_with_retries(
                self.model, messages, temperature=temperature, max_tokens=answer, max_retries=self.spec.max_retries,
                backoff_s=self.spec.retry_backoff_s, max_backoff_s=self.spec.retry_max_backoff_s, deadline_s=left,
                on_failure=failed, tools=offer, **({"sleep": self._sleep} if self._sleep is not None else {}))
        except LlmFatalError as exc:
            raise ProposerExhausted(str(exc), kind="fatal") from exc
        except ReplayExhausted as exc:
            raise ProposerExhausted(str(exc)) from exc
        completion.text = self.redactor.text(completion.text) or ""  # before anything is derived from it
        usage = {k: int(v) for k, v in completion.usage.items()}
        if completion.message is not None:
            completion.message = self.redactor.obj({**completion.message, "content": completion.text
                                                    or completion.message.get("content")})
        new, prefix, elided = self.calls.delta(recorded)
        self._record(ctx, LlmCall(candidate=ctx.candidate, model=completion.model or self.model.name, params=params,
                                  messages=new, prefix=prefix, elided=elided, response=completion.text,
                                  finish_reason=completion.finish_reason, usage=usage,
                                  cost_usd=round(self.spend.add(usage), 8), latency_s=round(completion.latency_s, 3),
                                  tool_calls=self.redactor.obj(completion.tool_calls), message=completion.message))
        return completion

    def _warmer(self, temperature: float | None) -> float | None:
        """The temperature of a fresh try after a failed one; an unset temperature stays unset (the endpoint's
        default samples already)."""
        return None if temperature is None else max(temperature, RETRY_TEMPERATURE)

    # -------------------------------------------------------------------------------------- the records
    def _record(self, ctx: ProposalContext, event: AnyEvent) -> None:
        self.stats.add(event)
        ctx.record(event)

    def _proposal(self, ctx: ProposalContext, patch: Patch, convo: Conversation,
                  engine_args: dict[str, Any] | None = None, **info: Any) -> Proposal:
        """The checked patch as this candidate's proposal; its conversation is kept for a repair turn."""
        self._seen[proposal_key(patch.diff, engine_args or {})] = ctx.candidate
        convo.candidate = ctx.candidate
        self._last = convo
        meta = {"llm": {"model": self.model.name, **info, "files": patch.files,
                        "spend_usd": round(self.spend_usd, 6), "tokens_used": self.tokens_used}}
        proposal = Proposal(candidate=ctx.candidate, proposer=self.name, summary=patch.summary, patch=patch.diff,
                            engine_args=dict(engine_args or {}), meta=meta)
        self.stats.add(proposal)
        return proposal

    def _invalid(self, ctx: ProposalContext, reason: str) -> None:
        self._invalid_log.append(f"candidate {ctx.candidate}: {reason}"[:300])
        self._record(ctx, ProposalInvalid(candidate=ctx.candidate, reason=self.redactor.text(reason) or reason))

    # ------------------------------------------------------------------------------ observe and restore
    def observe(self, attempt: Attempt) -> None:
        if attempt.proposal.proposer != self.name:
            return
        decision = attempt.decision
        self.stats.add(decision)
        convo, self._last = self._last, None
        hypothesis = str(attempt.proposal.meta.get("llm", {}).get("hypothesis", ""))
        if not self._restoring and all(e.candidate != attempt.proposal.candidate for e in self.notebook):
            entry = notebook.entry(attempt.proposal, decision, hypothesis, self.task.acceptance.min_speedup)
            self.notebook.append(entry)
            if self._emit is not None:
                self._emit(entry)
        if (decision.verdict != "keep" and decision.stage in REPAIRABLE and convo is not None
                and convo.candidate == attempt.proposal.candidate and convo.repairs < self.spec.repair_turns):
            self._pending_repair = (convo, attempt)

    def restore(self, records: list[Record]) -> None:
        """From the trace: tokens and dollars spent, the funnel, the changes already tried, the unusable answers, the
        notebook, and the conversation behind each proposal (for its repair turn). No LLM call is made again."""
        self._restoring = True  # the notebook entries are the trace's: none is written again
        try:
            self._restore(records)
        finally:
            self._restoring = False

    def _restore(self, records: list[Record]) -> None:
        proposals: dict[int, Proposal] = {}
        repairs: dict[int, int] = {}
        call: LlmCall | None = None
        results: list[ToolCall] = []
        events = [r.event for r in records]
        requests = iter(expand_messages([e for e in events if isinstance(e, LlmCall)]))
        sent: Messages | None = None
        for event in events:
            if isinstance(event, NotebookEntry):  # an entry written again (with the model's reflection) replaces it
                self.notebook = [e for e in self.notebook if e.candidate != event.candidate] + [event]
            elif isinstance(event, ToolCall):
                self.stats.add(event)
                results.append(event)
            elif isinstance(event, LlmCall):
                results = []
                self.stats.add(event)
                self.spend.add(event.usage, cost=event.cost_usd)
                previous, sent = sent, next(requests)
                self.fresh += len(sent) <= 2 and (call is None or previous != sent)
                self.calls.sent = sent
                call = event
            elif isinstance(event, ProposalInvalid):
                self.stats.add(event)
                self._invalid_log.append(f"candidate {event.candidate}: {event.reason}"[:300])
                if event.reason.endswith(TEXT_FALLBACK):
                    self.protocol = "text"
            elif isinstance(event, Proposal) and event.proposer == self.name:
                self.stats.add(event)
                proposals[event.candidate] = event
                self._seen[proposal_key(event.patch, event.engine_args)] = event.candidate
                of = event.meta.get("llm", {}).get("repair_of")
                repairs[event.candidate] = repairs.get(of, 0) + 1 if of is not None else 0
                self.repairs += of is not None
                messages: Messages = []
                if call is not None and sent is not None:  # the conversation up to the accepted change
                    protocol = "answer" if self.spec.tools == "off" else self.protocol
                    messages = [*json.loads(json.dumps(sent)),
                                assistant_message(protocol, call.response or "", call.tool_calls, call.message),
                                *(result_message(protocol, r.call_id, r.name, r.result) for r in results)]
                self._last = Conversation(messages=messages, candidate=event.candidate,
                                          repairs=repairs[event.candidate])
            elif isinstance(event, Decision) and event.candidate in proposals:
                self.observe(Attempt(proposals[event.candidate], event))

    # ------------------------------------------------------------------------------------- the notebook
    def _notebook_text(self) -> str:
        return notebook.compact(self.notebook, self.task.acceptance.min_speedup, opening.hot_files(self.profile))

    def _reflect(self, ctx: ProposalContext, convo: Conversation) -> None:
        """The model's reflection on the candidate its opening asked about, into that candidate's notebook entry
        (written again, replacing the first): what was learned is the model's judgement, not a rule's."""
        number, text = convo.reflect_on, (convo.reflections or [""])[-1]
        if number is None or not text:
            return
        for n, old in enumerate(self.notebook):
            if old.candidate == number and not old.reflection:
                entry = notebook.reflected(old, text)
                self.notebook[n] = entry
                ctx.record(entry)
                return

    def _reflect_target(self) -> NotebookEntry | None:
        """This proposer's newest decided candidate whose result has no reflection yet."""
        newest = self.notebook[-1] if self.notebook else None
        return newest if newest is not None and not newest.reflection else None

    # -------------------------------------------------------------------------------------- the profile
    def _ensure_profile(self, ctx: ProposalContext) -> None:
        """The incumbent tree's profile, taken again when the tree or its args change (cached by content). A
        candidate's code runs on the host only where its servers do (sandbox.backend local): behind another sandbox
        the installed vLLM, the baseline, is profiled. In a parallel run only the first is taken: a later one would
        share a GPU with a benchmark in flight."""
        if self._profile_fixed or (self._profile_key is not None and self.task.sandbox.workers > 1):
            return
        from agent.proposers.profile import load_or_run, profile_request, request_key
        from agent.world.checkpoint import prepare_model

        try:
            if self._model_path is None:
                self._model_path = prepare_model(self.task).path
            tree = Path(ctx.checkout) if self.task.sandbox.backend == "local" else None
            request = profile_request(self.task, self._model_path, tree, dict(ctx.incumbent_args))
            if request_key(request) == self._profile_key:
                return
            self._profile_key = request_key(request)  # a profile that fails is not tried again for the same tree
            self.profile = load_or_run(request)
        except Exception as exc:  # a missing profile makes the prompt poorer, not the run impossible
            self._profile_key = self._profile_key or "unavailable"
            self.profile = f"(no profile: {type(exc).__name__}: {str(exc)[:300]})"


def endpoint(spec: LlmSpec) -> str:
    """The endpoint: the variable named by `base_url_env` when it is set, else `base_url`."""
    return (os.environ.get(spec.base_url_env) if spec.base_url_env else None) or spec.base_url


def served_model(spec: LlmSpec) -> str:
    return (os.environ.get(spec.model_env) if spec.model_env else None) or spec.model


__all__ = ["Funnel", "LlmProposer", "endpoint", "llm_funnel", "served_model"]
