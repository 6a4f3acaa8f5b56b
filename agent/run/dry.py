"""A dry start: the task's proposer asked once for the first candidate, on this machine, with no server started and
no GPU. It shows before a night on the GPU that the task, the checkout's sources and the proposer work together (for
an LLM: the endpoint's request contract, the opening, the tools and the answers); nothing it proposes is run."""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import git

from agent.proposers import ProposalContext, make_proposer
from agent.world.checkout import CheckoutError, create_checkout, version_in
from agent.world.task import Task
from traces.schema import AnyEvent, LlmCall, Proposal


@dataclass
class DryStart:
    proposal: Proposal
    tree_version: str
    """The vLLM version of the sources the proposer read."""
    events: list[AnyEvent] = field(default_factory=list)
    """What the proposer recorded (its LLM calls and tool calls), as a run's trace would hold them."""
    notes: list[str] = field(default_factory=list)
    spend_usd: float = 0.0

    @property
    def llm_calls(self) -> list[LlmCall]:
        return [e for e in self.events if isinstance(e, LlmCall)]


def tree_version(tree: Path) -> str:
    """The vLLM version written in a source tree (vllm/_version.py), or "" where it has none."""
    return version_in(Path(tree) / "vllm")


def source_repo(task: Task, checkout: Path | None) -> git.Repo:
    """The checkout to read: `checkout`, else the task's `target.checkout`, else the installed vLLM's (made if
    missing). Any vLLM version is read (the task's may be for another machine); a tree that is not a vLLM git
    checkout is refused."""
    path = Path(checkout or task.target.checkout or create_checkout()[0]).expanduser().resolve()
    if not (path / ".git").exists():
        raise CheckoutError(f"{path} is not a git checkout (run `nightshift checkout` to make one)")
    if not (path / "vllm" / "__init__.py").is_file():
        raise CheckoutError(f"{path} has no vllm/__init__.py at its root")
    return git.Repo(path)


def dry_start(task: Task, checkout: Path | None = None,
              say: Callable[[str], None] = lambda note: None) -> DryStart:
    """The first proposal, read from a detached worktree of the checkout's HEAD (its committed sources, as a run's
    incumbent tree), removed afterwards. The proposer's profile is not taken: it runs the model on the target device.
    `say`: each note, as soon as it is known (before the proposer is asked)."""
    repo = source_repo(task, checkout)
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        say(text)

    if task.proposer.kind == "llm" and task.proposer.profile:
        task = task.model_copy(update={"proposer": task.proposer.model_copy(update={"profile": False})})
        note("no profile of the model: a dry start runs no model (a run profiles it on the target device)")
    scratch = Path(tempfile.mkdtemp(prefix="nightshift-dry-"))
    tree = scratch / "tree"
    repo.git.worktree("add", "--detach", str(tree), "HEAD")
    try:
        version = tree_version(tree)
        if version != task.target.vllm_version:
            note(f"the task targets vLLM {task.target.vllm_version}; the proposer read the sources of vLLM "
                 f"{version or '(unknown version)'} ({repo.working_dir} at {repo.head.commit.hexsha[:10]})")
        events: list[AnyEvent] = []

        def record(event: AnyEvent) -> str:
            events.append(event)
            return ""

        proposer = make_proposer(task)
        ctx = ProposalContext(task=task, candidate=1, checkout=tree, incumbent_args=dict(task.engine.args),
                              record=record)
        proposal = proposer.propose(ctx)
        return DryStart(proposal=proposal, tree_version=version, events=events, notes=notes,
                        spend_usd=float(getattr(proposer, "spend_usd", 0.0)))
    finally:
        repo.git.worktree("remove", "--force", str(tree))
        shutil.rmtree(scratch, ignore_errors=True)
