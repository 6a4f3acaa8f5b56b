"""Engine arguments moved by code: a code change must serve the engine configuration its parent serves.

vLLM's engine core logs its whole configuration once at start ("Initializing a V1 LLM engine (vX) with config:
model=..., enforce_eager=..., enable_prefix_caching=..., compilation_config={...}, ..."). A candidate that changes
code and no engine argument must log the same configuration as the incumbent: a field that differs (prefix caching
turned off, a compile mode, a KV-cache dtype) is an engine argument moved by code, which the task judges as a flag
(`edit_surface.engine_args`), not as code. What the log cannot show is judged from the candidate's behaviour
(agent/stages/stats.py `moved_by_code`: more requests at once than its max_num_seqs). A candidate whose server
logs no configuration where the incumbent's did hides it, and is refused for that."""
from __future__ import annotations

import re

CONFIG_LINE = re.compile(r"Initializing a V1 LLM engine \(([^)]*)\) with config: (.*)$", re.M)
PAIRS = {"(": ")", "[": "]", "{": "}"}


def config_fields(log: str) -> dict[str, str] | None:
    """The engine configuration the first start in `log` reported, field by field (values as logged); None where
    the log has no such line (a stand-in server, or a log cut before it)."""
    match = CONFIG_LINE.search(log)
    if match is None:
        return None
    fields, depth, quote, start, text = {}, [], "", 0, match.group(2).rstrip()
    for i, ch in enumerate(text + ","):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in PAIRS:
            depth.append(PAIRS[ch])
        elif depth and ch == depth[-1]:
            depth.pop()
        elif ch == "," and not depth:
            key, _, value = text[start:i].strip().partition("=")
            if key:
                fields[key.strip()] = value.strip()
            start = i + 1
    return {"version": match.group(1), **fields}


def moved_by_code(incumbent_log: str, candidate_log: str) -> str | None:
    """Why a code change's server does not serve its parent's engine configuration, or None where it does (or
    where the incumbent's server logs none to compare with)."""
    theirs = config_fields(incumbent_log)
    if theirs is None:
        return None
    ours = config_fields(candidate_log)
    if ours is None:
        return ("its server logged no engine configuration at start, where the incumbent's did (vLLM's engine core "
                "reports it once: 'Initializing a V1 LLM engine ... with config:'): engine arguments it may have "
                "moved by code cannot be checked")
    moved = [f"{k} {clip(theirs.get(k, '(absent)'))} -> {clip(ours.get(k, '(absent)'))}"
             for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
    if not moved:
        return None
    return (f"engine arguments moved by code: {'; '.join(moved[:6])}{' ...' if len(moved) > 6 else ''} (a code "
            f"change serves its parent's engine configuration; a change of engine arguments is proposed as flags "
            f"and judged against the task's levers)")


def clip(value: str, width: int = 80) -> str:
    return value if len(value) <= width else value[:width - 3] + "..."
