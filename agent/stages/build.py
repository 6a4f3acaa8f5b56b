"""Build: the candidate's Python tree, with the installed vLLM's compiled parts linked in."""
from __future__ import annotations

import compileall
import hashlib
import importlib.util
import os
import importlib.metadata
import py_compile
import time
from pathlib import Path

import git

from agent.world.checkout import COMPILED_SUFFIXES, installed_vllm
from traces.errors import NightshiftError
from traces.schema import Build

HASHED = py_compile.PycInvalidationMode.CHECKED_HASH


class BuildError(NightshiftError, RuntimeError):
    stage = "build"


def link_compiled_parts(tree: Path) -> Path:
    """Symlink every compiled file of the installed vLLM into `tree`; returns where they came from."""
    package, version = installed_vllm()
    for compiled in package.rglob("*"):
        if compiled.suffix not in COMPILED_SUFFIXES:
            continue
        link = tree / "vllm" / compiled.relative_to(package)
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(compiled)
    distributions = importlib.metadata.packages_distributions().get("vllm", ["vllm"])
    local = "+cpu" if any(d.endswith("-cpu") or d.endswith("_cpu") for d in distributions) else ""
    dist = tree / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}{local}\n")
    return package


def linked(tree: Path) -> bool:
    """Whether `tree` has the installed vLLM's compiled parts: `link_compiled_parts` writes its dist-info last."""
    _, version = installed_vllm()
    return (tree / f"vllm-{version}.dist-info" / "METADATA").is_file()


def precompile(tree: Path) -> None:
    """Byte-compile the whole tree with hash-checked pycs, so other trees can share them."""
    compileall.compile_dir(str(tree / "vllm"), quiet=1, workers=0, invalidation_mode=HASHED)


def share_bytecode(source: Path, tree: Path) -> int:
    """Hard-link `source`'s hash-checked pycs into `tree`: valid exactly where the source is identical."""
    linked = 0
    for pyc in source.glob("vllm/**/__pycache__/*.pyc"):
        target = tree / pyc.relative_to(source)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(pyc, target)
        linked += 1
    return linked


def build(candidate: int, worktree: Path, changed: list[str], bytecode_from: Path | None = None,
          link: bool = True) -> Build:
    """Compile the changed files, share or make bytecode, and (with `link`) link the installed vLLM's
    compiled parts in; a tree of pure Python (a test's stand-in for vLLM) builds with link=False."""
    started = time.time()
    for rel in changed:
        path = worktree / rel
        if path.suffix == ".py" and path.exists():
            pyc = Path(importlib.util.cache_from_source(str(path)))
            pyc.unlink(missing_ok=True)
            try:
                py_compile.compile(str(path), doraise=True, invalidation_mode=HASHED)
            except py_compile.PyCompileError as exc:
                raise BuildError(f"{rel} does not compile: {exc.msg.strip()[-2000:]}") from None
    if bytecode_from is not None:
        share_bytecode(bytecode_from, worktree)
    else:
        precompile(worktree)
    compiled_from = link_compiled_parts(worktree) if link else ""
    repo = git.Repo(worktree)
    repo.git.add("-A")
    tree = repo.git.write_tree()
    return Build(candidate=candidate, tree=tree, source_sha256=files_sha256(worktree, changed),
                 compiled_from=str(compiled_from), seconds=round(time.time() - started, 3))


def files_sha256(root: Path, files: list[str]) -> str:
    digest = hashlib.sha256()
    for rel in sorted(set(files)):
        path = root / rel
        digest.update(rel.encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest() if path.is_file() else b"<absent>")
    return digest.hexdigest()
