"""Worktrees of one checkout made and removed by several processes at once, as parallel workers and runs
that share a checkout do. Without agent/run/workspace.py's lock, plain `git worktree add/remove` by four
processes, 25 rounds each, failed in 5 of 5 tries ("failed to read .git/worktrees/candidate-12/commondir"):
git reads every other worktree's files while another process is still writing them. It failed CI once
the same way, in a resumed parallel run."""
import multiprocessing
from pathlib import Path

import git
import pytest

from agent.run.workspace import Workspace


def churn(checkout: str, worker: int, rounds: int) -> int:
    repo = git.Repo(checkout)
    workspace = Workspace(repo, f"w{worker}", Path(checkout).parent / "trees" / f"w{worker}")
    head = repo.head.commit.hexsha
    for k in range(rounds):
        path = workspace.add(workspace.worktrees / f"candidate-{k % 3}", head)  # names repeat, as candidates' do
        assert (path / "f1").read_text() == "1\n"
        workspace.remove(path)
    return rounds


@pytest.mark.slow
def test_worktrees_made_and_removed_by_four_processes_at_once(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for i in range(200):
        (checkout / f"f{i}").write_text(f"{i}\n")
    repo = git.Repo.init(checkout)
    repo.git.add("-A")
    repo.git.commit("-qm", "files", env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                         "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    with multiprocessing.get_context("forkserver").Pool(4) as pool:
        done = pool.starmap(churn, [(str(checkout), worker, 25) for worker in range(4)])
    assert done == [25] * 4
    assert repo.git.worktree("list").count("\n") == 0  # only the checkout itself is left
    assert not list((tmp_path / "trees").rglob("f1"))
