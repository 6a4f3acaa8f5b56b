"""SEARCH/REPLACE edit blocks: parse them out of an LLM's answer, apply them exactly to the
incumbent tree, and turn the result into a unified diff the loop can `git apply`.

The format (the one aider popularized; small and large models both produce it reliably):

    vllm/v1/sample/sampler.py
    <<<<<<< SEARCH
    exact lines of the current file
    =======
    the lines that replace them
    >>>>>>> REPLACE

The targeted form replaces one named function or method whole, found by its AST (the model
writes only the new definition; its indentation is adjusted to the old one's):

    vllm/v1/sample/sampler.py
    <<<<<<< FUNCTION Sampler.forward
    def forward(self, logits):
        ...
    >>>>>>> END

The path line may sit inside or outside a ``` fence. A SEARCH part must occur exactly once
in the file (after the earlier blocks of the same answer are applied); an empty SEARCH part
creates a new file. Nothing is fuzzy: an edit that does not match is an error with a reason.
The checkout is only read; the edited copies live in memory.
"""
from __future__ import annotations

import ast
import difflib
import py_compile
import re
import subprocess
import textwrap
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from agent.stages.surface import surface_allows

# Markers are matched leniently (small models drop some of the angle brackets, or all of
# them); the SEARCH text itself is matched exactly.
SEARCH = re.compile(r"^\s*(?:<{3,9}\s*SEARCH\b.*|SEARCH:?)\s*$")
DIVIDER = re.compile(r"^\s*={5,9}\s*$")
REPLACE = re.compile(r"^\s*(?:>{3,9}\s*REPLACE\b.*|REPLACE:?)\s*$")
FUNCTION = re.compile(r"^\s*<{3,9}\s*FUNCTION\s+([A-Za-z_][\w.]*)\s*$")
END = re.compile(r"^\s*>{3,9}\s*(?:END|REPLACE)\b.*$")
FENCE = re.compile(r"^\s*(```|~~~)")
SUMMARY = re.compile(r"^\s*(?:\*\*)?SUMMARY(?:\*\*)?\s*:\s*(.+)$", re.I | re.M)


class EditError(ValueError):
    """Why an answer can not become a patch. `code` is one of: parse, empty, path, surface, match,
    ambiguous, function, noop, identity, compile, check."""

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
    function: str = ""
    """Set for the targeted form: the qualified name (`Class.method` or `func`) whose definition `replace` is."""
    identity: bool = False
    """Set by `apply_edit` when the replacement equals what it replaces (up to trailing whitespace)."""
    replace_all: bool = False
    """Replace every occurrence of `search` (a rename), where otherwise it must occur exactly once."""

    def label(self) -> str:
        return f"block {self.index}" + (f" (function {self.function})" if self.function else "")


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
        if REPLACE.match(line) or END.match(line):
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
        function = FUNCTION.match(lines[i])
        if function:
            start, path = i, _block_path(lines, i, edits, "FUNCTION")
            body, i = _part(lines, i + 1, END, (SEARCH, FUNCTION), f"FUNCTION block for {path} is not closed",
                            f"line {start + 1}: FUNCTION block for {path} has no '>>>>>>> END' (truncated?)")
            edits.append(Edit(path=path, search="", replace=_join(body), index=len(edits) + 1,
                              function=function.group(1)))
            continue
        if not SEARCH.match(lines[i]):
            if DIVIDER.match(lines[i]) and edits == [] and any(REPLACE.match(x) for x in lines[i:]):
                raise EditError("parse", f"line {i + 1}: '=======' before any '<<<<<<< SEARCH'")
            i += 1
            continue
        start, path = i, _block_path(lines, i, edits, "SEARCH")
        search, i = _part(lines, i + 1, DIVIDER, (SEARCH, REPLACE), f"SEARCH block for {path} has no '=======' divider",
                          f"line {start + 1}: SEARCH block for {path} is not closed (no '=======')")
        replace, i = _part(lines, i, REPLACE, (SEARCH, DIVIDER), f"REPLACE part for {path} is not closed",
                           f"line {start + 1}: block for {path} has no '>>>>>>> REPLACE' (truncated?)")
        edits.append(Edit(path=path, search=_join(search), replace=_join(replace), index=len(edits) + 1))
    if not edits:
        raise EditError("parse", "no SEARCH/REPLACE block in the answer (and no FUNCTION block)")
    return edits


def _block_path(lines: list[str], i: int, edits: list[Edit], kind: str) -> str:
    path = _path_above(lines, i, edits)
    if not path:
        raise EditError("parse", f"line {i + 1}: a {kind} block without a file path on the line above it")
    return path


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


