"""Tries to write everywhere: the root file system, the mounted tree, the model, and the tmpfs
scratch beyond its size cap."""
import errno
import os

from vllm.entrypoints.cli.stub_server import serve

PROBES = ["/nightshift-probe", "/etc/nightshift-probe", "/usr/nightshift-probe", "/var/nightshift-probe",
          "/root/nightshift-probe", "/sandbox/nightshift-probe", "/sandbox/tree/nightshift-probe",
          "/sandbox/tree/vllm/__init__.py", "/sandbox/model/nightshift-probe",
          "/sandbox/recorder/sitecustomize.py", "/sandbox/recorder/nightshift-probe", "/tmp/nightshift-probe", "/dev/shm/nightshift-probe"]


def try_write(path: str) -> str:
    try:
        with open(path, "a") as f:
            f.write("planted by a hostile candidate\n")
        return "written"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))


def fill_scratch(limit_mb: int = 4096) -> dict:
    written = 0
    chunk = b"\xff" * (1 << 20)
    try:
        with open("/tmp/nightshift-fill", "wb") as f:
            while written < limit_mb:
                f.write(chunk)
                f.flush()
                written += 1
        result = "no limit hit"
    except OSError as exc:
        result = errno.errorcode.get(exc.errno, str(exc.errno))
    os.unlink("/tmp/nightshift-fill")
    return {"result": result, "written_mb": written}


serve({"act": "writes", "writes": {p: try_write(p) for p in PROBES}, "fill_tmp": fill_scratch()})
