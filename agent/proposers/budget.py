"""What the LLM proposer may spend: the night's LLM tokens and dollars (`Spend`, against budget.max_llm_tokens and
budget.max_usd), and one conversation's allowance (`Allowance`: proposer.tool_budget's tool calls, tokens and dollars,
and the context the conversation must fit in).

Every attempt's usage is counted, a failed one's too (a cut answer was billed). Before a call, what was spent plus the
call's worst case (its prompt and the answer's whole cap) must stay within each cap; the run's wall clock is the
proposer's own check (agent/proposers/llm.py `ask`), since it also bounds the wait through an outage.
"""
from __future__ import annotations

from typing import Any

from agent.proposers.base import ProposerExhausted
from agent.proposers.clients import Price, messages_tokens
from agent.proposers.tools import Result

CALLS_LEFT_NOTE = 3
"""The last this many tool calls of a conversation's allowance are counted down in the answers."""


class Spend:
    """The tokens and dollars the LLM has cost the run so far."""

    def __init__(self, price: Price, max_tokens: int | None, max_usd: float | None):
        self.price, self.max_tokens, self.max_usd = price, max_tokens, max_usd
        self.tokens_in = 0
        self.tokens_out = 0
        self.usd = 0.0

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out

    def check(self, prompt: int, answer: int) -> None:
        """Raises ProposerExhausted where a call of `prompt` tokens and an answer of up to `answer` could pass a cap."""
        if self.max_tokens is not None and self.tokens + prompt + answer > self.max_tokens:
            raise ProposerExhausted(f"LLM token cap reached: {self.tokens} used, the next call may need up to "
                                    f"{prompt + answer} of max_llm_tokens {self.max_tokens}")
        worst = self.price.cost({"prompt_tokens": prompt, "completion_tokens": answer})
        if self.max_usd is not None and self.usd + worst > self.max_usd:
            raise ProposerExhausted(f"LLM dollar cap reached: ${self.usd:.4f} spent, the next call may cost up to "
                                    f"${worst:.4f} of max_usd ${self.max_usd:.4f}")

    def add(self, usage: dict[str, Any], cost: float | None = None) -> float:
        """Counts one attempt's usage; returns its cost (`cost`: as recorded, when read back from a trace)."""
        cost = self.price.cost(usage) if cost is None else cost
        self.tokens_in += int(usage.get("prompt_tokens", 0))
        self.tokens_out += int(usage.get("completion_tokens", 0))
        self.usd += cost
        return cost


class Allowance:
    """What one conversation may still spend: tool calls carried out (a turn without a call counts as one), tokens
    (prompt and completion, summed over its turns) and dollars; and the context it must fit in, less the answer's cap.
    A limit of None is none (a conversation without read tools has one answer a turn, and its opening is built to
    fit)."""

    def __init__(self, price: Price, answer: int, answer_field: str, calls: int | None = None,
                 tokens: int | None = None, usd: float | None = None, context: int | None = None):
        self.price, self.answer, self.answer_field = price, answer, answer_field
        self.calls, self.tokens, self.usd, self.context = calls, tokens, usd, context
        self.used = 0
        self.tokens_spent = 0
        self.usd_spent = 0.0

    @property
    def spent(self) -> str:
        return f"budget: {self.calls} tool calls (tool_budget.calls) without an accepted proposal"

    def exceeded(self, transcript: Any) -> str | None:
        """Why the conversation cannot take another turn, if it cannot; the oldest tool results are elided first to
        fit the context."""
        if self.calls is not None and self.used >= self.calls:
            return self.spent
        if self.context is not None and not transcript.fit(self.context - self.answer):
            return (f"context: the conversation needs about {messages_tokens(transcript.messages)} tokens with its "
                    f"earlier tool results elided, over proposer.context_tokens {self.context} less "
                    f"{self.answer_field} {self.answer}")
        worst = messages_tokens(transcript.messages) + self.answer
        if self.tokens is not None and self.tokens_spent + worst > self.tokens:
            return (f"budget: {self.tokens_spent} tokens used, the next turn may need {worst} of tool_budget.tokens "
                    f"{self.tokens}, without an accepted proposal")
        worst_usd = self.price.cost({"prompt_tokens": worst - self.answer, "completion_tokens": self.answer})
        if self.usd is not None and self.usd_spent + worst_usd > self.usd:
            return f"budget: ${self.usd_spent:.4f} spent, the next turn may pass tool_budget.usd ${self.usd:.4f}"
        return None

    def turn(self, usage: dict[str, Any]) -> None:
        self.tokens_spent += sum(v for k, v in usage.items() if k in ("prompt_tokens", "completion_tokens"))
        self.usd_spent += self.price.cost(usage)

    def take(self) -> bool:
        """One more tool call (or a turn without one), if the allowance has it."""
        if self.calls is not None and self.used >= self.calls:
            return False
        self.used += 1
        return True

    def countdown(self, result: Result) -> Result:
        """A result with the calls left appended, when few are (and no change was accepted)."""
        left = self.calls - self.used if self.calls is not None else 0
        if result.patch is not None or not 0 < left <= CALLS_LEFT_NOTE:
            return result
        return Result(f"{result.text}\n[{left} tool call{'s' * (left > 1)} left in this conversation: call propose with "
                      "your change before they run out]", ok=result.ok)
