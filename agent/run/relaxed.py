"""Which of a task's checks a run loosened: each setting that judges a candidate, the direction that lets more
candidates through, and the run's value beside its default (the task schema's) and the task file's before
`--set`. `review`, the HTML report and a kept commit's `Nightshift-Relaxed:` trailers name them."""
from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel


def _lower(value, reference) -> bool:
    return value is not None and reference is not None and value < reference


def _higher(value, reference) -> bool:
    return value is not None and reference is not None and value > reference


def _higher_or_off(value, reference) -> bool:
    """A bound where null turns the check off."""
    return reference is not None and (value is None or value > reference)


def _fewer_of_all(value, reference) -> bool:
    """A sample size where null means every one."""
    return value is not None and (reference is None or value < reference)


def _off(value, reference) -> bool:
    return reference is True and value is False


ISOLATION = {"local": 0, "namespace": 1, "docker": 2}
"""The built-in backends by how much of the run a candidate's server can reach (docs/sandbox.md): `local` all of it,
`namespace` and `docker` only its own server, `docker` with seccomp and AppArmor besides. Others are not ranked."""


def _weaker_sandbox(value, reference) -> bool:
    return value in ISOLATION and reference in ISOLATION and ISOLATION[value] < ISOLATION[reference]


LOOSER: dict[str, Callable[[Any, Any], bool]] = {
    "acceptance.min_speedup": _lower,
    "acceptance.confidence": _lower,
    "acceptance.confirmations": _lower,
    "benchmark.max_idle_cpu": _higher_or_off,
    "benchmark.max_client_busy": _higher,
    "benchmark.check_tokens": _off,
    "benchmark.noise_floor": _off,
    "parity.num_prompts": _lower,
    "parity.max_tokens": _lower,
    "parity.long_prompts": _lower,
    "audit.enabled": _off,
    "audit.sample": _fewer_of_all,
    "audit.hard_bound_nats": _higher,
    "audit.rate_ratio": _higher,
    "audit.tolerance_nats": _higher,
    "audit.max_aa_rate": _higher,
    "sandbox.backend": _weaker_sandbox,
}
"""Setting -> whether a value is looser than a reference. A setting a task does not have is skipped."""


def _value(data: dict, setting: str) -> tuple[bool, Any]:
    section, key = setting.split(".")
    values = data.get(section)
    return (True, values[key]) if isinstance(values, dict) and key in values else (False, None)


def _default(setting: str) -> tuple[bool, Any]:
    from agent.world.task import Task

    section, key = setting.split(".")
    model = Task.model_fields[section].annotation
    field = model.model_fields.get(key) if isinstance(model, type) and issubclass(model, BaseModel) else None
    if field is None or field.is_required():
        return False, None
    return True, field.get_default(call_default_factory=True)


def relaxed(task: dict | BaseModel, task_file: dict | BaseModel | None = None) -> list[dict]:
    """The loosened settings of `task` (as run), each {setting, value, default?, task_file?}: `default` where it
    is looser than the schema's default, `task_file` where it is looser than `task_file` (the task before
    `--set`)."""
    dump = lambda t: t.model_dump(mode="json") if isinstance(t, BaseModel) else t  # noqa: E731
    data, before = dump(task), dump(task_file) if task_file is not None else None
    out = []
    for setting, looser in LOOSER.items():
        present, value = _value(data, setting)
        if not present:
            continue
        entry = {"setting": setting, "value": value}
        has_default, default = _default(setting)
        if has_default and looser(value, default):
            entry["default"] = default
        if before is not None:
            had, previous = _value(before, setting)
            if had and looser(value, previous) and previous != entry.get("default", object()):
                entry["task_file"] = previous
        if len(entry) > 2:
            out.append(entry)
    return out


def _show(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else f"{value:g}" \
        if isinstance(value, float) else str(value)


def describe(entry: dict) -> str:
    """`audit.tolerance_nats=1 (default 0.5)`."""
    refs = [f"{name.replace('_', ' ')} {_show(entry[name])}" for name in ("default", "task_file") if name in entry]
    return f"{entry['setting']}={_show(entry['value'])} ({', '.join(refs)})"


def of_run(started) -> list[dict]:
    """What a run's first record says it loosened; a trace from before the record held it: against the defaults."""
    recorded = getattr(started, "relaxed", None)
    return recorded if recorded is not None else relaxed(started.task)
