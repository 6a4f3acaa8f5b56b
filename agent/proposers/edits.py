"""SEARCH/REPLACE edit blocks: parse them out of an LLM's answer, apply them exactly to the
incumbent tree, and turn the result into a unified diff the loop can `git apply`.

The format (the one aider popularized; small and large models both produce it reliably):

    vllm/v1/sample/sampler.py
    <<<<<<< SEARCH
    exact lines of the current file
    =======
    the lines that replace them
    >>>>>>> REPLACE

The path line may sit inside or outside a ``` fence. A SEARCH part must occur exactly once
in the file (after the earlier blocks of the same answer are applied); an empty SEARCH part
creates a new file. Nothing is fuzzy: an edit that does not match is an error with a reason.
The checkout is only read; the edited copies live in memory.
"""
from __future__ import annotations

import difflib
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from agent.surface import surface_allows

# Markers are matched leniently (small models drop some of the angle brackets, or all of
# them); the SEARCH text itself is matched exactly.
SEARCH = re.compile(r"^\s*(?:<{3,9}\s*SEARCH\b.*|SEARCH:?)\s*$")
DIVIDER = re.compile(r"^\s*={5,9}\s*$")
REPLACE = re.compile(r"^\s*(?:>{3,9}\s*REPLACE\b.*|REPLACE:?)\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
SUMMARY = re.compile(r"^\s*(?:\*\*)?SUMMARY(?:\*\*)?\s*:\s*(.+)$", re.I | re.M)


class EditError(ValueError):
    """Why an answer can not become a patch. `code` is one of: parse, empty, path, surface, match,
    ambiguous, noop, check."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.args[0]}"


@dataclass
class Edit:
    path: str
    search: str
    replace: str
    index: int


@dataclass
class Patch:
    diff: str
    files: list[str]
    summary: str
    edits: list[Edit] = field(default_factory=list)


def _clean_path(line: str) -> str:
    text = line.strip().strip("`*").strip()
    text = re.sub(r"^(?:#+\s*)?(?:file(?:name)?|path)\s*[:=]\s*", "", text, flags=re.I).strip().strip("`*'\"")
    if text.startswith("```"):
        text = text.lstrip("`")
    # `python vllm/x.py` (a fence language glued to the path) or `vllm/x.py:` forms
    parts = text.split()
    if len(parts) == 2 and "/" in parts[1] and "/" not in parts[0]:
        text = parts[1]
    return text.rstrip(":").strip()


def _looks_like_path(text: str) -> bool:
    return bool(text) and " " not in text and ("/" in text or re.search(r"\.[A-Za-z0-9]{1,5}$", text) is not None)


def _path_above(lines: list[str], i: int, edits: list[Edit]) -> str:
    """The file path for the SEARCH marker at line i: the closest line above that is neither blank
    nor a bare fence; right after another block, that block's path may be left out."""
    j = i - 1
    while j >= 0:
        line = lines[j]
        if not line.strip():
            j -= 1
            continue
        if REPLACE.match(line):
            return edits[-1].path if edits else ""
        cleaned = _clean_path(line)
        if FENCE.match(line) and not _looks_like_path(cleaned):
            j -= 1
            continue
        return cleaned if _looks_like_path(cleaned) else ""
    return ""


def parse_edits(text: str) -> list[Edit]:
    """All SEARCH/REPLACE blocks of `text`, in order. Raises EditError('parse'/'empty')."""
    if not text or not text.strip():
        raise EditError("empty", "the answer is empty")
    lines = text.splitlines()
    edits: list[Edit] = []
    i = 0
    while i < len(lines):
        if not SEARCH.match(lines[i]):
            if DIVIDER.match(lines[i]) and edits == [] and any(REPLACE.match(x) for x in lines[i:]):
                raise EditError("parse", f"line {i + 1}: '=======' before any '<<<<<<< SEARCH'")
            i += 1
            continue
        start = i
        path = _path_above(lines, i, edits)
        if not path:
            raise EditError("parse", f"line {start + 1}: a SEARCH block without a file path on the line above it")
        search, i = _part(lines, i + 1, DIVIDER, (SEARCH, REPLACE), f"SEARCH block for {path} has no '=======' divider",
                          f"line {start + 1}: SEARCH block for {path} is not closed (no '=======')")
        replace, i = _part(lines, i, REPLACE, (SEARCH, DIVIDER), f"REPLACE part for {path} is not closed",
                           f"line {start + 1}: block for {path} has no '>>>>>>> REPLACE' (truncated?)")
        edits.append(Edit(path=path, search=_join(search), replace=_join(replace), index=len(edits) + 1))
    if not edits:
        raise EditError("parse", "no SEARCH/REPLACE block in the answer")
    return edits


def _part(lines: list[str], i: int, end: re.Pattern, stray: tuple[re.Pattern, ...], stray_error: str,
          open_error: str) -> tuple[list[str], int]:
    """The lines from i up to the `end` marker, and the index after it."""
    part: list[str] = []
    while i < len(lines) and not end.match(lines[i]):
        if any(marker.match(lines[i]) for marker in stray):
            raise EditError("parse", f"line {i + 1}: {stray_error}")
        part.append(lines[i])
        i += 1
    if i >= len(lines):
        raise EditError("parse", open_error)
    return part, i + 1


def _join(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def summary_of(text: str, edits: list[Edit]) -> str:
    match = SUMMARY.search(text or "")
    if match:
        return match.group(1).strip()[:200]
    return "edit " + ", ".join(sorted({e.path for e in edits}))


def normalize_path(path: str) -> str:
    """A clean path relative to the checkout root. Raises EditError('path')."""
    raw = path.strip().replace("\\", "/")
    for prefix in ("a/", "b/", "./"):
        if raw.startswith(prefix) and len(raw) > len(prefix):
            raw = raw[len(prefix):]
    pure = PurePosixPath(raw)
    if not raw or pure.is_absolute() or ".." in pure.parts or raw.startswith("~"):
        raise EditError("path", f"{path!r} is not a path inside the checkout")
    if any(part.startswith(".git") for part in pure.parts):
        raise EditError("path", f"{path!r} is inside git metadata")
    return str(pure)


def apply_edits(edits: list[Edit], checkout: Path, include: list[str], exclude: list[str]
                ) -> dict[str, tuple[str | None, str]]:
    """{path: (old text or None for a new file, new text)}; the checkout is only read."""
    checkout = Path(checkout)
    root = checkout.resolve()
    files: dict[str, tuple[str | None, str]] = {}
    for edit in edits:
        rel = normalize_path(edit.path)
        if not surface_allows(rel, include, exclude):
            raise EditError("surface", f"{rel} is outside the edit surface (include {include}, exclude {exclude})")
        target = checkout / rel
        try:
            if root not in target.resolve().parents:
                raise EditError("path", f"{rel} resolves outside the checkout")
        except OSError as exc:
            raise EditError("path", f"{rel}: {exc}") from None
        if rel not in files:
            if target.is_file():
                old = target.read_text(encoding="utf-8", errors="surrogateescape")
                files[rel] = (old, old)
            elif target.exists():
                raise EditError("path", f"{rel} is not a regular file")
            else:
                files[rel] = (None, "")
        old, current = files[rel]
        if not edit.search:
            if old is not None or current:
                raise EditError("match", f"block {edit.index}: empty SEARCH for {rel}, which already exists "
                                         f"(an empty SEARCH only creates a new file)")
            files[rel] = (None, edit.replace)
            continue
        if old is None and not current:
            raise EditError("match", f"block {edit.index}: {rel} does not exist in the checkout")
        search = edit.search
        count = current.count(search)
        if count == 0 and not current.endswith("\n") and current.endswith(search[:-1]):
            search, count = search[:-1], 1
            edit.replace = edit.replace[:-1] if edit.replace.endswith("\n") else edit.replace
        if count == 0:
            raise EditError("match", f"block {edit.index}: the SEARCH text does not occur in {rel}"
                                     f"{_closest_hint(current, edit.search)}")
        if count > 1:
            raise EditError("ambiguous", f"block {edit.index}: the SEARCH text occurs {count} times in {rel}; "
                                         f"include more lines so that it is unique")
        files[rel] = (old, current.replace(search, edit.replace, 1))
    changed = {k: v for k, v in files.items() if v[0] != v[1]}
    if not changed:
        raise EditError("noop", "the edits change nothing")
    return changed


def _closest_hint(text: str, search: str) -> str:
    first = next((line for line in search.splitlines() if line.strip()), "")
    if not first:
        return ""
    lines = text.splitlines()
    stripped = first.strip()
    for number, line in enumerate(lines, 1):
        if line.strip() == stripped:
            if line != first:
                return f" (its first line matches line {number} only up to indentation/whitespace)"
            return f" (its first line matches line {number}, but the lines after it differ)"
    close = difflib.get_close_matches(first, lines, n=1, cutoff=0.75)
    if close:
        return f" (closest line: {lines.index(close[0]) + 1}: {close[0].strip()[:120]!r})"
    return " (not even its first line is in the file)"


def unified_diff(changed: dict[str, tuple[str | None, str]]) -> str:
    """A git-style unified diff, paths a/... and b/... relative to the checkout root."""
    out: list[str] = []
    for rel in sorted(changed):
        old, new = changed[rel]
        out.append(f"diff --git a/{rel} b/{rel}\n")
        if old is None:
            out.append("new file mode 100644\n")
        old_lines = (old or "").splitlines(keepends=True)
        new_lines = new.splitlines(keepends=True)
        body = list(difflib.unified_diff(old_lines, new_lines,
                                         "/dev/null" if old is None else f"a/{rel}", f"b/{rel}", n=3))
        for line in body:
            if line.startswith(("---", "+++")):
                out.append(line.rstrip("\n") + "\n")
            elif line.endswith("\n"):
                out.append(line)
            else:
                out.append(line + "\n\\ No newline at end of file\n")
    return "".join(out)


def check_applies(diff: str, changed: dict[str, tuple[str | None, str]]) -> None:
    """`git apply --check` the diff on a scratch copy of the touched files. Raises EditError('check')."""
    with tempfile.TemporaryDirectory(prefix="nightshift-edit-") as tmp:
        root = Path(tmp)
        for rel, (old, _new) in changed.items():
            if old is not None:
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(old, encoding="utf-8", errors="surrogateescape")
        (root / "candidate.diff").write_text(diff, encoding="utf-8", errors="surrogateescape")
        proc = subprocess.run(["git", "apply", "--check", "candidate.diff"], cwd=root, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise EditError("check", f"git apply --check failed: {proc.stderr.strip()[:500]}")


def make_patch(text: str, checkout: Path, include: list[str], exclude: list[str]) -> Patch:
    """An LLM answer -> a checked unified diff against `checkout`. Raises EditError."""
    edits = parse_edits(text)
    changed = apply_edits(edits, checkout, include, exclude)
    diff = unified_diff(changed)
    check_applies(diff, changed)
    return Patch(diff=diff, files=sorted(changed), summary=summary_of(text, edits), edits=edits)
