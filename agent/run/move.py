"""A run resumed where it has never been: from a pack (`nightshift pack`) on another host, in another run folder,
with another vLLM checkout or NIGHTSHIFT_CACHE (`nightshift run --resume <pack.tgz | folder>`, docs/resume.md).

The pack is unpacked into the runs folder (each file checked against the manifest's sha256), the run is audited
against its bundled branch as `replay` audits it, and the branch is brought into this host's checkout: one
made by `nightshift checkout` from the installed vLLM (or `--checkout PATH`), whose sources must be the run's
base commit's. Where the run was and where it goes on is the `moved` field of the `resumed` record.

A queue run's patch folder is recorded as an absolute path; the pack carries its patches (`queued-patches/`), and a
host where that folder is absent (and not in this project at the same place) reads the carried copy."""
from __future__ import annotations

import hashlib
import json
import socket
import tarfile
from dataclasses import dataclass
from pathlib import Path

import git

from agent.replay.chain import BUNDLE, checkout_of
from agent.world.checkout import create_checkout, default_checkout_path, open_checkout, version_tag
from agent.world.paths import cache_root
from sandbox.host import owner_alive, same_boot
from traces.errors import NightshiftError
from traces.schema import Moved, Record, Resumed, RunStarted

MANIFEST = "manifest.json"
QUEUE = "queued-patches"
"""A queue run's patch files as packed, in the run folder: a host without the recorded patch folder reads these."""
QUEUE_SUFFIXES = (".patch", ".diff")


class MoveRefused(NightshiftError):
    stage = "resume"


@dataclass
class Arrival:
    """A run folder to resume, and the pack it came from (none: a folder given as it is)."""

    run_dir: Path
    pack: str = ""
    pack_sha256: str = ""


def is_pack(run: str) -> bool:
    return Path(run).is_file() and tarfile.is_tarfile(run)


