"""The edit surface: which files a patch may touch and which engine args a candidate may change."""
from __future__ import annotations

import fnmatch
import re
from typing import Any

from agent.world.task import EditSurface

_HEADER = re.compile(r"^(?:---|\+\+\+) (?:[ab]/)?(\S+)", re.M)
_GIT_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)", re.M)
_FORBIDDEN = re.compile(r"^(?:new|deleted) file mode 120000|^GIT binary patch|^(?:old|new) mode 120000", re.M)


def patch_paths(patch: str) -> list[str]:
    paths = set()
    for a, b in _GIT_HEADER.findall(patch):
        paths.update((a, b))
    paths.update(p for p in _HEADER.findall(patch) if p != "/dev/null")
    return sorted(paths)


def matches(path: str, globs: list[str]) -> bool:
    """fnmatch globs over paths relative to the checkout root (`*` also matches `/`)."""
    return any(fnmatch.fnmatchcase(path, g) for g in globs)


def surface_allows(path: str, include: list[str], exclude: list[str]) -> bool:
    return matches(path, include) and not matches(path, exclude)


def surface_violation(patch: str, surface: EditSurface) -> str | None:
    """Why this patch may not be applied, or None."""
    if not patch.strip():
        return None
    if _FORBIDDEN.search(patch):
        return "symlinks and binary patches are not allowed"
    paths = patch_paths(patch)
    if not paths:
        return "the patch names no files"
    for path in paths:
        if path.startswith("/") or ".." in path.split("/"):
            return f"{path}: paths must stay inside the checkout"
        if not matches(path, surface.include):
            return f"{path} is outside the edit surface ({', '.join(surface.include)})"
        if matches(path, surface.exclude):
            return f"{path} is excluded from the edit surface"
    return None


def engine_args_violation(args: dict[str, Any], baseline: dict[str, Any], allowed: list[str]) -> str | None:
    changed = sorted(k for k in set(args) | set(baseline) if args.get(k) != baseline.get(k))
    outside = [k for k in changed if k not in allowed]
    if outside:
        return f"engine args {outside} may not be changed (allowed: {allowed or 'none'})"
    return None
