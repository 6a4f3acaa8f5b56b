"""The LLM proposer's tools: read-only looks at the incumbent tree, and `propose`, which checks an edit at once; or,
in a conversation without read tools (`proposer.tools: off`), the one tool `Answer`: the answer itself is the proposal.

Every path a tool takes goes through `edits.checked_path`: relative, no `..`, no git metadata, and resolving
(symlinks followed) inside the checkout. Arguments are validated by pydantic models, whose JSON schemas are also
the tools' definitions for the OpenAI tools API. A refused call is answered with the reason (`ok` False), never
raised: the model reads it and tries again, within the proposal's budget.

`propose` answers like a compiler, check by check (edit surface, exact application, identity edits, py_compile of
every changed file, undefined names, the changed modules imported on the host, `git apply --check`, engine args
against the task's levers), with every problem it finds, not only the first; a proposal that passes them all
becomes the candidate. `candidate` returns any earlier candidate's diff and evidence. What small models send
wrongly is read as meant by agent/proposers/shims.py.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.proposers import checks, shims
from agent.proposers.edits import (
    Edit, EditError, Files, Patch, apply_edit, check_applies, checked_path, compile_errors, make_patch, parse_edits,
    summary_of, unified_diff,
)

READ_LINES = 300
"""The most lines one read_file returns."""
RESULT_CHARS = 16_000
"""The most characters of one tool result."""
GREP_FILE_BYTES = 2_000_000


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListArgs(Args):
    path: str = Field(".", description="a folder, relative to the tree's root")


class ReadArgs(Args):
    path: str = Field(description="a file, relative to the tree's root, e.g. vllm/v1/sample/sampler.py")
    start: int | None = Field(None, ge=1, description="first line (1-based)")
    end: int | None = Field(None, ge=1, description=f"last line (inclusive); at most {READ_LINES} lines are shown. "
                            f"A Python file longer than that, read without start and end, is answered by its "
                            f"outline: each class and def with its line")


GREP_MAX = 200


class GrepArgs(Args):
    pattern: str = Field(min_length=1, max_length=300, description="a regular expression (POSIX extended)")
    path: str = Field(".", description="a folder or file to search under")
    max_results: int = Field(50, ge=1, le=GREP_MAX, description=f"at most {GREP_MAX}; more is read as {GREP_MAX}")

    @field_validator("max_results", mode="before")
    @classmethod
    def at_most_the_cap(cls, value: Any) -> Any:
        return shims.at_most(value, GREP_MAX)


class NoArgs(Args):
    pass


class SearchReplace(Args):
    path: str
    search: str = Field(description="lines copied exactly from the file (without line numbers); must occur once "
                                    "unless replace_all is set")
    replace: str
    replace_all: bool = Field(False, description="change every occurrence of search (a rename), not just one")


class FunctionReplace(Args):
    path: str
    name: str = Field(description="the function or method to replace whole: `func` or `Class.method`")
    code: str = Field(description="the complete new definition (decorators included), nothing else")


TEXT_FIELDS = {"summary": 300, "hypothesis": 2000, "plan": 200, "reflection": 1000}
"""The free-text fields of `propose` and their lengths; a longer one is clipped."""


Scalar = bool | int | float | str | None


class CandidateArgs(Args):
    number: int = Field(ge=0, description="the candidate's number, as the notebook names it")


class ProposeArgs(Args):
    summary: str = Field(min_length=1, max_length=TEXT_FIELDS["summary"],
                         description="what the change does, one line")
    hypothesis: str = Field("", max_length=TEXT_FIELDS["hypothesis"],
                            description="why it should be faster and give the same tokens")
    plan: str = Field("", max_length=TEXT_FIELDS["plan"],
                      description="what this is: a new hot spot, a refinement of a near miss (name the candidate), "
                                  "or a repair (name the candidate)")
    reflection: str = Field("", max_length=TEXT_FIELDS["reflection"],
                            description="what the result of the candidate the opening asks about teaches (your "
                                        "judgement of its evidence: stage, interval, divergence), for the notebook")
    edits: list[SearchReplace] = Field(default_factory=list)
    functions: list[FunctionReplace] = Field(default_factory=list)
    blocks: str = Field("", description="alternatively, SEARCH/REPLACE or FUNCTION blocks as text")
    engine_args: dict[str, Scalar] = Field(
        default_factory=dict, description="engine args to change with (or instead of) the code, e.g. "
                                          "{\"max_num_seqs\": 512}; only the task's levers, null for vLLM's default")

    @model_validator(mode="before")
    @classmethod
    def unambiguous_shapes(cls, data: Any) -> Any:
        return shims.read_as_meant(data, TEXT_FIELDS)


TOOLS: dict[str, tuple[type[Args], str]] = {
    "list_dir": (ListArgs, "List a folder of the incumbent tree: subfolders (ending in /) and files with their sizes."),
    "read_file": (ReadArgs, f"Read a file of the incumbent tree, or a line range of it (at most {READ_LINES} lines "
                            f"a call). Lines are shown as 'N| text': the 'N| ' prefix is not part of the file."),
    "grep": (GrepArgs, "Search the incumbent tree's files for a regular expression: file:line: text."),
    "profile": (NoArgs, "The incumbent's profile at the benchmark's concurrency: the hottest vLLM functions "
                        "(file:line, self and cumulative seconds), and the GPU kernels by device time (on the CPU, "
                        "the torch ops)."),
    "notebook": (NoArgs, "The lab notebook: every earlier candidate's hypothesis, files, stage reached, speedup "
                         "and interval, and what was learned."),
    "branch_diff": (NoArgs, "The changes already kept on the run's branch (the tree already includes them)."),
    "candidate": (CandidateArgs, "Any earlier candidate in full: its diff and engine args, hypothesis, the stage it "
                                 "reached, speedup and interval, parity divergence or audit finding, and the "
                                 "reflection on it."),
    "propose": (ProposeArgs, "Submit a change: SEARCH/REPLACE edits and/or whole-function replacements, and/or "
                             "engine args among the task's levers. It is checked at once (edit surface, exact "
                             "application, identity edits, py_compile, undefined names, the changed modules "
                             "imported, git apply --check, the engine args and their values); fix what the answer "
                             "names and call propose again. A change that passes becomes the candidate that is "
                             "built, checked for identical tokens and benchmarked."),
}


def definitions() -> list[dict[str, Any]]:
    """The tools for the OpenAI tools API."""
    out = []
    for name, (model, description) in TOOLS.items():
        schema = model.model_json_schema()
        schema.pop("title", None)
        out.append({"type": "function", "function": {"name": name, "description": description,
                                                     "parameters": schema}})
    return out


def text_protocol() -> str:
    """The tools as the text protocol describes them."""
    lines = []
    for name, (model, description) in TOOLS.items():
        fields = ", ".join(f"{k}" + ("" if v.is_required() else "?") for k, v in model.model_fields.items())
        lines.append(f"- {name}({fields}): {description}")
    return "\n".join(lines)


@dataclass
class Result:
    text: str
    ok: bool = True
    patch: Patch | None = None
    hypothesis: str = ""
    plan: str = ""
    engine_args: dict[str, Any] = field(default_factory=dict)
    reflection: str = ""
    final: bool = False
    """The conversation ends with this rejection (an answer of a conversation without read tools)."""


@dataclass
class Toolbox:
    """The tools of one proposal, over one incumbent tree."""

    checkout: Path
    include: list[str]
    exclude: list[str]
    profile: Callable[[], str] = lambda: "(no profile)"
    notebook: Callable[[], str] = lambda: "(no entries yet)"
    branch_diff: str = ""
    seen: dict[str, int] = field(default_factory=dict)
    """`proposal_key` of the changes already proposed -> their candidate."""
    incumbent_args: dict[str, Any] = field(default_factory=dict)
    levers: list[str] = field(default_factory=list)
    """The engine args a candidate may change (edit_surface.engine_args)."""
    lever_values: dict[str, list[Any]] = field(default_factory=dict)
    """The values a lever may take, where the task limits them (edit_surface.engine_values)."""
    candidates: Callable[[int], str] = lambda number: f"error: no candidate {number} yet"
    import_timeout_s: float = 0.0
    hide_env: tuple[str, ...] = ()
    reflections: list[str] = field(default_factory=list)
    """The `reflection` of each propose call with valid arguments (accepted or not), in order."""

    def run(self, call: dict[str, Any]) -> Result:
        return self.call(str(call.get("name", "")), call.get("arguments", ""))

    def call(self, name: str, arguments: str | dict[str, Any] | None) -> Result:
        if name not in TOOLS:
            return Result(f"error: no tool {name!r}; the tools are {', '.join(TOOLS)}", ok=False)
        model = TOOLS[name][0]
        try:
            raw = arguments if isinstance(arguments, dict) else json.loads(arguments or "{}",
                                                                             object_pairs_hook=shims.keep_repeated_keys)
            if not isinstance(raw, dict):
                raise ValueError("the arguments must be a JSON object")
            args = model.model_validate(raw)
        except (ValueError, ValidationError) as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()) \
                if isinstance(exc, ValidationError) else str(exc)
            return Result(f"error: bad arguments for {name}: {detail[:800]}", ok=False)
        try:
            return getattr(self, f"_{name}")(args)
        except EditError as exc:
            return Result(f"error: {exc}", ok=False)

    # ---------------------------------------------------------------------------------------- looking
    def _list_dir(self, args: ListArgs) -> Result:
        rel, target = self._path(args.path)
        if not target.is_dir():
            return Result(f"error: {rel} is not a folder", ok=False)
        root = Path(self.checkout).resolve()
        lines = []
        for entry in sorted(target.iterdir(), key=lambda p: (not p.is_dir(), p.name)):
            if entry.name.startswith(".git") or entry.name == "__pycache__":
                continue
            try:
                inside = root in entry.resolve().parents
            except OSError:
                inside = False
            if not inside:
                lines.append(f"{entry.name} (a link out of the tree: not readable)")
            elif entry.is_dir():
                lines.append(f"{entry.name}/")
            else:
                lines.append(f"{entry.name} ({entry.stat().st_size} bytes)")
        return Result(_clip("\n".join(lines) or "(empty)"))

    def _read_file(self, args: ReadArgs) -> Result:
        rel, target = self._path(args.path)
        if not target.is_file():
            return Result(f"error: {rel} is not a file", ok=False)
        text = target.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        if args.start is None and args.end is None and len(lines) > READ_LINES and rel.endswith(".py"):
            outline = _outline(text)
            if outline:
                return Result(_clip(f"{rel}: {len(lines)} lines, more than one read shows ({READ_LINES}). Its "
                                    f"classes and functions (line| definition); read one with start and end:\n"
                                    + "\n".join(outline)))
        start = min(args.start or 1, max(len(lines), 1))
        end = min(args.end or start + READ_LINES - 1, len(lines), start + READ_LINES - 1)
        if args.end is not None and args.end < (args.start or 1):
            return Result(f"error: end {args.end} is before start {args.start or 1}", ok=False)
        width = len(str(end))
        body = "\n".join(f"{n:>{width}}| {lines[n - 1]}" for n in range(start, end + 1))
        more = f"\n[lines {start}-{end} of {len(lines)}]" if (start, end) != (1, len(lines)) else ""
        return Result(_clip(body + more))

    def _grep(self, args: GrepArgs) -> Result:
        rel, target = self._path(args.path)
        try:
            re.compile(args.pattern)
        except re.error as exc:
            return Result(f"error: bad pattern: {exc}", ok=False)
        hits = _git_grep(Path(self.checkout), args.pattern, rel)
        if hits is None:
            hits = _py_grep(Path(self.checkout), target, args.pattern)
        if not hits:
            return Result(f"no match for {args.pattern!r} under {rel}")
        shown = hits[:args.max_results]
        more = f"\n[{len(hits) - len(shown)} more matches]" if len(hits) > len(shown) else ""
        return Result(_clip("\n".join(shown) + more))

    def _profile(self, args: NoArgs) -> Result:
        return Result(_clip(self.profile()))

    def _notebook(self, args: NoArgs) -> Result:
        return Result(_clip(self.notebook()))

    def _candidate(self, args: CandidateArgs) -> Result:
        text = self.candidates(args.number)
        return Result(_clip(text), ok=not text.startswith("error:"))

    def _branch_diff(self, args: NoArgs) -> Result:
        return Result(_clip(self.branch_diff.strip() or "(none yet: the files are vLLM as released)"))

    def _path(self, path: str) -> tuple[str, Path]:
        if path.strip() in (".", "./", ""):
            return ".", Path(self.checkout)
        return checked_path(path, self.checkout)

    # ---------------------------------------------------------------------------------------- propose
    def _propose(self, args: ProposeArgs) -> Result:
        edits: list[Edit] = []
        report: list[str] = []
        if args.reflection.strip():
            self.reflections.append(args.reflection.strip())
        try:
            if args.blocks.strip():
                edits += parse_edits(args.blocks)
        except EditError as exc:
            return Result(f"REJECTED\nparse: {str(exc).removeprefix('parse: ')}", ok=False)
        edits += [Edit(path=e.path, search=e.search, replace=e.replace, index=0, replace_all=e.replace_all)
                  for e in args.edits]
        edits += [Edit(path=f.path, search="", replace=f.code, index=0, function=f.name) for f in args.functions]
        if not edits and not args.engine_args:
            return Result("REJECTED\nparse: no edits (give `edits`, `functions` or `blocks`, or `engine_args`)",
                          ok=False)
        for n, edit in enumerate(edits, 1):
            edit.index = n
        problems, changed = (check(edits, Path(self.checkout), self.include, self.exclude, report,
                                   import_timeout_s=self.import_timeout_s, hide_env=self.hide_env)
                             if edits else ([], {}))
        flags = {}
        if args.engine_args:
            flags, refused = lever_check(args.engine_args, self.incumbent_args, self.levers, self.lever_values)
            report.append("engine args: FAILED" if refused else
                          f"engine args: ok ({', '.join(f'{k}={json.dumps(v)}' for k, v in sorted(flags.items()))})")
            problems += refused
        patch = None
        if not problems:
            diff = unified_diff(changed) if changed else ""
            digest = proposal_key(diff, flags)
            if digest in self.seen:
                problems.append(f"duplicate: the same change as candidate {self.seen[digest]}, already tried")
            else:
                patch = Patch(diff=diff, files=sorted(changed), summary=args.summary.strip() or summary_of("", edits),
                              edits=edits)
        lines = report + problems
        if patch is not None:
            what = f"{len(patch.files)} file(s), {len(edits)} edit(s)" + (f", engine args {json.dumps(flags)}"
                                                                           if flags else "")
            lines.append(f"ACCEPTED: {what}; it is now built, checked for identical tokens and benchmarked")
            return Result("\n".join(lines), patch=patch, hypothesis=args.hypothesis, plan=args.plan,
                          engine_args=flags, reflection=args.reflection.strip())
        return Result("REJECTED: fix the problems below and call propose again\n" + "\n".join(lines), ok=False)


@dataclass
class Answer:
    """The one tool of a conversation without read tools: the answer itself, its edit blocks made a checked patch
    (edits.make_patch: parsed, inside the surface, applied exactly, `git apply --check`) that is no earlier
    candidate's. An answer that cannot be used is rejected with the reason, which ends its turn (`final`): the next
    answer is a follow-up or comes from a fresh conversation."""

    checkout: Path
    include: list[str]
    exclude: list[str]
    seen: dict[str, int]
    """`proposal_key` of the changes already proposed -> their candidate."""
    cap: str
    """The answer's cap as the request sent it, e.g. `max_tokens (2048)`."""

    def run(self, call: dict[str, Any]) -> Result:
        text = str(call.get("arguments") or "")
        if call.get("finish_reason") == "length":
            return Result(f"truncated: the answer hit {self.cap}; give a shorter answer with only the needed blocks",
                          ok=False, final=True)
        if not text.strip():
            return Result("empty: the answer has no text", ok=False, final=True)
        try:
            patch = make_patch(text, Path(self.checkout), self.include, self.exclude)
        except EditError as exc:
            return Result(str(exc), ok=False, final=True)
        if (key := proposal_key(patch.diff, {})) in self.seen:
            return Result(f"duplicate: the same change as candidate {self.seen[key]}, which was already tried",
                          ok=False, final=True)
        return Result("ACCEPTED", patch=patch)


