"""Plants a hostile candidate: a tree whose `python -m vllm.entrypoints.cli.main` runs one act
from this folder, then the standard-library stub server."""
from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).parent
ACTS = sorted(p.stem for p in (HERE / "acts").glob("*.py"))


def plant(act: str, dest: Path) -> Path:
    """Write the candidate tree for `act` (a module name under hostile/acts) at dest; returns dest."""
    if act not in ACTS:
        raise ValueError(f"no hostile act {act!r}; known: {ACTS}")
    cli = dest / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (dest / "vllm", dest / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    shutil.copy(HERE / "stub_server.py", cli / "stub_server.py")
    shutil.copy(HERE / "acts" / f"{act}.py", cli / "main.py")
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def hostile_spec(tmp_path: Path, act: str, name: str | None = None, startup_timeout_s: float = 60, **fields):
    """A ServerSpec for the planted candidate `act`, with an empty model folder beside it."""
    from sandbox.base import ServerSpec

    name = name or act
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    tree = plant(act, tmp_path / f"tree-{name}")
    return ServerSpec(name=name, labels={"candidate": name}, source_tree=tree, model_dir=model,
                      startup_timeout_s=startup_timeout_s, **fields)


def observed(server) -> dict:
    """What the stub server saw from inside its sandbox."""
    with server.sync_client(30) as client:
        return client.get("/observed").json()
