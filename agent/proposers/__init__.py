from agent.proposers.base import Attempt, ProposalContext, Proposer, ProposerExhausted


def make_proposer(task) -> Proposer:
    """The proposer of the task's kind (agent/extensions.py registers them)."""
    from agent.extensions import PROPOSERS

    return PROPOSERS.get(task.proposer.kind).build(task)


__all__ = ["Attempt", "ProposalContext", "Proposer", "ProposerExhausted", "make_proposer"]
