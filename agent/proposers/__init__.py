from agent.proposers.base import Attempt, ProposalContext, Proposer, ProposerExhausted


def make_proposer(task) -> Proposer:
    kind = task.proposer.kind
    if kind == "flags":
        from agent.proposers.flags import FlagsProposer

        return FlagsProposer(task.proposer, task.engine.args)
    if kind == "queue":
        from agent.proposers.queue import QueueProposer

        return QueueProposer(task.proposer.patches)
    if kind == "llm":
        from agent.proposers.llm import LlmProposer

        return LlmProposer.from_task(task)
    raise ValueError(f"unknown proposer kind {kind!r}")


__all__ = ["Attempt", "ProposalContext", "Proposer", "ProposerExhausted", "make_proposer"]
