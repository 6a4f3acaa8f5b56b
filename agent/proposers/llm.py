"""The LLM proposer: reads the incumbent vLLM tree, asks an LLM for SEARCH/REPLACE edits, and
hands the loop a checked unified diff.

Per `propose`:
  1. stop (ProposerExhausted) if the task's dollar or token cap would be passed;
  2. build the request from prompt templates (agent/prompts/): the task's goal and numbers, the
     baseline profile, the history, the branch diff, the edit-surface file map and the most
     relevant files within the context token budget; or, after a build/parity failure of its
     own last candidate, a bounded repair turn with the error or the divergence;
  3. call the model (tenacity retries on transient faults), recording every attempt as `LlmCall`;
  4. parse, apply exactly, surface-check and `git apply --check` the answer; anything wrong is
     a `ProposalInvalid` with the reason, followed by a follow-up turn that says what was wrong,
     up to `attempts_per_proposal` answers; then ProposerExhausted.

With `proposer.tools` `native` or `text`, each proposal is instead a conversation with tools
(agent/proposers/tools.py): the model lists, greps and reads the incumbent tree, reads the profile,
the notebook and the branch diff, and calls `propose`, which checks the change at once and answers
like a compiler; the conversation ends at an accepted proposal or at the proposal's `tool_budget`.
Every call and its result is a `tool_call` event, and replay feeds the recorded answers back.

After each decision on one of its candidates the proposer writes a `notebook` entry (the lab
notebook, agent/proposers/notebook.py), which later proposals see.

The edit surface is enforced here by code (and again by the loop), never by the prompt:
whatever a file of the checkout says, an edit outside the surface can not become a proposal.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any, Callable

from agent.proposers.clients import (
    Completion, LlmError, LlmFatalError, LlmRequestError, Messages, Model, OpenAIModel, Price, Redactor,
    ReplayExhausted,
    complete_with_retries, estimate_tokens, expand_messages, message_delta, messages_tokens, tools_unsupported,
)
from agent.proposers import notebook, tools
from agent.proposers.machine import machine_text
from agent.proposers.base import Attempt, ProposalContext, ProposerExhausted
from agent.proposers.edits import EditError, Patch, make_patch
from agent.proposers.funnel import Funnel, llm_funnel
from agent.stages.surface import surface_allows
from agent.world.task import LlmProposer as LlmSpec
from agent.world.task import Task
from traces.schema import AnyEvent, Decision, LlmCall, NotebookEntry, Proposal, ProposalInvalid, Record, ToolCall

EXCERPT_LINES = 160
RETRY_TEMPERATURE = 0.7
CALLS_LEFT_NOTE = 3
"""The last this many tool calls of a conversation's budget are counted down in the answers."""
STUCK_REPEATS = 3
"""A conversation whose model repeats an earlier call this many times in a row ends (at temperature 0 it would
repeat it to the end of its budget); the next one starts at RETRY_TEMPERATURE."""
FOLLOW_UPS = 1
"""Follow-up turns after unusable answers in one conversation before a fresh one."""
TEXT_FALLBACK = " (tools are offered as text from now on)"
OUTAGE = "LLM call failed: transient: "
"""A conversation that ended so was ended by the endpoint (an outage outlasting its retries), not by the model."""
PROMPTS = Path(__file__).resolve().parent.parent / "prompts"
REPAIRABLE = {"apply", "build", "start", "parity", "liveness"}
HOT_PATH_HINTS = ["sample/sampler", "logits_processor", "worker/cpu_model_runner", "worker/gpu_model_runner",
                  "core/sched/scheduler", "layers/layernorm", "rotary_embedding", "layers/activation",
                  "attention/backends/cpu", "sample/ops", "worker/gpu_input_batch", "block_table",
                  "kv_cache_manager", "layers/linear", "vocab_parallel_embedding"]


def load_prompt(name: str) -> Template:
    return Template((PROMPTS / f"{name}.md").read_text())


