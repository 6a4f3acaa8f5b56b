"""Git side of a run: the run branch, one worktree per candidate, commits with trailers."""
from __future__ import annotations

import fcntl
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import git
import yaml

from agent.world.serve_args import SERVE_FILE
from traces.errors import NightshiftError

EXCLUDES = ["*.so", "*.pyd", "/vllm-*.dist-info/", "/.nightshift/", "__pycache__/"]


class ApplyError(NightshiftError, RuntimeError):
    stage = "apply"


class Workspace:
    def __init__(self, repo: git.Repo, run_id: str, worktrees: Path):
        self.repo, self.run_id, self.worktrees = repo, run_id, worktrees
        self.branch = f"nightshift/{run_id}"
        common = Path(repo.git.rev_parse("--git-common-dir"))
        self.common = common if common.is_absolute() else Path(repo.working_dir) / common
        exclude = self.common / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        present = exclude.read_text().splitlines() if exclude.exists() else []
        with open(exclude, "a") as f:
            f.writelines(f"{line}\n" for line in EXCLUDES if line not in present)

    def create_branch(self, start: str) -> str:
        if self.branch in [h.name for h in self.repo.heads]:
            raise ApplyError(f"branch {self.branch} already exists in {self.repo.working_dir}")
        self.repo.git.branch(self.branch, start)
        return self.head()

    def head(self) -> str:
        return self.repo.git.rev_parse(self.branch)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Git's worktree bookkeeping is not safe to change from several processes at once (`worktree add`
        reads every other worktree's files, which another `add` may be writing, and `prune` may remove one
        being made): parallel workers, and runs that share a checkout, take this file lock around it."""
        with open(self.common / "nightshift-worktrees.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def worktree(self, name: str) -> Path:
        """A fresh detached worktree at the run branch's head."""
        return self.add(self.worktrees / name, self.head())

    def add(self, path: Path, commit: str) -> Path:
        """A fresh detached worktree of `commit` at `path` (one there before is removed). A relative `path` is
        this process's, not the checkout's, where git runs."""
        path = Path(path).absolute()
        with self.locked():
            if path.exists():
                self._remove(path)
            self.repo.git.worktree("add", "--detach", str(path), commit)
        return path

    def remove(self, path: Path) -> None:
        with self.locked():
            self._remove(path)

    def remove_under(self, root: Path) -> int:
        """Every worktree of this checkout under `root` (a dead harness's), locked ones unlocked first;
        returns how many."""
        root = root.resolve()
        with self.locked():
            blocks = [block.splitlines() for block in self.repo.git.worktree("list", "--porcelain").split("\n\n")]
            ours = [(Path(b[0].split(" ", 1)[1]), any(line.startswith("locked") for line in b)) for b in blocks
                    if b and b[0].startswith("worktree ") and root in Path(b[0].split(" ", 1)[1]).resolve().parents]
            for path, locked in ours:
                if locked:
                    self.repo.git.worktree("unlock", str(path))
                self._remove(path)
            self.repo.git.worktree("prune")
        return len(ours)

    def _remove(self, path: Path) -> None:
        try:
            self.repo.git.worktree("remove", "--force", str(path))
        except git.GitCommandError:
            shutil.rmtree(path, ignore_errors=True)
            self.repo.git.worktree("prune")

    def apply(self, worktree: Path, patch: str) -> list[str]:
        """Apply a unified diff to the worktree and its index; returns the changed paths."""
        if patch.strip():
            patch_file = worktree / ".nightshift" / "candidate.patch"
            patch_file.parent.mkdir(exist_ok=True)
            patch_file.write_text(patch if patch.endswith("\n") else patch + "\n")
            try:
                git.Repo(worktree).git.apply("--index", "--whitespace=nowarn", str(patch_file))
            except git.GitCommandError as exc:
                raise ApplyError(f"git apply failed: {exc.stderr.strip()[-1500:]}") from None
        changed = git.Repo(worktree).git.diff("--cached", "--name-only")
        return [line for line in changed.splitlines() if line]

    def commit(self, worktree: Path, engine_args: dict, message: str) -> str:
        """Commit the candidate (with its serving flags) and move the run branch onto it."""
        repo = git.Repo(worktree)
        (worktree / SERVE_FILE).write_text(yaml.safe_dump({"engine_args": engine_args}, sort_keys=True))
        repo.git.add("-A")
        repo.git.commit("-q", "--allow-empty", "-m", message,
                        env={"GIT_AUTHOR_NAME": "nightshift", "GIT_AUTHOR_EMAIL": "nightshift@localhost",
                             "GIT_COMMITTER_NAME": "nightshift", "GIT_COMMITTER_EMAIL": "nightshift@localhost"})
        sha = repo.head.commit.hexsha
        self.repo.git.update_ref(f"refs/heads/{self.branch}", sha, self.head())
        return sha


def serve_args_at(repo: git.Repo, commit: str) -> dict | None:
    try:
        text = repo.git.show(f"{commit}:{SERVE_FILE}")
    except git.GitCommandError:
        return None
    return (yaml.safe_load(text) or {}).get("engine_args")
