"""Scripted models: fixed explorations for the loopback OpenAI-compatible server (tests/fake_openai_server.py).

Each function returns the server's script: model turns that call tools through the OpenAI tools API. The turns are
fixed; the harness's answers (the tool results) are what the tests check, since each turn's request carries them.
"""
from __future__ import annotations

from typing import Any


def call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def turn(*calls: dict[str, Any], text: str = "") -> dict[str, Any]:
    return {"text": text, "tool_calls": list(calls)}


def numbered(script: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool call gets an id unique in the conversation: call_<turn>_<index>."""
    return [{**step, "tool_calls": [{**c, "id": f"call_{t}_{i}"} for i, c in enumerate(step.get("tool_calls", []))]}
            for t, step in enumerate(script, 1)]


def sampler_expert() -> list[dict[str, Any]]:
    """The toy checkout of tests/test_llm_proposer.py: list, grep, read, a propose whose SEARCH is mis-copied (the
    harness answers `apply: FAILED`), then the fix as a whole-function replacement."""
    return numbered([
        turn(call("list_dir", path="vllm/v1/sample")),
        turn(call("grep", pattern=r"def greedy", path="vllm")),
        turn(call("read_file", path="vllm/v1/sample/sampler.py", start=1, end=12)),
        turn(call("propose", summary="skip the softmax in greedy (argmax is unchanged)",
                  hypothesis="softmax is monotonic, so argmax over logits equals argmax over probs",
                  plan="a new hot spot",
                  edits=[{"path": "vllm/v1/sample/sampler.py", "search": "    probs = torch.softmax(logits, dim=-1)\n",
                          "replace": ""}])),
        turn(call("propose", summary="skip the softmax in greedy (argmax is unchanged)",
                  hypothesis="softmax is monotonic, so argmax over logits equals argmax over probs",
                  plan="a new hot spot",
                  functions=[{"path": "vllm/v1/sample/sampler.py", "name": "greedy",
                              "code": "def greedy(logits):\n    return logits.argmax(dim=-1)\n"}])),
    ])
