"""Search the task's declared engine-arg space with Optuna (TPE), one configuration per candidate."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import optuna

from agent.proposers.base import Attempt, ProposalContext, ProposerExhausted
from agent.world.task import FlagsProposer as FlagsConfig
from traces.schema import Commit, Decision, Proposal, Record

optuna.logging.set_verbosity(optuna.logging.WARNING)


class FlagsProposer:
    name = "flags"
    spend_usd = 0.0

    @classmethod
    def from_task(cls, task) -> FlagsProposer:
        return cls(task.proposer, task.engine.args)

    def __init__(self, config: FlagsConfig, baseline_args: dict):
        self.space = config.space
        self.baseline = baseline_args
        self.study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=config.seed))
        self.tried: set[str] = {self._key({k: baseline_args.get(k) for k in self.space})}
        self.combinations = 1
        for values in self.space.values():
            self.combinations *= len(values)
        self.trials: dict[int, optuna.trial.Trial] = {}
        self.recorded: dict[int, dict] = {}
        """Restored proposals the search did not replay: told to the study as recorded trials."""

    @staticmethod
    def _key(params: dict) -> str:
        return json.dumps(params, sort_keys=True)

    def propose(self, ctx: ProposalContext) -> Proposal:
        for _ in range(200):
            if len(self.tried) >= self.combinations:
                break
            trial = self.study.ask()
            params = {name: trial.suggest_categorical(name, values) for name, values in self.space.items()}
            key = self._key({k: {**ctx.incumbent_args, **params}.get(k) for k in self.space})
            if key in self.tried:
                self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            self.tried.add(key)
            self.trials[ctx.candidate] = trial
            changed = {k: v for k, v in params.items() if ctx.incumbent_args.get(k) != v}
            summary = "flags: " + ", ".join(f"{k}={v}" for k, v in sorted(changed.items()))
            return Proposal(candidate=ctx.candidate, proposer=self.name, summary=summary, engine_args=params,
                            meta={"trial": trial.number})
        untried = self._first_untried(ctx.incumbent_args)
        if untried is None:
            raise ProposerExhausted("every configuration in the search space was tried")
        self.tried.add(self._key(untried))
        return Proposal(candidate=ctx.candidate, proposer=self.name, engine_args=untried,
                        summary="flags: " + ", ".join(f"{k}={v}" for k, v in sorted(untried.items())))

    def _first_untried(self, incumbent: dict) -> dict | None:
        for values in itertools.product(*self.space.values()):
            params = dict(zip(self.space, values))
            if self._key({k: {**incumbent, **params}.get(k) for k in self.space}) not in self.tried:
                return params
        return None

    def observe(self, attempt: Attempt) -> None:
        decision = attempt.decision
        params = self.recorded.pop(attempt.proposal.candidate, None)
        if params is not None and set(params) == set(self.space):
            self.study.add_trial(optuna.trial.create_trial(
                params=params, distributions={k: optuna.distributions.CategoricalDistribution(v)
                                              for k, v in self.space.items()},
                **({"value": decision.speedup} if decision.speedup is not None
                   else {"state": optuna.trial.TrialState.FAIL})))
        trial = self.trials.pop(attempt.proposal.candidate, None)
        if trial is None:
            return
        if decision.speedup is None:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            self.study.tell(trial, decision.speedup)

    def restore(self, records: list[Record]) -> None:
        """The recorded proposals again, through the same seeded search (its trials come out the same), each
        told its recorded outcome; with the incumbent's flags as they were at the time."""
        incumbent, proposals = dict(self.baseline), {}
        for event in (r.event for r in records):
            if isinstance(event, Proposal) and event.proposer == self.name:
                proposals[event.candidate] = event
                self._replay(event, incumbent)
            elif isinstance(event, Decision) and event.candidate in proposals:
                self.observe(Attempt(proposals[event.candidate], event))
            elif isinstance(event, Commit) and event.candidate in proposals:
                incumbent.update(proposals[event.candidate].engine_args)

    def _replay(self, recorded: Proposal, incumbent: dict) -> None:
        def key(params: dict) -> str:
            return self._key({k: {**incumbent, **params}.get(k) for k in self.space})

        ctx = ProposalContext(task=None, candidate=recorded.candidate, checkout=Path("."),
                              incumbent_args=dict(incumbent))
        try:
            again = self.propose(ctx)
        except ProposerExhausted:
            again = None
        if again is not None and again.engine_args == recorded.engine_args:
            return
        trial = self.trials.pop(recorded.candidate, None)  # not the same search here (another Optuna, say)
        if trial is not None:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        if again is not None:
            self.tried.discard(key(again.engine_args))
        self.tried.add(key(recorded.engine_args))
        self.recorded[recorded.candidate] = recorded.engine_args
