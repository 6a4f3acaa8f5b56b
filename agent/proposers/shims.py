"""Small models' habits, met half way. Each shim reads what a weak model sends as the one thing it can mean, or stops
a model that loops; each was measured on Qwen2.5-Coder 0.5B/1.5B (docs/llm-proposer.md, "Small models"). A frontier
model does not need them, and they cost it nothing.

- a key repeated in a call's JSON keeps every value (`keep_repeated_keys`);
- `propose` arguments of a wrong shape that can mean one thing are read as meant, prose over its length clipped
  (`read_as_meant`);
- a call written as JSON in the answer's text is that call (`json_calls`);
- a count over its cap is the cap (`at_most`);
- a call repeated in one conversation is answered by a pointer to its first answer, and STUCK_REPEATS repeats in a row
  end the conversation (`Repeats`).
"""
from __future__ import annotations

import json
import posixpath
import re
from typing import Any

STUCK_REPEATS = 3
"""A conversation whose model repeats an earlier call this many times in a row ends (at temperature 0 it would repeat
it to the end of its budget); the next one starts warmer."""


def keep_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose key repeats keeps every value: the second `k` becomes `k#2` (a model that labels each
    edit `"SearchReplace": {...}` sends the key once an edit; a plain parse keeps only the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        name, n = key, 1
        while name in out:
            n += 1
            name = f"{key}#{n}"
        out[name] = value
    return out


def is_edit(value: Any) -> bool:
    """A SEARCH/REPLACE edit or a function replacement, by its keys."""
    return isinstance(value, dict) and "path" in value and (
        {"search", "replace"} <= set(value) or {"name", "code"} <= set(value))


def is_function(value: Any) -> bool:
    """A function replacement by its keys (a name and code, no search or replace), wherever it was sent."""
    return isinstance(value, dict) and {"name", "code"} <= set(value) and not {"search", "replace"} & set(value)


def read_as_meant(data: Any, text_fields: dict[str, int]) -> Any:
    """`propose` arguments as they can only be meant (Qwen2.5-Coder-1.5B sent `edits: {"functions": [...]}` and
    `edits: [{path, name, code}]`): prose over its length (`text_fields`) clipped, a lone edit object a list of one,
    `edits` holding `edits`/`functions` lists those lists, `edits` as an object whose every value is an edit (labelled
    by their kind, the label repeated) the list of them, and an item of `edits` with a name and code and no search or
    replace a function replacement. Anything else is left to the schema, which names the problem."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for key, most in text_fields.items():  # prose about the change, not the change: clipped, never refused
        if isinstance(data.get(key), str) and len(data[key]) > most:
            data[key] = data[key][:most - 3] + "..."
    nested = data.get("edits")
    if isinstance(nested, dict) and nested and set(nested) <= {"edits", "functions"}:
        data.pop("edits")
        for key, value in nested.items():
            value = [value] if isinstance(value, dict) else value  # one edit where a list belongs
            mine = data.get(key) or []
            if isinstance(mine, list) and isinstance(value, list):
                data[key] = [*mine, *value]
            else:
                return {**data, "edits": nested}  # not unambiguous: let the schema say so
    for key in ("edits", "functions"):  # one edit where a list belongs (a missing path is then named)
        if isinstance(data.get(key), dict) and set(data[key]) & {"path", "search", "replace", "name", "code"}:
            data[key] = [data[key]]
    labelled = data.get("edits")
    if isinstance(labelled, dict) and labelled and all(map(is_edit, labelled.values())):
        data["edits"] = list(labelled.values())  # {"SearchReplace": {...}, "SearchReplace#2": {...}}
    edits = data.get("edits")
    if isinstance(edits, list):  # a whole-function replacement sent among the edits
        moved = [e for e in edits if is_function(e)]
        if moved and isinstance(data.get("functions") or [], list):
            data["edits"] = [e for e in edits if not is_function(e)]
            data["functions"] = [*(data.get("functions") or []), *moved]
    return data


def at_most(value: Any, cap: int) -> Any:
    """An integer count over its cap is the cap (the 1.5B asked grep for 300 results, twice)."""
    return min(value, cap) if isinstance(value, int) and not isinstance(value, bool) else value


JSON_START = re.compile(r"\{\s*\"name\"\s*:")


def json_calls(text: str) -> list[dict[str, str]]:
    """Calls a model wrote as JSON objects in its text instead of through the tools API, the way small models
    often do (`{"name": "read_file", "arguments": {...}}`, bare, fenced or in <tool_call> tags): each object with
    a string `name` and an object (or JSON string) `arguments`, in order."""
    calls: list[dict[str, str]] = []
    for match in JSON_START.finditer(text):
        try:
            value, _ = json.JSONDecoder().raw_decode(text[match.start():])
        except ValueError:
            continue
        name, arguments = value.get("name"), value.get("arguments", value.get("parameters", {}))
        if isinstance(name, str) and isinstance(arguments, (dict, str)):
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls.append({"id": f"text_{len(calls)}", "name": name, "arguments": arguments})
    return calls


class Repeats:
    """The calls of one conversation already answered. The same call again (its name and canonical arguments; a path
    normalized, so `./vllm/` is `vllm`) gets a pointer to its first answer, not the answer again: Qwen2.5-Coder-1.5B
    read the same 300 lines four times in a row, and a missing file 18 times. STUCK_REPEATS in a row end the
    conversation."""

    def __init__(self, names: set[str]):
        self.names = names
        """The tools' names: a call of another name is an error each time, never a repeat."""
        self.answered: dict[str, int] = {}
        self.in_a_row = 0

    def key(self, name: str, arguments: str | dict[str, Any] | None) -> str | None:
        if name not in self.names:
            return None
        try:
            value = json.loads(arguments, object_pairs_hook=keep_repeated_keys) if isinstance(arguments, str) \
                else (arguments or {})
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        if name != "propose" and isinstance(value.get("path"), str):
            value = {**value, "path": posixpath.normpath(value["path"].strip() or ".")}
        return f"{name} {json.dumps(value, sort_keys=True)}"

    def pointer(self, name: str, arguments: str | dict[str, Any] | None, number: int) -> str | None:
        """The pointer for a call answered before (an error is the same error again; a `propose` seen before was
        rejected, since an accepted one ends the conversation), or None: then the call is carried out as call
        `number`."""
        key = self.key(name, arguments)
        if key is not None and key in self.answered:
            self.in_a_row += 1
            first = self.answered[key]
            if name == "propose":
                return (f"repeated: propose with these arguments was rejected at your tool call {first}, above, and "
                        "the tree has not changed: change the edits as that answer says (copy SEARCH text exactly, "
                        "with enough lines to be unique), or read the file first.")
            return (f"repeated: {name} with these arguments was answered at your tool call {first}, above, and the "
                    "tree has not changed. Read another range (read_file start/end), list a folder, grep for something "
                    "else, or call propose.")
        self.in_a_row = 0
        if key is not None:
            self.answered[key] = number
        return None

    def stuck(self) -> str | None:
        if self.in_a_row < STUCK_REPEATS:
            return None
        return (f"stuck: {self.in_a_row} repeated tool calls in a row (the same arguments as an earlier call); a fresh "
                "conversation starts warmer")
