"""Pack a run folder for the trip back: trace, task, summary, server log tails, the branch as patches."""
import io
import sys
import tarfile
from pathlib import Path

import git

run, log, dest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


tmp = dest.with_suffix(".tmp")
with tarfile.open(tmp, "w:gz") as tar:
    for path in sorted(run.glob("*")):
        if path.is_file():
            tar.add(path, f"{run.name}/{path.name}")
    for server_log in sorted(run.glob("servers/*/server.log")):
        tail = server_log.read_bytes()[-200_000:]
        add_bytes(tar, f"{run.name}/servers/{server_log.parent.name}.log", tail)
    if log.exists():
        tar.add(log, f"{run.name}/nightshift.log")
    checkouts = list((Path(run).parent.parent / "cache").glob("vllm-*/.git"))
    for checkout in checkouts:
        repo = git.Repo(checkout.parent)
        branch = f"nightshift/{run.name}"
        if branch in [h.name for h in repo.heads]:
            tag = next(t.name for t in repo.tags)
            add_bytes(tar, f"{run.name}/branch.log", repo.git.log("--format=%H%n%B", f"{tag}..{branch}").encode())
            add_bytes(tar, f"{run.name}/branch.diff", repo.git.diff(tag, branch).encode())
tmp.rename(dest)
