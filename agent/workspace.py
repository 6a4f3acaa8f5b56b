"""Git side of a run: the run branch, one worktree per candidate, commits with trailers."""
from __future__ import annotations

import shutil
from pathlib import Path

import git
import yaml

from traces.errors import NightshiftError

SERVE_FILE = "nightshift.serve.yaml"
EXCLUDES = ["*.so", "*.pyd", "/vllm-*.dist-info/", "/.nightshift/", "__pycache__/"]


class ApplyError(NightshiftError, RuntimeError):
    stage = "apply"


class Workspace:
    def __init__(self, repo: git.Repo, run_id: str, worktrees: Path):
        self.repo, self.run_id, self.worktrees = repo, run_id, worktrees
        self.branch = f"nightshift/{run_id}"
        exclude = Path(repo.git.rev_parse("--git-common-dir"))
        exclude = (exclude if exclude.is_absolute() else Path(repo.working_dir) / exclude) / "info" / "exclude"
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

    def worktree(self, name: str) -> Path:
        """A fresh detached worktree at the run branch's head."""
        path = self.worktrees / name
        if path.exists():
            self.remove(path)
        self.repo.git.worktree("add", "--detach", str(path), self.head())
        return path

    def remove(self, path: Path) -> None:
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