Files = dict[str, tuple[str | None, str]]
"""{path: (old text or None for a new file, current text)}"""


def apply_edits(edits: list[Edit], checkout: Path, include: list[str], exclude: list[str]) -> Files:
    """{path: (old text or None for a new file, new text)}; the checkout is only read."""
    files: Files = {}
    for edit in edits:
        apply_edit(edit, files, checkout, include, exclude)
    changed = {k: v for k, v in files.items() if v[0] != v[1]}
    if not changed:
        raise EditError("noop", "the edits change nothing")
    return changed


def checked_path(path: str, checkout: Path) -> tuple[str, Path]:
    """A path named by the model -> (clean relative path, the file under the checkout), refusing anything that
    leaves the tree: absolute paths, `..`, git metadata, a symlink that resolves outside. Raises EditError('path')."""
    rel = normalize_path(path)
    root = Path(checkout).resolve()
    target = Path(checkout) / rel
    try:
        resolved = target.resolve()
    except OSError as exc:
        raise EditError("path", f"{rel}: {exc}") from None
    if resolved != root and root not in resolved.parents:
        raise EditError("path", f"{rel} resolves outside the checkout")
    return rel, target


def apply_edit(edit: Edit, files: Files, checkout: Path, include: list[str], exclude: list[str]) -> None:
    """Apply one edit to the in-memory `files` (read from the checkout on first use). Raises EditError."""
    rel = normalize_path(edit.path)
    if not surface_allows(rel, include, exclude):
        raise EditError("surface", f"{rel} is outside the edit surface (include {include}, exclude {exclude})")
    rel, target = checked_path(rel, checkout)
    if rel not in files:
        if target.is_file():
            old = target.read_text(encoding="utf-8", errors="surrogateescape")
            files[rel] = (old, old)
        elif target.exists():
            raise EditError("path", f"{rel} is not a regular file")
        else:
            files[rel] = (None, "")
    old, current = files[rel]
    if edit.function:
        if old is None and not current:
            raise EditError("match", f"{edit.label()}: {rel} does not exist in the checkout"
                                     f"{_closest_path(rel, checkout, include, exclude)}")
        new, edit.search = replace_function(current, edit.function, edit.replace, rel)
        edit.identity = same_lines(edit.search, new)
        files[rel] = (old, new)
        return
    if not edit.search:
        if old is not None or current:
            raise EditError("match", f"block {edit.index}: empty SEARCH for {rel}, which already exists "
                                     f"(an empty SEARCH only creates a new file)")
        files[rel] = (None, edit.replace)
        return
    if old is None and not current:
        raise EditError("match", f"block {edit.index}: {rel} does not exist in the checkout"
                                 f"{_closest_path(rel, checkout, include, exclude)}")
    search = edit.search
    count = current.count(search)
    if count == 0 and not current.endswith("\n") and current.endswith(search[:-1]):
        search, count = search[:-1], 1
        edit.replace = edit.replace[:-1] if edit.replace.endswith("\n") else edit.replace
    if count == 0:
        raise EditError("match", f"block {edit.index}: the SEARCH text does not occur in {rel}"
                                 f"{_closest_hint(current, edit.search)}")
    if count > 1 and not edit.replace_all:
        raise EditError("ambiguous", f"block {edit.index}: the SEARCH text occurs {count} times in {rel}"
                                     f"{_occurrences(current, search, count)}; include more lines so that it is unique")
    edit.identity = same_lines(search, edit.replace)
    files[rel] = (old, current.replace(search, edit.replace, -1 if edit.replace_all else 1))


def _occurrences(text: str, search: str, count: int, most: int = 5) -> str:
    """' (lines 12: ..., 40: ...)': where the `count` occurrences of `search` start in `text` (the first `most`), each
    with its whole first line, so that a model can widen its SEARCH around the one it means."""
    starts, at = [], text.find(search)
    while at != -1 and len(starts) < most:
        starts.append(at)
        at = text.find(search, at + 1)
    lines = text.splitlines()
    shown = [f"{n}: {lines[n - 1].strip()[:80]!r}" for n in (text.count("\n", 0, a) + 1 for a in starts)]
    return f" (lines {', '.join(shown)}{', ...' if count > most else ''})"


def same_lines(a: str, b: str) -> bool:
    return [line.rstrip() for line in a.splitlines()] == [line.rstrip() for line in b.splitlines()]


