"""Proof that a patch was live: the patched files were among the files the server imported.

The server only says which files it opened; the hashes are computed here, from the tree."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from sandbox.base import Server
from traces.schema import Liveness


@dataclass
class Proof:
    liveness: Liveness
    missing: list[str]


def check(server: Server, tree: Path, patched: list[str]) -> Proof:
    imported = [f for f in server.imported_files() if f.startswith("vllm/")]
    digest = hashlib.sha256()
    for rel in imported:
        path = tree / rel
        data = path.read_bytes() if path.is_file() else b"<absent>"
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    patched_py = sorted(f for f in patched if f.endswith(".py") and (tree / f).is_file())
    imported_set = set(imported)
    live = [f for f in patched_py if f in imported_set]
    return Proof(Liveness(patched_files=sorted(patched), imported_patched=live,
                          imported_vllm_modules=len(imported), imported_sha256=digest.hexdigest()),
                 [f for f in patched_py if f not in imported_set])
