"""Loaded by every Python process of a sandboxed server: logs each vLLM source file it opens.

The harness hashes the files itself from the read-only tree; this only says which were read."""
import os
import sys

_first_load = not getattr(sys, "_nightshift_recorder_loaded", False)
sys._nightshift_recorder_loaded = True
_log_path = os.environ.get("NIGHTSHIFT_IMPORT_LOG")
_root = os.environ.get("NIGHTSHIFT_SOURCE_TREE")

if _first_load and _log_path and _root:
    _root = os.path.realpath(_root) + os.sep
    _seen = set()

    def _record(event, args):
        if event != "open" or not args or not isinstance(args[0], str):
            return
        path = args[0]
        if not path.endswith((".py", ".pyc")) or path in _seen:
            return
        _seen.add(path)
        real = os.path.realpath(path)
        if not real.startswith(_root):
            return
        rel = real[len(_root):]
        if rel.endswith(".pyc"):
            head, name = os.path.split(rel)
            if os.path.basename(head) != "__pycache__":
                return
            rel = os.path.join(os.path.dirname(head), name.split(".")[0] + ".py")
        fd = os.open(_log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (rel + "\n").encode())
        finally:
            os.close(fd)

    sys.addaudithook(_record)


def _run_next_sitecustomize():
    """This file shadows any other sitecustomize.py; run the one Python would have found next.
    A chained file that chains back here (scanning sys.path from the start) finds this one done."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(e or ".") for e in sys.path]
    start = entries.index(here) + 1 if here in entries else 0
    for entry in entries[start:]:
        if entry == here:
            continue
        shadowed = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(shadowed):
            import runpy

            runpy.run_path(shadowed, run_name="sitecustomize")
            return


if _first_load:
    _run_next_sitecustomize()