def proposal_key(diff: str, engine_args: dict[str, Any]) -> str:
    """The identity of a proposed change: its diff and its engine args (sha256)."""
    return hashlib.sha256((diff + (json.dumps(engine_args, sort_keys=True) if engine_args else "")).encode()
                          ).hexdigest()


def lever_check(args: dict[str, Any], incumbent: dict[str, Any], levers: list[str],
                values: dict[str, list[Any]]) -> tuple[dict[str, Any], list[str]]:
    """(the engine args that change the incumbent's, the problems): each must be one of the task's levers, take an
    allowed value (the task's list, else a value of the incumbent's type, or null for vLLM's default), and change
    something."""
    problems: list[str] = []
    for name, value in sorted(args.items()):
        if name not in levers:
            problems.append(f"engine args: {name} is not a lever of this task (edit_surface.engine_args: "
                            f"{', '.join(levers) or 'none'})")
        elif name in values and value not in values[name]:
            problems.append(f"engine args: {name}={json.dumps(value)} is not allowed (allowed: "
                            f"{', '.join(json.dumps(v) for v in values[name])})")
        elif name not in values and value is not None and incumbent.get(name) is not None:
            base = incumbent[name]
            same = (isinstance(value, bool) == isinstance(base, bool)
                    and (isinstance(value, type(base)) or (isinstance(base, float) and isinstance(value, int))))
            if not same:
                problems.append(f"engine args: {name}={json.dumps(value)} is not of the incumbent's type "
                                f"({type(base).__name__}, now {json.dumps(base)})")
    changed = {k: v for k, v in args.items() if incumbent.get(k) != v}
    if not problems and not changed:
        problems.append("engine args: every value given is the incumbent's already (no change)")
    return changed, problems


