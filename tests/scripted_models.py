"""Scripted models: fixed explorations for the loopback OpenAI-compatible server (tests/fake_openai_server.py).

Each function returns the server's script: model turns that call tools through the OpenAI tools API. The turns are
fixed; the harness's answers (the tool results) are what the tests check, since each turn's request carries them.
"""
from __future__ import annotations

from pathlib import Path
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
    """The toy checkout of tests/proposers/test_llm_proposer.py: list, grep, read, a propose whose SEARCH is mis-copied (the
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


GEMMA4 = "vllm/model_executor/models/gemma4.py"
IN_PLACE_SCALAR = """        # The sum above is a fresh tensor of this layer's own: scale it in place (the same product for any scalar,
        # one allocation fewer on every layer of every step); a scalar of another dtype keeps the promoting product.
        if hidden_states.dtype == self.layer_scalar.dtype:
            hidden_states.mul_(self.layer_scalar)
        else:
            hidden_states = hidden_states * self.layer_scalar
"""
SCALED = "        hidden_states = hidden_states * self.layer_scalar\n"


def gemma4_expert(source: str) -> list[dict[str, Any]]:
    """The real vLLM tree: list the models, grep for the layer scalar, read the decoder layer's forward, propose an
    identity edit (the mistake a weak model makes; the harness names it), then the whole method replaced: the layer
    scalar's product taken in place, exact for any weights (no shortcut for a scalar that happens to be 1)."""
    from agent.proposers.edits import find_definition

    node = find_definition(source, "Gemma4DecoderLayer.forward")
    assert node is not None and node.end_lineno is not None
    lines = source.splitlines(keepends=True)
    method = "".join(lines[node.lineno - 1:node.end_lineno])
    assert method.count(SCALED) == 1
    hypothesis = ("every decoder layer multiplies its output by layer_scalar into a new tensor; the output is a fresh "
                  "sum owned by the layer, so the same product taken in place gives the same values for any scalar "
                  "and saves an allocation on each of the layers at every step")
    return [
        turn(call("list_dir", path="vllm/model_executor/models")),
        turn(call("grep", pattern="layer_scalar", path=GEMMA4)),
        turn(call("read_file", path=GEMMA4, start=node.lineno, end=node.end_lineno)),
        turn(call("propose", summary="scale by the layer scalar in place", hypothesis=hypothesis,
                  plan="a new hot spot",
                  edits=[{"path": GEMMA4, "search": SCALED, "replace": SCALED}])),
        turn(call("propose", summary="the layer scalar's product in place in every Gemma 4 decoder layer",
                  hypothesis=hypothesis, plan="a new hot spot",
                  functions=[{"path": GEMMA4, "name": "Gemma4DecoderLayer.forward",
                              "code": method.replace(SCALED, IN_PLACE_SCALAR)}])),
    ]


def gemma4_adversary() -> list[dict[str, Any]]:
    """Right alone, wrong in batches: in a step that samples several sequences, each gets its neighbour's logits
    (tests/fixtures/adversarial/01-batch-crosstalk.patch as a whole-method replacement)."""
    code = ("def compute_logits(\n    self,\n    hidden_states: torch.Tensor,\n) -> torch.Tensor | None:\n"
            "    logits = self.logits_processor(self.lm_head, hidden_states)\n"
            "    if logits is not None and logits.shape[0] > 1:\n        logits = logits.roll(1, 0)\n"
            "    return logits\n")
    return [
        turn(call("grep", pattern="def compute_logits", path=GEMMA4)),
        turn(call("propose", summary="reuse logits across the batch", plan="a new hot spot",
                  functions=[{"path": GEMMA4, "name": "Gemma4ForCausalLM.compute_logits", "code": code}])),
    ]


EXACT_OVERHEADS = (Path(__file__).resolve().parents[1] / "benchmarks" / "cpu-code-patches" /
                   "07-cpu-exact-overheads-sample-in-execute.patch")


def hunks_as_edits(patch: str) -> list[dict[str, Any]]:
    """A unified diff's hunks as the propose tool's SEARCH/REPLACE edits, the way a model sends a multi-file change:
    each hunk's old lines (context and removed) are the search, its new lines (context and added) the replacement."""
    edits: list[dict[str, Any]] = []
    path, old, new = "", [], []

    def close() -> None:
        if old or new:
            edits.append({"path": path, "search": "".join(old), "replace": "".join(new)})
        old.clear()
        new.clear()

    for line in patch.splitlines(keepends=True):
        if line.startswith("+++ "):
            close()
            path = line[4:].strip().removeprefix("b/")
        elif line.startswith(("--- ", "diff ", "index ", "Subject:")):
            close()
        elif line.startswith("@@"):
            close()
        elif path and line.startswith(" "):
            old.append(line[1:])
            new.append(line[1:])
        elif path and line.startswith("-"):
            old.append(line[1:])
        elif path and line.startswith("+"):
            new.append(line[1:])
        elif path and line == "\n":  # an empty context line whose leading space was stripped
            old.append(line)
            new.append(line)
    close()
    return edits


def gemma4_exact_expert(source: str) -> list[dict[str, Any]]:
    """The real vLLM CPU tree: explore as gemma4_expert does, propose its identity edit (the harness names the
    mistake), then a change worth keeping, exact for any weights: benchmarks/cpu-code-patches/07, eager CPU decode's
    Python overheads cut op for op (06's: RMSNorm as one composite op, Gemma 4's q/k/v norms in one pass, the CPU
    GEMM called directly, products in place, the layer scalar's included, with no branch on what the weights happen
    to be; then the decoder layers' submodules called directly, the oneDNN GEMM's lookups bound once, eager CPU
    attention without the dispatcher, the KV cache's views made once per cache), and the worker sampling in the
    execute_model call when no request needs a grammar (one round trip to the engine core fewer a step). Eight files
    in one proposal, each hunk of the patch one SEARCH/REPLACE edit."""
    explore = gemma4_expert(source)[:4]
    edits = hunks_as_edits(EXACT_OVERHEADS.read_text())
    hypothesis = ("eager CPU decode at batch 4 is Python overhead, not arithmetic (the served profile: the forward is "
                  "59% of the worker's time, most of it module calls, dispatch and 58 RMSNorms of 8-9 ATen ops a "
                  "step; a fifth waiting on a second round trip to the engine core for sampling); the same float32 "
                  "ops in the same order, called directly, give the same values for any weights and cut the step")
    return explore + [turn(call("propose", summary="exact overhead cuts of eager CPU decode in Gemma 4",
                                hypothesis=hypothesis, plan="a new hot spot", edits=edits))]
