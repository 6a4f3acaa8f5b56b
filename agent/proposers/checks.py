"""Checks `propose` runs before any server starts: names (pyflakes) and imports of the changed modules.

`undefined_names`: the undefined names a change brings (pyflakes' UndefinedName, UndefinedLocal, UndefinedExport,
and an import that is never bound), compared with the file before the change, so that what vLLM already had is not
blamed on the candidate.

`import_errors`: each changed module imported by the host's Python in a subprocess with a timeout, against the
candidate tree (the changed files served from a temporary folder in place of the incumbent's, the rest of the tree
as it is). A module that fails to import in the incumbent tree as well (a dependency this host lacks) is not
counted against the candidate: the answer says it was not checked. The code runs on the host, as the candidate's
code runs in the build; the endpoint's key is not in its environment.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from pyflakes import checker, messages

UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


def _undefined(source: str, path: str) -> list[str]:
    import ast

    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):
        return []
    found = checker.Checker(tree, filename=path)
    return [m.message % m.message_args for m in found.messages if isinstance(m, UNDEFINED)]


def undefined_names(changed: dict[str, tuple[str, str]]) -> list[str]:
    """`path: undefined name 'x'` for each undefined name the new text has more often than the old."""
    out: list[str] = []
    for path, (old, new) in sorted(changed.items()):
        if not path.endswith(".py"):
            continue
        before = Counter(_undefined(old, path)) if old else Counter()
        after = Counter(_undefined(new, path))
        for message, count in sorted((after - before).items()):
            out.append(f"{path}: {message}" + (f" ({count} times)" if count > 1 else ""))
    return out


def module_name(path: str) -> str | None:
    """`vllm/v1/sample/sampler.py` -> `vllm.v1.sample.sampler`; a package's `__init__.py` -> the package."""
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts)


IMPORTER = r"""
import importlib, importlib.machinery, importlib.util, json, sys, traceback
root, overlay, names = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.path.insert(0, root)

class Overlay:
    def find_spec(self, name, path=None, target=None):
        if name not in overlay:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        locations = spec.submodule_search_locations if spec is not None else None
        return importlib.util.spec_from_file_location(name, overlay[name], submodule_search_locations=locations)

sys.meta_path.insert(0, Overlay())
results = {}
for name in names:
    try:
        importlib.import_module(name)
        results[name] = ""
    except BaseException as exc:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        results[name] = "".join(lines[-6:])[-1500:]
print("NIGHTSHIFT-IMPORTS " + json.dumps(results))
"""


def _import(checkout: Path, overlay: dict[str, str], names: list[str], timeout_s: float,
            env: dict[str, str]) -> dict[str, str] | str:
    """{module: '' or the end of its traceback}, or why nothing could be learned (a timeout, a crash)."""
    try:
        proc = subprocess.run([sys.executable, "-c", IMPORTER, str(checkout), json.dumps(overlay), json.dumps(names)],
                              cwd=checkout, capture_output=True, text=True, timeout=timeout_s, env=env,
                              errors="replace")
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:g} s"
    except OSError as exc:
        return f"could not run: {exc}"
    for line in proc.stdout.splitlines():
        if line.startswith("NIGHTSHIFT-IMPORTS "):
            return json.loads(line.removeprefix("NIGHTSHIFT-IMPORTS "))
    return f"the importer exited {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"


def import_errors(checkout: Path, changed: dict[str, tuple[str, str]], timeout_s: float,
                  hide_env: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """(the failed imports of the candidate's changed modules, each with the end of its traceback; a note on what was
    not checked and why). Nothing runs for a timeout of 0."""
    modules = {name: path for path, (_, new) in sorted(changed.items()) if new and (name := module_name(path))}
    if timeout_s <= 0 or not modules:
        return [], "" if modules else "no Python module changed"
    env = {k: v for k, v in os.environ.items() if k not in hide_env and k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    names = sorted(modules)
    with tempfile.TemporaryDirectory(prefix="nightshift-import-") as tmp:
        overlay = {}
        for name, path in modules.items():
            target = Path(tmp) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(changed[path][1], encoding="utf-8")
            overlay[name] = str(target)
        candidate = _import(checkout, overlay, names, timeout_s, env)
    if isinstance(candidate, str):
        return [], f"not checked: {candidate}"
    failed = [n for n in names if candidate.get(n)]
    if not failed:
        return [], ""
    incumbent = _import(checkout, {}, failed, timeout_s, env)
    errors, notes = [], []
    for name in failed:
        before = incumbent.get(name, "") if isinstance(incumbent, dict) else None
        last = candidate[name].strip().splitlines()[-1] if candidate[name].strip() else candidate[name]
        if before is None or (before and before.strip().splitlines()[-1:] == [last]):
            notes.append(f"{modules[name]} not checked: the incumbent's fails on this host too ({last[:200]})")
        else:
            errors.append(f"{modules[name]}: import {name} failed:\n{candidate[name].rstrip()}")
    return errors, "; ".join(notes)