def check(edits: list[Edit], checkout: Path, include: list[str], exclude: list[str], report: list[str],
          import_timeout_s: float = 0.0, hide_env: tuple[str, ...] = ()) -> tuple[list[str], Files]:
    """Every check of a proposal, in order, each answered on one line of `report`: the problems found, and the
    changed files {path: (old, new)}."""
    from agent.stages.surface import surface_allows

    problems: list[str] = []
    files: Files = {}
    outside = []
    for edit in edits:
        try:
            rel, _ = checked_path(edit.path, checkout)
        except EditError as exc:
            outside.append(f"{edit.label()}: {exc}")
            continue
        if not surface_allows(rel, include, exclude):
            outside.append(f"{edit.label()}: surface: {rel} is outside the edit surface (include {include}, "
                           f"exclude {exclude})")
    if outside:
        report.append("edit surface: FAILED")
        return problems + outside, {}
    report.append(f"edit surface: ok ({', '.join(sorted({e.path for e in edits}))})")
    failed = []
    for edit in edits:
        try:
            apply_edit(edit, files, checkout, include, exclude)
        except EditError as exc:  # propose's `edits` can also change every occurrence: say so where it helps
            failed.append(str(exc) + (" (or, in `edits`, set replace_all to change every occurrence)"
                                      if exc.code == "ambiguous" else ""))
    if failed:
        report.append(f"apply: FAILED ({len(failed)} of {len(edits)} edits)")
        return problems + [f"apply: {x}" for x in failed], {}
    report.append(f"apply: ok ({len(edits)} edit(s) applied exactly)")
    identities = [e for e in edits if e.identity]
    if identities:
        report.append("identity: FAILED")
        problems += [f"identity: {e.label()} on {e.path} is an identity edit: its new text is the same as the text "
                     f"it replaces (a real change must differ)" for e in identities]
        return problems, {}
    report.append("identity: ok (every edit changes the file)")
    changed = {k: v for k, v in files.items() if v[0] != v[1]}
    errors = compile_errors(changed)
    if errors:
        report.append("py_compile: FAILED")
        return problems + [f"py_compile: {e}" for e in errors], {}
    report.append(f"py_compile: ok ({', '.join(sorted(k for k in changed if k.endswith('.py'))) or 'no Python file'})")
    undefined = checks.undefined_names(changed)
    if undefined:
        report.append("names: FAILED")
        return problems + [f"names: {x}" for x in undefined], {}
    report.append("names: ok (no undefined name)")
    if import_timeout_s > 0:
        failed, note = checks.import_errors(checkout, changed, import_timeout_s, hide_env)
        if failed:
            report.append("import: FAILED")
            return problems + [f"import: {x}" for x in failed], {}
        report.append(f"import: ok{f' ({note})' if note else ''}")
    try:
        check_applies(unified_diff(changed), changed)
    except EditError as exc:
        report.append("git apply --check: FAILED")
        return problems + [str(exc)], {}
    report.append("git apply --check: ok")
    return problems, changed