@dataclass
class Conversation:
    messages: Messages
    candidate: int = 0
    answer: str = ""
    repairs: int = 0
    files: list[str] = field(default_factory=list)
    follow_ups: int = 0
    hypothesis: str = ""
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
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        self.redactor = Redactor([key])
        self.profile = profile
        """The incumbent's profile (agent/proposers/profile.py), its text where it could not be taken, or as given."""
        self._profile_fixed = profile is not None or not spec.profile
        self._profile_key: str | None = None
        """The profiled request's key: the tree's content, the incumbent's args, the workload (profile.request_key)."""
        self._model_path: Path | None = None
        self._sleep = sleep
        self.tokens_in = 0
        self.tokens_out = 0
        self.spend_usd = 0.0
        self.stats = Funnel()
        """This proposer's funnel so far, counted from the events it records and sees."""
        self.repairs = 0
        self.fresh = 0
        self._pending_repair: tuple[Conversation, Attempt] | None = None
        self._last: Conversation | None = None
        self._seen: dict[str, int] = {}
        self._invalid_log: list[str] = []
        self.notebook: list[NotebookEntry] = []
        self._sent: Messages = []
        """The previous LLM call's request as recorded (redacted): the next call records only what follows it."""
        self._emit: Callable[[AnyEvent], str] | None = None
        self._restoring = False
        self.protocol: str = spec.tools
        """How tools are offered now: `native` falls back to `text` for good when the endpoint refuses tools."""

    @classmethod
    def from_task(cls, task: Task, model: Model | None = None, **kwargs: Any) -> "LlmProposer":
        if not isinstance(task.proposer, LlmSpec):
            raise ValueError(f"task {task.name} has proposer kind {task.proposer.kind!r}, not 'llm'")
        return cls(task.proposer, task, model=model, **kwargs)

    # -------------------------------------------------------------------------------- budget
    @property
    def tokens_used(self) -> int:
        return self.tokens_in + self.tokens_out

    def _check_budget(self, messages: Messages) -> None:
        budget = self.task.budget
        prompt = messages_tokens(messages)
        answer = self.spec.answer_tokens
        if time.monotonic() >= self.deadline:
            raise ProposerExhausted(f"the run's wall clock (budget.wall_clock_s {budget.wall_clock_s:g}) is spent")
        if budget.max_llm_tokens is not None and self.tokens_used + prompt + answer > budget.max_llm_tokens:
            raise ProposerExhausted(
                f"LLM token cap reached: {self.tokens_used} used, the next call may need up to "
                f"{prompt + answer} of max_llm_tokens {budget.max_llm_tokens}")
        if budget.max_usd is not None:
            worst = self.price.cost({"prompt_tokens": prompt, "completion_tokens": answer})
            if self.spend_usd + worst > budget.max_usd:
                raise ProposerExhausted(
                    f"LLM dollar cap reached: ${self.spend_usd:.4f} spent, the next call may cost up to "
                    f"${worst:.4f} of max_usd ${budget.max_usd:.4f}")

    # ------------------------------------------------------------------------------- calling
    def _call(self, ctx: ProposalContext, messages: Messages, temperature: float | None,
              offer: list[dict[str, Any]] | None = None) -> Completion:
        """One LLM call, retried through transient failures; every attempt is an `llm_call` event, and every
        attempt's tokens (a failed one's too: a cut answer is billed) count toward the budget."""
        self._check_budget(messages)
        answer = self.spec.answer_tokens
        params = {**({"temperature": temperature} if temperature is not None else {}),
                  self.spec.answer_field: answer, **self.model.params}
        recorded = json.loads(json.dumps(self.redactor.obj(messages)))

        def delta() -> tuple[Messages, int, list[int]]:
            """The request as the trace keeps it: the messages after those of the previous recorded call (a failed
            attempt's too), which replay and resume rebuild from it."""
            prefix, elided = message_delta(self._sent, recorded)
            self._sent = recorded
            return recorded[prefix:], prefix, elided

        def failed(error: LlmError, latency: float) -> None:
            usage = {k: int(v) for k, v in error.usage.items()}
            cost = self._spend(usage)
            new, prefix, elided = delta()
            self._record(ctx, LlmCall(candidate=ctx.candidate, model=self.model.name, params=params,
                                      messages=new, prefix=prefix, elided=elided, response=None,
                                      finish_reason=None, usage=usage,
                                      cost_usd=round(cost, 8), latency_s=round(latency, 3),
                                      error=self.redactor.text(error.record())))

        kwargs: dict[str, Any] = {}
        if self._sleep is not None:
            kwargs["sleep"] = self._sleep
        left = max(0.0, self.deadline - time.monotonic())
        if self.spec.max_retries is not None:  # a bounded count, as before, and never past the run's end
            left = min(left, self.spec.request_timeout_s * (self.spec.max_retries + 1))
        completion = complete_with_retries(
            self.model, messages, temperature=temperature, max_tokens=answer,
            max_retries=self.spec.max_retries, backoff_s=self.spec.retry_backoff_s,
            max_backoff_s=self.spec.retry_max_backoff_s, deadline_s=left, on_failure=failed, tools=offer, **kwargs)
        completion.text = self.redactor.text(completion.text) or ""  # before anything is derived from it
        usage = {k: int(v) for k, v in completion.usage.items()}
        cost = self._spend(usage)
        message = None
        if completion.message is not None:
            message = self.redactor.obj({**completion.message, "content": completion.text
                                         or completion.message.get("content")})
            completion.message = message
        new, prefix, elided = delta()
        self._record(ctx, LlmCall(candidate=ctx.candidate, model=completion.model or self.model.name,
                                  params=params, messages=new, prefix=prefix, elided=elided,
                                  response=completion.text,
                                  finish_reason=completion.finish_reason, usage=usage, cost_usd=round(cost, 8),
                                  latency_s=round(completion.latency_s, 3),
                                  tool_calls=self.redactor.obj(completion.tool_calls), message=message))
        return completion

    def _spend(self, usage: dict[str, int]) -> float:
        cost = self.price.cost(usage)
        self.tokens_in += usage.get("prompt_tokens", 0)
        self.tokens_out += usage.get("completion_tokens", 0)
        self.spend_usd += cost
        return cost

    def _warmer(self, temperature: float | None) -> float | None:
        """The temperature of a fresh try after a failed one (at temperature 0 the same request gets the same
        answer); an unset temperature stays unset (the endpoint's default samples already)."""
        return None if temperature is None else max(temperature, RETRY_TEMPERATURE)

    def _record(self, ctx: ProposalContext, event: AnyEvent) -> None:
        self.stats.add(event)
        ctx.record(event)

    # ------------------------------------------------------------------------------- propose
    def propose(self, ctx: ProposalContext) -> Proposal:
        self._ensure_profile(ctx)
        self._emit = ctx.record
        if self.spec.tools != "off":
            return self._propose_with_tools(ctx)
        if self._pending_repair is not None:
            convo, attempt = self._pending_repair
            self._pending_repair = None
            convo.repairs += 1
            self.repairs += 1
            messages = [*convo.messages, {"role": "assistant", "content": convo.answer},
                        {"role": "user", "content": self._repair_text(attempt)}]
            convo = Conversation(messages=messages, repairs=convo.repairs, files=convo.files)
            repair_of: int | None = attempt.proposal.candidate
        else:
            self.fresh += 1
            convo = Conversation(messages=self._fresh_messages(ctx))
            repair_of = None
        last_reason = ""
        for answer_no in range(1, self.spec.attempts_per_proposal + 1):
            # after an unusable answer, the same request at temperature 0 would get the same answer
            temperature = self.spec.temperature if answer_no == 1 else self._warmer(self.spec.temperature)
            try:
                completion = self._call(ctx, convo.messages, temperature)
            except LlmFatalError as exc:
                raise ProposerExhausted(str(exc), kind="fatal") from exc
            except ReplayExhausted as exc:
                raise ProposerExhausted(str(exc)) from exc
            except LlmError as exc:
                last_reason = f"LLM call failed: {exc.record()}"
                self._invalid(ctx, last_reason)
                continue
            text = completion.text or ""
            reason, code, patch = self._check(ctx, text, completion.finish_reason)
            if patch is not None:
                convo.answer = text
                return self._proposal(ctx, patch, convo, answer=answer_no, repair_of=repair_of)
            last_reason = reason
            self._invalid(ctx, reason)
            if convo.follow_ups < FOLLOW_UPS and code != "length":
                convo.follow_ups += 1
                convo.messages = [*convo.messages, {"role": "assistant", "content": text or "(empty)"},
                                  {"role": "user", "content": load_prompt("invalid").substitute(reason=reason)}]
            else:  # models tend to repeat themselves within a conversation: start afresh, next focus
                self.fresh += 1
                convo = Conversation(messages=self._fresh_messages(ctx))
                repair_of = None
        raise ProposerExhausted(f"{self.spec.attempts_per_proposal} LLM answers in a row were unusable; "
                                f"the last: {last_reason}")

    def _proposal(self, ctx: ProposalContext, patch: Patch, convo: Conversation,
                  engine_args: dict[str, Any] | None = None, **info: Any) -> Proposal:
        """The checked patch as this candidate's proposal; its conversation is kept for a repair turn."""
        self._seen[tools.proposal_key(patch.diff, engine_args or {})] = ctx.candidate
        convo.candidate, convo.files = ctx.candidate, patch.files
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

    def _check(self, ctx: ProposalContext, text: str, finish_reason: str | None) -> tuple[str, str, Patch | None]:
        if finish_reason == "length":
            return (f"truncated: the answer hit {self.spec.answer_field} ({self.spec.answer_tokens}); give a "
                    f"shorter answer "
                    f"with only the needed blocks", "length", None)
        if not text.strip():
            return "empty: the answer has no text", "empty", None
        try:
            patch = make_patch(text, Path(ctx.checkout), self.task.edit_surface.include,
                               self.task.edit_surface.exclude)
        except EditError as exc:
            return str(exc), exc.code, None
        digest = hashlib.sha256(patch.diff.encode()).hexdigest()
        if digest in self._seen:
            return (f"duplicate: the same change as candidate {self._seen[digest]}, which was already tried",
                    "duplicate", None)
        return "", "", patch

    # ------------------------------------------------------------------------------- observe
    def observe(self, attempt: Attempt) -> None:
        if attempt.proposal.proposer != self.name:
            return
        decision = attempt.decision
        self.stats.add(decision)
        kept = decision.verdict == "keep"
        convo, self._last = self._last, None
        hypothesis = str(attempt.proposal.meta.get("llm", {}).get("hypothesis", ""))
        if not self._restoring and all(e.candidate != attempt.proposal.candidate for e in self.notebook):
            entry = notebook.entry(attempt.proposal, decision, hypothesis, self.task.acceptance.min_speedup)
            self.notebook.append(entry)
            if self._emit is not None:
                self._emit(entry)
        if (not kept and decision.stage in REPAIRABLE and convo is not None
                and convo.candidate == attempt.proposal.candidate and convo.repairs < self.spec.repair_turns):
            self._pending_repair = (convo, attempt)

    def restore(self, records: list[Record]) -> None:
        """From the trace: tokens and dollars spent, the funnel, the patches already tried, the unusable answers,
        and the conversation behind each proposal (for its repair turn). No LLM call is made again."""
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
                self.tokens_in += event.usage.get("prompt_tokens", 0)
                self.tokens_out += event.usage.get("completion_tokens", 0)
                self.spend_usd += event.cost_usd
                previous, sent = sent, next(requests)
                self.fresh += len(sent) <= 2 and (call is None or previous != sent)
                self._sent = sent
                call = event
            elif isinstance(event, ProposalInvalid):
                self.stats.add(event)
                self._invalid_log.append(f"candidate {event.candidate}: {event.reason}"[:300])
                if event.reason.endswith(TEXT_FALLBACK):
                    self.protocol = "text"
            elif isinstance(event, Proposal) and event.proposer == self.name:
                self.stats.add(event)
                proposals[event.candidate] = event
                self._seen[tools.proposal_key(event.patch, event.engine_args)] = event.candidate
                info = event.meta.get("llm", {})
                of = info.get("repair_of")
                repairs[event.candidate] = repairs.get(of, 0) + 1 if of is not None else 0
                self.repairs += of is not None
                messages = json.loads(json.dumps(sent)) if call and sent is not None else []
                if call is not None and self.spec.tools != "off":  # the conversation up to the accepted propose
                    messages = [*messages, self._assistant(call.response or "", call.tool_calls, call.message),
                                *(self._tool_result(r.call_id, r.name, r.result) for r in results)]
                self._last = Conversation(messages=messages, candidate=event.candidate,
                                          answer=(call.response or "") if call else "",
                                          repairs=repairs[event.candidate], files=list(info.get("files", [])),
                                          hypothesis=str(info.get("hypothesis", "")))
            elif isinstance(event, Decision) and event.candidate in proposals:
                self.observe(Attempt(proposals[event.candidate], event))

    # ---------------------------------------------------------------------------- with tools
    def _propose_with_tools(self, ctx: ProposalContext) -> Proposal:
        """One conversation with tools per proposal; a conversation that ends without an accepted `propose` (its
        budget spent, a failed call) is a `proposal_invalid`, and a fresh one starts, up to attempts_per_proposal."""
        repair_of: int | None = None
        if self._pending_repair is not None:
            convo, attempt = self._pending_repair
            self._pending_repair = None
            self.repairs += 1
            note = ("\nThe files are unchanged. Look again with the tools if needed, then call propose with the "
                    "corrected change.")
            convo = Conversation(messages=[*convo.messages, {"role": "user", "content": self._repair_text(attempt)
                                                             + note}],
                                 repairs=convo.repairs + 1, files=convo.files)
            repair_of = attempt.proposal.candidate
            target = self._reflect_target()
            convo.reflect_on = target.candidate if target is not None else None
        else:
            self.fresh += 1
            convo = Conversation(messages=[])
            convo.messages = self._tool_messages(ctx, convo)
        last_reason = ""
        failed = 0  # conversations in a row that ended without a proposal, the outages left out
        conversation = -1
        while failed < self.spec.attempts_per_proposal:
            conversation += 1
            failed += 1
            # at temperature 0 a fresh conversation would be the one that just failed again
            temperature = self.spec.temperature if conversation == 0 else self._warmer(self.spec.temperature)
            outcome = self._converse(ctx, convo, temperature)
            if isinstance(outcome, tools.Result):
                assert outcome.patch is not None
                convo.hypothesis = outcome.hypothesis
                self._reflect(ctx, convo)
                return self._proposal(ctx, outcome.patch, convo, engine_args=outcome.engine_args,
                                      repair_of=repair_of, hypothesis=outcome.hypothesis,
                                      plan=outcome.plan, tools=self.protocol,
                                      turns=sum(1 for m in convo.messages if m.get("role") == "assistant"))
            last_reason = outcome
            self._invalid(ctx, outcome)
            self._reflect(ctx, convo)
            self.fresh += 1
            convo = Conversation(messages=[])
            convo.messages = self._tool_messages(ctx, convo)
            repair_of = None
            if outcome.startswith(OUTAGE):  # the endpoint, not the model: recorded, and not counted
                failed -= 1
        raise ProposerExhausted(f"{self.spec.attempts_per_proposal} LLM conversations in a row ended without a "
                                f"proposal; the last: {last_reason}")

    def _converse(self, ctx: ProposalContext, convo: Conversation, temperature: float) -> tools.Result | str:
        """Model turns and tool calls until `propose` accepts a change (its Result) or the conversation ends (why)."""
        native = self.protocol == "native"
        offer = tools.definitions() if native else None
        surface = self.task.edit_surface
        box = tools.Toolbox(Path(ctx.checkout), surface.include, surface.exclude,
                            profile=self._profile_text, notebook=self._notebook_text, branch_diff=ctx.branch_diff,
                            seen=self._seen, incumbent_args=dict(ctx.incumbent_args), levers=list(surface.engine_args),
                            lever_values=dict(surface.engine_values),
                            candidates=lambda number: self._candidate_text(ctx, number),
                            # importing a candidate's module runs its code on the host: only where its server runs
                            # there too (backend local), never past a sandbox that contains it (docker, namespace)
                            import_timeout_s=self.spec.import_timeout_s if self.task.sandbox.backend == "local" else 0.0,
                            hide_env=(self.spec.api_key_env,) if self.spec.api_key_env else (),
                            reflections=convo.reflections)
        budget = self.spec.tool_budget
        used, tokens, usd = 0, 0, 0.0  # used: tool calls carried out, and turns without one
        answered: dict[str, int] = {}  # calls already answered in this conversation: key -> call number
        repeats = 0  # repeated calls in a row
        spent = f"budget: {budget.calls} tool calls (tool_budget.calls) without an accepted proposal"
        while True:
            if used >= budget.calls:
                return spent
            answer = self.spec.answer_tokens
            room = self.spec.context_tokens - answer
            if not tools.fit(convo.messages, room, messages_tokens):
                return (f"context: the conversation needs about {messages_tokens(convo.messages)} tokens with its "
                        f"earlier tool results elided, over proposer.context_tokens {self.spec.context_tokens} "
                        f"less {self.spec.answer_field} {answer}")
            worst = messages_tokens(convo.messages) + answer
            if budget.tokens is not None and tokens + worst > budget.tokens:
                return (f"budget: {tokens} tokens used, the next turn may need {worst} of tool_budget.tokens "
                        f"{budget.tokens}, without an accepted proposal")
            worst_usd = self.price.cost({"prompt_tokens": worst - answer, "completion_tokens": answer})
            if budget.usd is not None and usd + worst_usd > budget.usd:
                return f"budget: ${usd:.4f} spent, the next turn may pass tool_budget.usd ${budget.usd:.4f}"
            try:
                completion = self._call(ctx, convo.messages, temperature, offer=offer)
            except LlmFatalError as exc:
                raise ProposerExhausted(str(exc), kind="fatal") from exc
            except ReplayExhausted as exc:
                raise ProposerExhausted(str(exc)) from exc
            except LlmRequestError as exc:
                if native and tools_unsupported(exc):  # e.g. vllm serve without --enable-auto-tool-choice
                    self.protocol = "text"
                    return f"LLM call failed: {exc.record()}{TEXT_FALLBACK}"
                return f"LLM call failed: {exc.record()}"
            except LlmError as exc:
                return f"LLM call failed: {exc.record()}"
            tokens += sum(v for k, v in completion.usage.items() if k in ("prompt_tokens", "completion_tokens"))
            usd += self.price.cost(completion.usage)
            text = completion.text or ""
            calls = list(completion.tool_calls) or tools.parse_text_calls(text)
            if not calls:
                why = (f"your answer was cut off at {self.spec.answer_field} ({answer}): say less at a time"
                       if completion.finish_reason == "length" else
                       "your answer called no tool" + ("" if native else " (answer with one CALL line, or edit "
                                                                          "blocks to propose)"))
                convo.messages = [*convo.messages, {"role": "assistant", "content": text or "(empty)"},
                                  {"role": "user", "content": f"{why}. Call a tool; propose when you have a change."}]
                used += 1
                continue
            if not native:  # the protocol's answer is the text itself
                calls = calls[:1]
            # the endpoint's own message, verbatim, when its tool calls are the ones answered (a provider field
            # such as a thought signature must go back as it came)
            convo.messages = [*convo.messages, self._assistant(
                text, calls if native else [], completion.message if native and completion.tool_calls else None)]
            accepted: tools.Result | None = None
            for call in calls:
                if accepted is not None:
                    result = tools.Result("skipped: a change was already accepted in this answer", ok=False)
                elif used >= budget.calls:
                    result = tools.Result(f"skipped: {spent}", ok=False)
                else:
                    used += 1
                    key = tools.call_key(str(call.get("name", "")), call.get("arguments", ""))
                    if key is not None and key in answered:
                        result = tools.repeated(str(call.get("name", "")), answered[key])
                        repeats += 1
                    else:
                        repeats = 0
                        result = box.call(call.get("name", ""), call.get("arguments", ""))
                        if key is not None:  # an error is the same error again
                            answered[key] = used
                    left = budget.calls - used
                    if result.patch is None and 0 < left <= CALLS_LEFT_NOTE:
                        result = tools.Result(f"{result.text}\n[{left} tool call{'s' * (left > 1)} left in this "
                                              "conversation: call propose with your change before they run out]",
                                              ok=result.ok)
                self._record(ctx, ToolCall(candidate=ctx.candidate, call_id=str(call.get("id", "")),
                                           name=str(call.get("name", ""))[:100],
                                           arguments=self.redactor.text(str(call.get("arguments", "")))[:20_000],
                                           result=self.redactor.text(result.text) or "", ok=result.ok))
                convo.messages.append(self._tool_result(str(call.get("id", "")), str(call.get("name", "")),
                                                        result.text))
                if result.patch is not None and accepted is None:
                    accepted = result
            if accepted is not None:
                return accepted
            if repeats >= STUCK_REPEATS:
                return (f"stuck: {repeats} repeated tool calls in a row (the same arguments as an earlier call); a "
                        "fresh conversation starts warmer")

    def _assistant(self, text: str, calls: list[dict[str, Any]],
                   message: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.protocol != "native" or not calls:
            return {"role": "assistant", "content": text or "(empty)"}
        if message is not None and message.get("tool_calls"):
            return json.loads(json.dumps(message))
        return {"role": "assistant", "content": text or None,
                "tool_calls": [{"id": c.get("id", ""), "type": "function",
                                "function": {"name": c.get("name", ""), "arguments": c.get("arguments", "")}}
                               for c in calls]}

    def _tool_result(self, call_id: str, name: str, text: str) -> dict[str, Any]:
        if self.protocol == "native":
            return {"role": "tool", "tool_call_id": call_id, "content": text}
        return {"role": "user", "content": f"RESULT {name}:\n{text}"}

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

    def _candidate_text(self, ctx: ProposalContext, number: int) -> str:
        """One earlier candidate in full, for the `candidate` tool: the change, and the evidence on it."""
        attempt = next((a for a in ctx.history if a.proposal.candidate == number), None)
        entry = next((e for e in self.notebook if e.candidate == number), None)
        if attempt is None:
            known = sorted(a.proposal.candidate for a in ctx.history)
            return (f"error: no decided candidate {number}; the decided ones: "
                    f"{', '.join(map(str, known)) or 'none yet'}")
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

    def _notebook_text(self) -> str:
        return notebook.compact(self.notebook, self.task.acceptance.min_speedup, self._hot_files())

    def _tool_messages(self, ctx: ProposalContext, convo: Conversation | None = None) -> Messages:
        task = self.task
        protocol = "" if self.protocol == "native" else load_prompt("tools_text").substitute(
            tools=tools.text_protocol())
        surface = ", ".join(task.edit_surface.include)
        if task.edit_surface.exclude:
            surface += f" (except {', '.join(task.edit_surface.exclude)})"
        fields = {
            "task_name": task.name, "task_description": (task.description or "").strip(),
            "metric": task.benchmark.metric, "workload": _workload(task),
            "min_speedup": f"{task.acceptance.min_speedup:g}", "confidence": f"{task.acceptance.confidence:g}",
            "parity": f"{task.parity.num_prompts} prompts, {task.parity.max_tokens} greedy tokens each",
            "best_speedup": f"{ctx.best_speedup:.3f}", "engine_args": json.dumps(ctx.incumbent_args, sort_keys=True),
            "surface": surface, "calls": str(self.spec.tool_budget.calls),
            "profile": _clip(self._profile_text(), self.spec.context_tokens * 0.2),
            "notebook": _clip(self._notebook_text(), self.spec.context_tokens * 0.2),
            "levers": _levers(task, ctx.incumbent_args),
            "machine": self._machine_text(ctx),
            "reflect": "",
        }
        target = self._reflect_target()
        if convo is not None and target is not None:
            convo.reflect_on = target.candidate
            fields["reflect"] = (f"\n# Your last result: candidate {target.candidate}\n"
                                 f"{target.summary[:1500]}\nIn propose's `reflection`, say what this result teaches "
                                 "(judge the evidence: is the interval wide, did the tokens diverge, is the spot "
                                 "really cold?); it goes into the notebook.\n")
        return [{"role": "system", "content": load_prompt("tools_system").substitute(protocol=protocol)},
                {"role": "user", "content": load_prompt("tools_propose").substitute(fields)}]

    def _repair_text(self, attempt: Attempt) -> str:
        detail = ""
        if attempt.decision.stage == "parity":
            detail = ("The output tokens differ from the baseline: the change alters the computation. "
                      "Make sure the new code computes exactly the same values in the same order.")
        return load_prompt("repair").substitute(candidate=attempt.proposal.candidate, stage=attempt.decision.stage,
                                                reason=attempt.decision.reason[:3000],
                                                detail=(detail[:2000] + "\n") if detail else "")

    # ------------------------------------------------------------------------------- context
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

    def _machine_text(self, ctx: ProposalContext) -> str:
        device = getattr(self.profile, "device", "")
        return _clip(machine_text(self.task, ctx.run_dir, device), self.spec.context_tokens * 0.12)

    def _profile_text(self) -> str:
        if self.profile is None:
            return "(no profile)"
        if isinstance(self.profile, str):
            return self.profile
        return self.profile.summary()

    def _hot_files(self) -> list[str]:
        if self.profile is None or isinstance(self.profile, str):
            return []
        return list(self.profile.hot_files())

    def surface_files(self, checkout: Path) -> list[str]:
        files = _git_ls_files(checkout)
        inc, exc = self.task.edit_surface.include, self.task.edit_surface.exclude
        return [f for f in files if f.endswith(".py") and surface_allows(f, inc, exc)]

    def rank_files(self, files: list[str], branch_diff: str) -> list[str]:
        present = set(files)
        ranked: dict[str, None] = {}
        for f in self._hot_files():
            if f in present:
                ranked.setdefault(f, None)
        for f in files:
            if f"b/{f}" in branch_diff:
                ranked.setdefault(f, None)
        arch = _architecture_hint(self.task)
        for hint in ([arch] if arch else []) + HOT_PATH_HINTS:
            for f in files:
                if hint and hint in f and not f.endswith("__init__.py"):
                    ranked.setdefault(f, None)
        for f in files:  # then the rest of the surface, in path order
            if not f.endswith("__init__.py"):
                ranked.setdefault(f, None)
        return list(ranked)

    def _fresh_messages(self, ctx: ProposalContext) -> Messages:
        budget = self.spec.context_tokens
        checkout = Path(ctx.checkout)
        files = self.surface_files(checkout)
        ranked = self.rank_files(files, ctx.branch_diff)
        if ranked:  # a different focus for each fresh proposal, among the few hottest files
            k = (self.fresh - 1) % min(len(ranked), 4)
            ranked = ranked[k:k + 1] + ranked[:k] + ranked[k + 1:]
        task = self.task
        fields = {
            "task_name": task.name,
            "task_description": (task.description or "").strip(),
            "metric": task.benchmark.metric,
            "workload": _workload(task),
            "min_speedup": f"{task.acceptance.min_speedup:g}",
            "confidence": f"{task.acceptance.confidence:g}",
            "parity": f"{task.parity.num_prompts} prompts, {task.parity.max_tokens} greedy tokens each",
            "best_speedup": f"{ctx.best_speedup:.3f}",
            "engine_args": json.dumps(ctx.incumbent_args, sort_keys=True),
            "machine": self._machine_text(ctx),
            "profile": _clip(self._profile_text(), budget * 0.12),
            "history": _clip(self._history_text(ctx), budget * 0.12),
            "branch_diff": _clip(ctx.branch_diff.strip() or "(none yet: the files are vLLM as released)",
                                 budget * 0.10),
            "file_map": "",
            "files": "",
            "example_path": ranked[0] if ranked else "vllm/v1/sample/sampler.py",
        }
        system = load_prompt("system").substitute()
        skeleton = load_prompt("propose").substitute(fields)
        left = budget - estimate_tokens(system) - estimate_tokens(skeleton)
        fields["file_map"] = _clip(_file_map(files, ranked, checkout), min(left * 0.25, budget * 0.15))
        left -= estimate_tokens(fields["file_map"])
        fields["files"] = self._file_contents(checkout, ranked, max(left, 200))
        return [{"role": "system", "content": system},
                {"role": "user", "content": load_prompt("propose").substitute(fields)}]

    def _file_contents(self, checkout: Path, ranked: list[str], budget_tokens: float) -> str:
        blocks: list[str] = []
        left = budget_tokens
        for rel in ranked[:6]:
            try:
                text = (checkout / rel).read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            lines = text.splitlines()
            if len(lines) <= EXCERPT_LINES and estimate_tokens(text) + 30 <= left:
                block = f"### FILE {rel}\n```python\n{text.rstrip()}\n```"
            else:
                window = self._excerpt(rel, lines, left)
                if window is None:
                    continue
                start, end = window
                body = "\n".join(lines[start:end])
                block = f"### FILE {rel} (lines {start + 1}-{end})\n```python\n{body}\n```"
            cost = estimate_tokens(block)
            if cost > left:
                continue
            blocks.append(block)
            left -= cost
            if left < 300:
                break
        if not blocks:
            return "(no file fits in the context budget)"
        return "\n\n".join(blocks)

    def _excerpt(self, rel: str, lines: list[str], budget_tokens: float) -> tuple[int, int] | None:
        """A window of at most EXCERPT_LINES lines around the file's hottest profiled function,
        or from its first line of code (past the license header)."""
        if budget_tokens < 150 or not lines:
            return None
        hot = [ln for ln in (self.profile.hot_lines(rel) if self._hot_files() else []) if 0 < ln <= len(lines)]
        if hot:
            start = max(0, hot[0] - 1 - 8)
        else:
            start = next((i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")), 0)
        average = max(1.0, sum(len(x) for x in lines) / len(lines) / 3.5 + 1)
        span = min(EXCERPT_LINES, int(budget_tokens / average) - 4)
        if span < 20:
            return None
        end = min(len(lines), start + span)
        return start, end

    def _history_text(self, ctx: ProposalContext) -> str:
        out: list[str] = []
        for attempt in ctx.history[-12:]:
            d, p = attempt.decision, attempt.proposal
            numbers = ""
            if d.speedup is not None:
                numbers = f", speedup {d.speedup:.3f}"
                if d.ci_low is not None and d.ci_high is not None:
                    numbers += f" (CI {d.ci_low:.3f}..{d.ci_high:.3f})"
            what = p.summary or "(no summary)"
            if p.engine_args:
                what += f" engine args {json.dumps(p.engine_args, sort_keys=True)}"
            out.append(f"- candidate {p.candidate} [{p.proposer}] {what}: {d.verdict} at {d.stage}{numbers}: "
                       f"{d.reason[:300]}")
        if self._invalid_log:
            out.append("Your recent answers that could not be used:")
            out += [f"- {x}" for x in self._invalid_log[-5:]]
        return "\n".join(out) or "(none yet)"


# ----------------------------------------------------------------------------------- helpers
def _git_ls_files(checkout: Path) -> list[str]:
    try:
        proc = subprocess.run(["git", "ls-files", "-z"], cwd=checkout, capture_output=True, timeout=60)
        if proc.returncode == 0 and proc.stdout:
            return sorted(p for p in proc.stdout.decode("utf-8", "replace").split("\0") if p)
    except (OSError, subprocess.SubprocessError):
        pass
    root = Path(checkout)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if ".git" not in p.parts and "__pycache__" not in p.parts)


def _file_map(files: list[str], ranked: list[str], checkout: Path) -> str:
    """The surface: the ranked files one a line (with their size), the rest counted per folder."""
    lines: list[str] = []
    shown = set(ranked[:20])
    for rel in ranked[:20]:
        try:
            n = sum(1 for _ in open(checkout / rel, "rb"))
        except OSError:
            n = 0
        lines.append(f"{rel} ({n} lines)")
    folders: dict[str, int] = {}
    for rel in files:
        if rel not in shown:
            folder = rel.rsplit("/", 1)[0]
            folders[folder] = folders.get(folder, 0) + 1
    if folders:
        lines.append("Other files you may edit, per folder:")
        lines += [f"{folder}/ ({count} files)" for folder, count in sorted(folders.items())]
    return "\n".join(lines) or "(no files)"


def _clip(text: str, budget_tokens: float) -> str:
    limit = int(max(budget_tokens, 50) * 3.5)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def _levers(task: Task, incumbent: dict[str, Any]) -> str:
    """The engine args `propose` may change, each with its incumbent value and the values allowed."""
    surface = task.edit_surface
    if not surface.engine_args:
        return "none (code changes only)"
    out = []
    for name in surface.engine_args:
        now = json.dumps(incumbent.get(name))
        allowed = surface.engine_values.get(name)
        out.append(f"{name}={now}" + (f" (one of {', '.join(json.dumps(v) for v in allowed)})" if allowed else ""))
    return ("; ".join(out) + ". Give them in propose's `engine_args`, alone or with code; null is vLLM's default; "
            "any other value must be of the current value's type")


def _workload(task: Task) -> str:
    return (f"{task.workload.num_prompts} prompts of {task.workload.input_len} input tokens, "
            f"{task.workload.output_len} output tokens each, concurrency "
            f"{task.workload.concurrency or 'all at once'}; model {_model_name(task)}, dtype {task.model.dtype}")


def _model_name(task: Task) -> str:
    if task.model.path:
        return task.model.path.name
    if task.model.synthetic:
        return f"synthetic from {task.model.synthetic.config.name}"
    return "?"


def _architecture_hint(task: Task) -> str:
    config = None
    if task.model.synthetic:
        config = task.model.synthetic.config
    elif task.model.path:
        config = task.model.path / "config.json"
    try:
        data = json.loads(Path(config).read_text()) if config else {}
    except (OSError, ValueError):
        return ""
    arch = (data.get("architectures") or [""])[0]
    model_type = str(data.get("model_type") or "")
    if model_type:
        return f"models/{model_type.split('_')[0]}.py"
    return f"models/{arch.lower().replace('forcausallm', '')}.py" if arch else ""


def endpoint(spec: LlmSpec) -> str:
    """The endpoint: the variable named by `base_url_env` when it is set, else `base_url`."""
    return (os.environ.get(spec.base_url_env) if spec.base_url_env else None) or spec.base_url


def served_model(spec: LlmSpec) -> str:
    return (os.environ.get(spec.model_env) if spec.model_env else None) or spec.model


__all__ = ["Funnel", "LlmProposer", "endpoint", "llm_funnel", "served_model"]
