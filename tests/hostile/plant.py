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


def try_the_neighbours(sandbox, tmp_path: Path, run_dir: Path, startup_timeout_s: float = 60,
                       harness: bool = True) -> tuple[dict, dict]:
    """A victim server (benign, a marker in its environment) and then the `neighbours` act in the same sandbox and
    run, told the victim's host pids (and the harness's, with `harness`), the marker and host paths of the run folder
    and of the victim's home and scratch. -> (what the act managed, what it was told plus the victim's state after:
    `stopped` pids, whether it still answered). Every path is first checked readable by the harness itself, so an
    unread path means the sandbox kept it out, not that it was missing."""
    import json
    import os
    import uuid

    from sandbox.host import process_tree, server_pid, stat_fields

    marker = "victim-" + uuid.uuid4().hex
    victim = sandbox.start(hostile_spec(tmp_path, "benign", name="victim", startup_timeout_s=startup_timeout_s,
                                        env={"NIGHTSHIFT_VICTIM": marker}))
    try:
        pids = sorted(process_tree(server_pid(victim)))
        assert pids, "the harness sees none of the victim's processes"
        (run_dir / "trace.jsonl").write_text('{"event": "the run\'s own record"}\n')
        homes = [getattr(victim, name, None) for name in ("home", "folder")]
        paths = [str(run_dir / "trace.jsonl"), *(str(p) for p in homes if p is not None),
                 f"/proc/{server_pid(victim)}/root/tmp", f"/proc/{server_pid(victim)}/environ"]
        for path in paths:  # raises where the harness itself cannot read it
            os.listdir(path) if os.path.isdir(path) else Path(path).read_bytes()
        told = {"pids": pids + ([os.getpid()] if harness else []), "marker": marker, "paths": paths}
        spec = hostile_spec(tmp_path, "neighbours", startup_timeout_s=startup_timeout_s)
        reach = spec.source_tree / "vllm" / "entrypoints" / "cli" / "reach.json"
        reach.write_text(json.dumps(told))
        reach.chmod(0o644)
        adversary = sandbox.start(spec)
        try:
            seen = observed(adversary)
        finally:
            adversary.stop()
        told["stopped"] = [pid for pid in pids if stat_fields(pid)[0] == "T"]
        with victim.sync_client(30) as client:
            told["answers"] = client.get("/health").status_code == 200
    finally:
        victim.stop()
    return seen, told


def cores_used(server, frozen: bool, seconds: float = 1.5) -> float:
    """Cores the server's processes used over `seconds`, held (`server.hold(True)`, as the benchmark freezes the idle
    side while the other is measured) or not; the server is let run after."""
    import time

    from sandbox.host import cpu_seconds, server_pid

    pid = server_pid(server)
    server.hold(frozen)
    try:
        time.sleep(0.3)
        before = cpu_seconds(pid)
        time.sleep(seconds)
        return (cpu_seconds(pid) - before) / seconds
    finally:
        server.hold(False)


def assert_held_work_stops(server) -> None:
    """The `idle_work` act's busy loop: held, the server uses no CPU; let run, it does (the control, before and
    after the hold). Beside busy tests a namespace server's loop got 0.17 of a core let run (CI); held, nothing of
    it runs (a namespace server's pid 1, the harness's supervisor, only waits on its pipe)."""
    assert cores_used(server, frozen=False, seconds=2) > 0.06
    held = cores_used(server, frozen=True, seconds=2)
    assert held < 0.02, held
    assert cores_used(server, frozen=False, seconds=2) > 0.06  # the hold is undone