def unpack(pack: Path, runs_dir: Path) -> Arrival:
    """PACK's run folder in RUNS_DIR, each file checked against the pack's manifest. A folder already there
    from an earlier attempt with this pack (same trace) is taken as it is; one with another trace is refused."""
    pack = Path(pack).resolve()
    digest = hashlib.sha256(pack.read_bytes()).hexdigest()
    try:
        with tarfile.open(pack, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
            unsafe = [m.name for m in members if Path(m.name).is_absolute() or ".." in Path(m.name).parts]
            if unsafe:
                raise MoveRefused(f"{pack} has paths outside its run folder: {unsafe[:3]}")
            tops = {Path(m.name).parts[0] for m in members}
            if len(tops) != 1:
                raise MoveRefused(f"{pack} is not a pack of one run (top folders: {sorted(tops)[:3]})")
            run_id = tops.pop()
            files = {Path(m.name).relative_to(run_id).as_posix(): tar.extractfile(m).read() for m in members}
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise MoveRefused(f"cannot read the pack {pack}: {exc}") from None
    if MANIFEST not in files or "trace.jsonl" not in files or BUNDLE not in files:
        raise MoveRefused(f"{pack} is not a run pack (it needs {MANIFEST}, trace.jsonl and {BUNDLE})")
    manifest = json.loads(files[MANIFEST])
    for name, entry in manifest.get("files", {}).items():
        data = files.get(name)
        if data is None or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise MoveRefused(f"the pack {pack} is damaged: {name} is {'missing' if data is None else 'changed'}")
    dest = Path(runs_dir).resolve() / run_id
    if dest.exists():
        if (dest / "trace.jsonl").is_file() and (dest / "trace.jsonl").read_bytes() == files["trace.jsonl"] \
                and (dest / BUNDLE).is_file():
            return Arrival(dest, str(pack), digest)
        raise MoveRefused(f"{dest} already exists and is not this pack's run as packed: resume it with "
                          f"`nightshift run --resume {dest}`, or unpack the pack elsewhere (--runs-dir)")
    staging = dest.with_name(f".{run_id}.unpacking")
    staging.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    staging.rename(dest)
    return Arrival(dest, str(pack), digest)


def queued_patches(records: list[Record], run_dir: Path) -> tuple[str, dict[str, bytes]]:
    """A queue run's patch files to pack, as `queued-patches/NAME`, and the folder they came from: the task's
    recorded folder where it exists, else the copy a pack brought into the run folder. ('', {}): not a queue run,
    or neither folder is here."""
    for folder in queue_folders(records[0].event.task, run_dir):
        if folder.is_dir():
            return str(folder), {f"{QUEUE}/{p.name}": p.read_bytes() for p in sorted(folder.iterdir())
                                 if p.suffix in QUEUE_SUFFIXES and p.is_file()}
    return "", {}


def queue_folders(task: dict, run_dir: Path) -> list[Path]:
    proposer = task.get("proposer") or {}
    if proposer.get("kind") != "queue" or not proposer.get("patches"):
        return []
    return [Path(proposer["patches"]), Path(run_dir) / QUEUE]


def find_queue(task, run_dir: Path) -> str:
    """Where a resumed queue run reads its patches (TASK's paths already mapped onto this host): the recorded
    folder (or its place in this project) where it exists, else the pack's copy in the run folder, which the task
    is pointed at. Returns the folder ('' for another proposer)."""
    if getattr(task.proposer, "kind", "") != "queue":
        return ""
    carried = Path(run_dir) / QUEUE
    if not Path(task.proposer.patches).is_dir() and carried.is_dir():
        task.proposer.patches = carried
    return str(task.proposer.patches)


def refuse_if_alive_here(run_dir: Path) -> None:
    """A pack taken while its harness ran, resumed on the harness's host while it still runs, is refused: both
    would go on from the same state. On another host the recorded pid means nothing; the pack says it was live."""
    manifest = _manifest(run_dir)
    harness = manifest.get("harness", "")
    if harness and same_boot(harness) and owner_alive(harness):  # identity: host:boot id:pid:start time
        raise MoveRefused(f"run {manifest.get('run_id')} still runs on this host (pid {harness.split(':')[2]}, "
                          f"in {manifest.get('run_dir')}): stop it first (the pack was taken while it ran), or let "
                          f"it go on where it is")


def _manifest(run_dir: Path) -> dict:
    path = Path(run_dir) / MANIFEST
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        raise MoveRefused(f"{path} is not valid JSON") from None


def last_place(records: list[Record], run_dir: Path) -> dict:
    """Where the run was last: the pack's manifest (where it was packed), else its last move or its start."""
    manifest = _manifest(run_dir)
    if manifest.get("host"):
        return {k: manifest.get(k, "") for k in ("host", "run_dir", "checkout", "cache")}
    return traced_place(records)


def traced_place(records: list[Record]) -> dict:
    """Where the trace says the run is: its last move, or its start."""
    moves = [r.event.moved for r in records if isinstance(r.event, Resumed) and r.event.moved is not None]
    if moves:
        m = moves[-1]
        return {"host": m.to_host, "run_dir": m.to_run_dir, "checkout": m.to_checkout, "cache": m.to_cache}
    started: RunStarted = records[0].event
    return {"host": started.host, "run_dir": started.run_dir, "checkout": started.checkout, "cache": started.cache}


def moved(records: list[Record], run_dir: Path, checkout: Path, arrival: Arrival, queue: str = "") -> Moved | None:
    """The `moved` field of the resumed record: None where nothing known of the last place differs from here."""
    was = last_place(records, run_dir)
    now = {"host": socket.gethostname(), "run_dir": str(run_dir), "checkout": str(checkout),
           "cache": str(cache_root())}
    if not arrival.pack and not any(was[k] and was[k] != now[k] for k in now):
        return None
    packed_live = bool(_manifest(run_dir).get("harness_alive"))
    return Moved(**{f"from_{k}": v for k, v in was.items()}, **{f"to_{k}": v for k, v in now.items()},
                 pack=arrival.pack, pack_sha256=arrival.pack_sha256, packed_live=packed_live, queue=queue)


def place_checkout(run_dir: Path, records: list[Record], version: str, checkout: Path | None,
                   linked: bool) -> Path:
    """The checkout the run goes on in. A folder with its branch bundle (a pack) brings the branch into CHECKOUT
    (default: the installed vLLM's, made by `nightshift checkout` if missing); otherwise the run's own."""
    started: RunStarted = records[0].event
    bundle = Path(run_dir) / BUNDLE
    if not bundle.is_file():
        here = Path(checkout_of(records))
        if checkout is not None and Path(checkout).resolve() != here.resolve():
            raise MoveRefused(f"--checkout {checkout}: the run's branch is in {here}; another checkout takes a "
                              f"pack of the run (nightshift pack)")
        if not (here / ".git").exists():
            raise MoveRefused(f"the run's checkout {here} is not on this host: pack the run where it ran "
                              f"(nightshift pack) and resume the pack here")
        return here
    path = Path(checkout or default_checkout_path(version)).resolve()
    if not (path / ".git").exists():
        if not linked:
            raise MoveRefused(f"no vLLM checkout at {path} (nightshift checkout --dest {path} makes one)")
        create_checkout(path)
    repo = open_checkout(path, version)
    import_branch(repo, bundle.resolve(), started)
    return path


def import_branch(repo: git.Repo, bundle: Path, started: RunStarted) -> None:
    """The bundle's run branch into REPO, whose v<version> tag must hold the run's base sources (the same commit,
    or the same tree: a checkout made at another time); a branch already there must be an ancestor of the
    bundle's head (the run has not gone on in this checkout meanwhile)."""
    staging = f"refs/nightshift-move/{started.run_id}"
    try:
        repo.git.bundle("verify", "--quiet", str(bundle))
        repo.git.fetch("--quiet", "--no-tags", str(bundle), f"+refs/heads/{started.branch}:{staging}")
    except git.GitCommandError as exc:
        raise MoveRefused(f"cannot read the pack's branch bundle {bundle}: {exc.stderr.strip()[-500:]}") from None
    try:
        tag = version_tag(started.vllm_version)
        ours, theirs = (repo.git.rev_parse(f"{ref}^{{tree}}") for ref in (tag, started.base_commit))
        if ours != theirs:
            changed = repo.git.diff("--name-only", tag, started.base_commit).splitlines()
            raise MoveRefused(
                f"the checkout {repo.working_dir} (tag {tag}, {repo.git.rev_parse(tag)[:12]}) is not the run's base "
                f"{started.base_commit[:12]}: {len(changed)} file(s) differ, e.g. {', '.join(changed[:3])}; install "
                f"the vLLM the run started with (nightshift checkout builds its checkout from the installed one)")
        head = repo.git.rev_parse(staging)
        branch = f"refs/heads/{started.branch}"
        try:
            present = repo.git.rev_parse("--verify", "--quiet", branch)
        except git.GitCommandError:
            present = ""
        if present and present != head and not repo.is_ancestor(present, head):
            raise MoveRefused(f"branch {started.branch} in {repo.working_dir} is at {present[:12]}, which the pack's "
                              f"head {head[:12]} does not contain: the run went on in this checkout after the pack "
                              f"was taken; resume it there, or a newer pack")
        if present != head:
            repo.git.update_ref(branch, head, *([present] if present else []))
    finally:
        repo.git.update_ref("-d", staging)


def settled(run_dir: Path) -> None:
    """Once the resumed record (with its `moved`) is on disk the branch lives in the checkout: the bundle and the
    manifest it came with are dropped, so that `replay` reads the branch as it grows."""
    for name in (BUNDLE, MANIFEST):
        (Path(run_dir) / name).unlink(missing_ok=True)