def find_definition(source: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function or method `qualname` (`func`, `Class.method`, `Outer.Inner.method`) of a module's source."""
    body: list[ast.stmt] = ast.parse(source).body
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        found = [n for n in body if isinstance(n, kinds) and n.name == part]
        if not found:
            return None
        node = found[-1]  # a later definition of the same name is the one in effect
        if last:
            return node  # type: ignore[return-value]
        body = node.body  # type: ignore[attr-defined]
    return None


def replace_function(source: str, qualname: str, code: str, rel: str = "the file") -> tuple[str, str]:
    """`source` with the definition of `qualname` (with its decorators) replaced by `code`, re-indented to the
    old definition's column; returns (new source, the old definition's text). Raises EditError('function')."""
    try:
        node = find_definition(source, qualname)
    except SyntaxError as exc:
        raise EditError("function", f"{rel} does not parse ({exc.msg}, line {exc.lineno})") from None
    if node is None:
        names = sorted(_definitions(source))
        close = difflib.get_close_matches(qualname, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise EditError("function", f"{rel} has no function or method {qualname!r}{hint}")
    dedented = textwrap.dedent(code.strip("\n").expandtabs(8)) + "\n"
    try:
        new_body = ast.parse(dedented).body
    except SyntaxError as exc:
        raise EditError("function", f"the new definition of {qualname} does not parse: {exc.msg} "
                                    f"(its line {exc.lineno})") from None
    name = qualname.rsplit(".", 1)[-1]
    defs = [n for n in new_body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(new_body) != 1 or not defs or defs[0].name != name:
        raise EditError("function", f"the code must be exactly one definition of {name} (def {name}(...): ...), "
                                    f"with its decorators")
    lines = source.splitlines(keepends=True)
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
    end = node.end_lineno or node.lineno
    indent = " " * node.col_offset
    new = "".join(indent + line if line.strip() else line for line in dedented.splitlines(keepends=True))
    old = "".join(lines[start:end])
    if not old.endswith("\n"):
        new = new.rstrip("\n")
    return "".join(lines[:start]) + new + "".join(lines[end:]), old


def _definitions(source: str) -> set[str]:
    out: set[str] = set()

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(prefix + n.name)
            elif isinstance(n, ast.ClassDef):
                walk(n.body, prefix + n.name + ".")

    try:
        walk(ast.parse(source).body, "")
    except SyntaxError:
        pass
    return out


def compile_errors(changed: Files) -> list[str]:
    """`py_compile` of every changed Python file (on a scratch copy): one message per file that does not compile."""
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nightshift-compile-") as tmp:
        for n, (rel, (_old, new)) in enumerate(sorted(changed.items())):
            if not rel.endswith(".py"):
                continue
            src = Path(tmp) / f"{n}.py"
            src.write_text(new, encoding="utf-8", errors="surrogateescape")
            try:
                py_compile.compile(str(src), cfile=str(src) + "c", dfile=rel, doraise=True)
            except py_compile.PyCompileError as exc:
                errors.append(f"{rel}: {exc.exc_type_name}: {_compile_message(exc)}")
    return errors


def _compile_message(exc: py_compile.PyCompileError) -> str:
    inner = exc.exc_value
    if isinstance(inner, SyntaxError):
        line = (inner.text or "").strip()
        return f"line {inner.lineno}: {inner.msg}" + (f": {line[:120]!r}" if line else "")
    return str(inner)[:300]


def _closest_path(rel: str, checkout: Path, include: list[str], exclude: list[str]) -> str:
    """'; did you mean ...?' with up to 3 files of the same suffix inside the surface whose names are closest to
    `rel`'s (a model that names a file it has not seen usually has a real one in mind), or ''."""
    suffix = Path(rel).suffix
    names = [p.relative_to(checkout).as_posix() for p in Path(checkout).rglob(f"*{suffix}")
             if ".git" not in p.parts and "__pycache__" not in p.parts and p.is_file()]
    base = PurePosixPath(rel).name

    def ratio(a: str, b: str) -> float:
        return difflib.SequenceMatcher(None, a, b).ratio()

    scored = sorted(((ratio(base, PurePosixPath(n).name), ratio(rel, n), n) for n in names
                     if surface_allows(n, include, exclude)), reverse=True)
    close = [n for by_name, _, n in scored[:3] if by_name >= 0.75]
    return f"; did you mean {', '.join(close)}?" if close else ""


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


def unified_diff(changed: Files) -> str:
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


def check_applies(diff: str, changed: Files) -> None:
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
