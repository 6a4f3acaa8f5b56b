"""Loaded by every Python process of a sandboxed server: logs each vLLM source file it opens, and the scheduling
limits the engine core runs with.

The harness hashes the files itself from the read-only tree; this only says which were read. The limits (how many
sequences and tokens a step may hold, whether scheduling overlaps the forward) are in no line vLLM logs, so a code
change that moved them would go unseen: once the engine core is built, its scheduler's own values are printed as
one line of the server's log (agent/stages/engine_config.py reads it beside vLLM's configuration line)."""
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


LIMITS = "NIGHTSHIFT engine limits: "
ENGINE_CORE = "vllm.v1.engine.core"


def _limits_line(core) -> str:
    """The limits an engine core runs with, read from its scheduler (as the scheduler applies them)."""
    sched = core.scheduler
    values = {"max_num_seqs": getattr(sched, "max_num_running_reqs", None),
              "max_num_active_seqs": getattr(sched, "max_num_active_reqs", None),
              "max_num_scheduled_tokens": getattr(sched, "max_num_scheduled_tokens", None),
              "async_scheduling": getattr(core, "async_scheduling", None),
              "batch_queue_size": getattr(core, "batch_queue_size", None)}
    return LIMITS + ", ".join(f"{k}={v}" for k, v in values.items())


def _wrap_engine_core(module) -> None:
    cls = getattr(module, "EngineCore", None)
    if cls is None or getattr(cls.__init__, "_nightshift", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            line = _limits_line(self)
        except Exception as exc:  # a tree without a scheduler attribute: said so, the comparison finds it
            line = LIMITS + f"unreadable={type(exc).__name__}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    __init__._nightshift = True
    cls.__init__ = __init__


class _EngineCoreFinder:
    """Finds vllm.v1.engine.core as Python would, and wraps EngineCore.__init__ once the module has run."""

    def find_spec(self, name, path, target=None):
        if name != ENGINE_CORE:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _wrap_engine_core(module)

        loader.exec_module = exec_and_wrap
        return spec

    def invalidate_caches(self):
        pass


if _first_load:
    if _log_path and _root:
        sys.meta_path.insert(0, _EngineCoreFinder())
    _run_next_sitecustomize()