# --------------------------------------------------------------------------------------------- helpers
OUTLINE_ENTRIES = 250


def _outline(source: str) -> list[str]:
    """`line| def name(...)` for each class, function and method (two levels deep), in file order; [] if the file
    does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out: list[str] = []

    def visit(nodes: list[ast.stmt], depth: int) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                out.append(f"{node.lineno:>6}| {'    ' * depth}{kind} {node.name}"
                           + (f"  (to {node.end_lineno})" if node.end_lineno else ""))
                if depth < 1:
                    visit(node.body, depth + 1)

    visit(tree.body, 0)
    if len(out) > OUTLINE_ENTRIES:
        out = out[:OUTLINE_ENTRIES] + [f"   ... and {len(out) - OUTLINE_ENTRIES} more: grep for a name"]
    return out


def _clip(text: str) -> str:
    if len(text) <= RESULT_CHARS:
        return text
    return text[:RESULT_CHARS] + f"\n[... {len(text) - RESULT_CHARS} more characters cut: ask for less]"


def _git_grep(checkout: Path, pattern: str, rel: str) -> list[str] | None:
    try:
        proc = subprocess.run(["git", "grep", "-n", "-I", "-E", "--no-color", "-e", pattern, "--", rel],
                              cwd=checkout, capture_output=True, text=True, timeout=60, errors="replace")
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode not in (0, 1):
        return None
    return [_short(line) for line in proc.stdout.splitlines() if not line.startswith(".git")]


def _py_grep(checkout: Path, target: Path, pattern: str) -> list[str]:
    regex = re.compile(pattern)
    root = checkout.resolve()
    files = [target] if target.is_file() else sorted(p for p in target.rglob("*") if p.is_file())
    hits = []
    for path in files:
        if ".git" in path.parts or "__pycache__" in path.parts or path.stat().st_size > GREP_FILE_BYTES:
            continue
        if root not in path.resolve().parents:
            continue
        rel = path.relative_to(checkout).as_posix()
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if regex.search(line):
                hits.append(_short(f"{rel}:{n}:{line}"))
    return hits


def _short(line: str) -> str:
    return line if len(line) <= 240 else line[:240] + "..."
