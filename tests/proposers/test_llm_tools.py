"""The LLM proposer's conversation with tools, against the scripted loopback server and the real `openai` client on
a real git checkout: the exploration, the compiler-like `propose`, the text protocol, budgets, hostile answers,
replay, and the lab notebook."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.proposers.clients import ReplayModel
from agent.proposers.base import ProposerExhausted
from agent.proposers.tools import Toolbox, definitions
from agent.proposers.transcript import parse_text_calls
from fake_openai_server import FakeOpenAI
from scripted_models import call, numbered, sampler_expert, turn
from tests.proposers.test_llm_proposer import SAMPLER, Run, applies, checkout, key, make_task, run_started, server  # noqa: F401 (fixtures)
from traces.log import TraceWriter, read_trace
from traces.schema import LlmCall, NotebookEntry, ProposalInvalid, ToolCall

SURFACE = (["vllm/v1/*", "vllm/model_executor/*"], ["vllm/entrypoints/*"])


def tools_task(base_url: str, **proposer):
    return make_task(base_url, tools=proposer.pop("tools", "native"), **proposer)


def box(checkout: Path, **kwargs) -> Toolbox:
    return Toolbox(checkout, *SURFACE, **kwargs)


def tool_events(run: Run) -> list[ToolCall]:
    return [e for e in run.events if isinstance(e, ToolCall)]


# ------------------------------------------------------------------------------------- the exploration
def test_scripted_exploration_mistake_fix_and_propose(server, checkout, key, tmp_path):
    server.push(*sampler_expert())
    run = Run(tools_task(server.base_url), checkout)
    proposal = run.propose()
    calls = tool_events(run)
    assert [c.name for c in calls] == ["list_dir", "grep", "read_file", "propose", "propose"]
    assert [c.ok for c in calls] == [True, True, True, False, True]
    assert "sampler.py (" in calls[0].result and "NOTES.py" in calls[0].result
    assert calls[1].result.startswith("vllm/v1/sample/sampler.py:5:def greedy(logits):")
    assert " 6|     probs = torch.softmax(logits.float(), dim=-1)" in calls[2].result
    # the mistake: a compiler-like answer, check by check
    assert calls[3].result.splitlines()[:3] == [
        "REJECTED: fix the problems below and call propose again", "edit surface: ok (vllm/v1/sample/sampler.py)",
        "apply: FAILED (1 of 1 edits)"]
    assert "the SEARCH text does not occur in vllm/v1/sample/sampler.py" in calls[3].result
    assert "(closest line: 6: " in calls[3].result  # the hint names the line
    for check in ("edit surface: ok", "apply: ok", "identity: ok", "py_compile: ok", "git apply --check: ok",
                  "ACCEPTED"):
        assert check in calls[4].result
    # the model saw each answer: the 5th request carries the rejection as a tool message
    sent = server.requests[4]["body"]
    assert {t["function"]["name"] for t in sent["tools"]} == {
        "list_dir", "read_file", "grep", "profile", "notebook", "branch_diff", "candidate", "propose"}
    tool_messages = [m for m in sent["messages"] if m["role"] == "tool"]
    assert tool_messages[-1]["content"] == calls[3].result and tool_messages[-1]["tool_call_id"] == "call_4_0"
    assert sent["messages"][-2]["tool_calls"][0]["function"]["name"] == "propose"
    # the proposal: the whole-function replacement as a diff git applies
    assert proposal.summary == "skip the softmax in greedy (argmax is unchanged)"
    assert proposal.meta["llm"]["hypothesis"].startswith("softmax is monotonic")
    assert proposal.meta["llm"]["turns"] == 5 and proposal.meta["llm"]["tools"] == "native"
    after = applies(checkout, proposal.patch, tmp_path)
    assert "def greedy(logits):\n    return logits.argmax(dim=-1)\n\n\ndef apply_penalties" in after
    assert [e.kind for e in run.events].count("llm_call") == 5
    funnel = run.proposer.stats.summary()
    assert (funnel["tool_calls"], funnel["valid_tool_calls"], funnel["proposes"], funnel["applied"]) == (5, 5, 2, 1)
    llm_calls = [e for e in run.events if isinstance(e, LlmCall)]
    assert llm_calls[0].tool_calls[0]["name"] == "list_dir"
    assert json.loads(llm_calls[0].tool_calls[0]["arguments"]) == {"path": "vllm/v1/sample"}


def test_the_text_protocol_for_endpoints_without_tools(server, checkout, key, tmp_path):
    server.push({"text": 'Let me look.\nCALL read_file {"path": "vllm/v1/sample/sampler.py", "end": 7}'},
                {"text": "vllm/v1/sample/sampler.py\n<<<<<<< FUNCTION greedy\ndef greedy(logits):\n"
                         "    return logits.argmax(dim=-1)\n>>>>>>> END\nSUMMARY: argmax of the logits\n"})
    run = Run(tools_task(server.base_url, tools="text"), checkout)
    proposal = run.propose()
    assert "tools" not in server.requests[0]["body"]
    system = server.requests[0]["body"]["messages"][0]["content"]
    assert "CALL <tool>" in system and "- propose(summary, hypothesis?" in system
    second = server.requests[1]["body"]["messages"]
    assert second[-1]["role"] == "user" and second[-1]["content"].startswith("RESULT read_file:\n1| ")
    assert proposal.summary == "argmax of the logits"
    assert "return logits.argmax(dim=-1)" in applies(checkout, proposal.patch, tmp_path)


def test_an_answer_without_a_tool_call_is_told_so(server, checkout, key):
    server.push({"text": "I think the sampler is slow."}, *sampler_expert()[4:])
    run = Run(tools_task(server.base_url), checkout)
    run.propose()
    nudge = server.requests[1]["body"]["messages"][-1]
    assert nudge["role"] == "user" and nudge["content"].startswith("your answer called no tool")


# ---------------------------------------------------------------------------------- propose, a compiler
def test_propose_names_identity_edits_compile_errors_and_every_failed_block(checkout):
    tb = box(checkout)
    search = "    probs = torch.softmax(logits.float(), dim=-1)\n"
    identity = tb.call("propose", {"summary": "x", "edits": [{"path": "vllm/v1/sample/sampler.py",
                                                              "search": search, "replace": search}]})
    assert not identity.ok and "identity: block 1 on vllm/v1/sample/sampler.py is an identity edit" in identity.text
    broken = tb.call("propose", {"summary": "x", "edits": [{"path": "vllm/v1/sample/sampler.py", "search": search,
                                                            "replace": "    probs = torch.softmax(logits.float(\n"}]})
    assert not broken.ok and "py_compile: FAILED" in broken.text
    assert "py_compile: vllm/v1/sample/sampler.py: SyntaxError: line 6:" in broken.text
    two = tb.call("propose", {"summary": "x", "edits": [
        {"path": "vllm/v1/sample/sampler.py", "search": "nothing like this\n", "replace": "a\n"},
        {"path": "vllm/v1/sample/sampler.py", "search": "import torch\n", "replace": "import torch  # x\n"},
        {"path": "vllm/v1/sample/sampler.py", "search": "nor this\n", "replace": "b\n"}]})
    assert "apply: FAILED (2 of 3 edits)" in two.text and "block 1:" in two.text and "block 3:" in two.text
    missing = tb.call("propose", {"summary": "x", "functions": [
        {"path": "vllm/v1/sample/sampler.py", "name": "gredy", "code": "def gredy(l):\n    return l\n"}]})
    assert "has no function or method 'gredy'; did you mean greedy?" in missing.text


def test_a_proposal_already_tried_is_a_duplicate(checkout):
    args = {"summary": "x", "functions": [{"path": "vllm/v1/sample/sampler.py", "name": "greedy",
                                           "code": "def greedy(logits):\n    return logits.argmax(-1)\n"}]}
    first = box(checkout).call("propose", args)
    import hashlib

    seen = {hashlib.sha256(first.patch.diff.encode()).hexdigest(): 3}
    again = box(checkout, seen=seen).call("propose", args)
    assert not again.ok and "duplicate: the same change as candidate 3" in again.text


def test_a_rename_by_bare_name_is_ambiguous_until_it_asks_for_every_occurrence(checkout):
    """Measured on the 1.5B (runs I-K): it renamed a function by its name alone, was told the name occurs 3 times,
    and never widened its SEARCH. `replace_all` makes the rename one edit; without it the SEARCH must be unique."""
    from agent.proposers.edits import EditError, Edit, apply_edit

    rename = {"path": "vllm/v1/sample/sampler.py", "search": "penalties", "replace": "offsets"}
    once = box(checkout).call("propose", {"summary": "rename", "edits": [rename]})
    assert not once.ok and "the SEARCH text occurs 4 times" in once.text
    assert "(or, in `edits`, set replace_all to change every occurrence)" in once.text
    every = box(checkout).call("propose", {"summary": "rename", "edits": [{**rename, "replace_all": True}]})
    assert every.ok and every.patch.files == ["vllm/v1/sample/sampler.py"]
    removed = [l for l in every.patch.diff.splitlines() if l.startswith("-") and not l.startswith("---")]
    added = [l for l in every.patch.diff.splitlines() if l.startswith("+") and not l.startswith("+++")]
    assert len(removed) == len(added) == 3 and not any("penalties" in l for l in added)
    assert all("offsets" in l for l in added)
    # a unique SEARCH with replace_all is the same one edit; a missing text is still a mismatch
    files: dict = {}
    apply_edit(Edit(path="vllm/v1/sample/sampler.py", search="import torch\n", replace="import torch as t\n",
                    index=1, replace_all=True), files, checkout, ["vllm/*"], [])
    assert files["vllm/v1/sample/sampler.py"][1] == SAMPLER.replace("import torch\n", "import torch as t\n")
    with pytest.raises(EditError, match="match: block 1: the SEARCH text does not occur"):
        apply_edit(Edit(path="vllm/v1/sample/sampler.py", search="nowhere", replace="x", index=1, replace_all=True),
                   {}, checkout, ["vllm/*"], [])


# --------------------------------------------------------------------------------------- hostile answers
def test_a_path_with_dotdot_is_refused_by_every_tool(checkout, tmp_path):
    (tmp_path / "secret.txt").write_text("the key")
    tb = box(checkout)
    for name, args in [("read_file", {"path": "../secret.txt"}), ("read_file", {"path": "vllm/../../secret.txt"}),
                       ("list_dir", {"path": ".."}), ("grep", {"pattern": "key", "path": "../"}),
                       ("read_file", {"path": str(tmp_path / "secret.txt")}), ("read_file", {"path": ".git/config"})]:
        result = tb.call(name, args)
        assert not result.ok and "error: path:" in result.text, (name, args, result.text)
        assert "the key" not in result.text
    out = tb.call("propose", {"summary": "x", "edits": [{"path": "vllm/../../secret.txt", "search": "the key",
                                                         "replace": "mine"}]})
    assert not out.ok and "edit surface: FAILED" in out.text and (tmp_path / "secret.txt").read_text() == "the key"


def test_a_symlink_out_of_the_tree_is_refused(checkout, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.py").write_text("SECRET = 'the key'\n")
    os.symlink(outside / "x.py", checkout / "vllm/v1/sample/link.py")
    os.symlink(outside, checkout / "vllm/v1/away")
    tb = box(checkout)
    for name, args in [("read_file", {"path": "vllm/v1/sample/link.py"}), ("list_dir", {"path": "vllm/v1/away"}),
                       ("read_file", {"path": "vllm/v1/away/x.py"}), ("grep", {"pattern": "SECRET", "path": "vllm/v1/away"})]:
        result = tb.call(name, args)
        assert not result.ok and "resolves outside the checkout" in result.text, (name, result.text)
    listing = tb.call("list_dir", {"path": "vllm/v1/sample"}).text
    assert "link.py (a link out of the tree: not readable)" in listing
    assert "the key" not in tb.call("grep", {"pattern": "SECRET"}).text
    edit = tb.call("propose", {"summary": "x", "edits": [{"path": "vllm/v1/sample/link.py",
                                                          "search": "SECRET = 'the key'\n", "replace": "X = 1\n"}]})
    assert not edit.ok and "resolves outside the checkout" in edit.text
    assert (outside / "x.py").read_text() == "SECRET = 'the key'\n"


def test_an_edit_outside_the_surface_is_refused(checkout):
    tb = box(checkout)
    for path in ("benchmarks/bench.py", "vllm/entrypoints/api.py"):
        result = tb.call("propose", {"summary": "x", "edits": [{"path": path, "search": "1", "replace": "2"}]})
        assert not result.ok and "edit surface: FAILED" in result.text and f"surface: {path} is outside" in result.text
    blocks = "benchmarks/bench.py\n<<<<<<< SEARCH\nSPEEDUP = 1.0\n=======\nSPEEDUP = 1000.0\n>>>>>>> REPLACE\n"
    assert "edit surface: FAILED" in tb.call("propose", {"summary": "x", "blocks": blocks}).text


@pytest.mark.parametrize("name, arguments, message", [
    ("read_file", "{not json", "error: bad arguments for read_file: Expecting property name"),
    ("read_file", "{}", "error: bad arguments for read_file: path: Field required"),
    ("read_file", {"path": "vllm/v1/sample/sampler.py", "start": "x"}, "start: Input should be a valid integer"),
    ("read_file", {"path": "vllm/v1/sample/sampler.py", "start": 0}, "start: Input should be greater than or equal"),
    ("read_file", {"path": "vllm/v1/sample/sampler.py", "mode": "w"}, "mode: Extra inputs are not permitted"),
    ("read_file", "[1, 2]", "the arguments must be a JSON object"),
    ("grep", {"pattern": "("}, "error: bad pattern"),
    ("write_file", {"path": "x"}, "error: no tool 'write_file'"),
    ("propose", {"edits": []}, "summary: Field required"),
    ("propose", {"summary": "x"}, "parse: no edits"),
])
def test_a_tool_call_with_bad_arguments_is_answered_not_raised(checkout, name, arguments, message):
    result = box(checkout).call(name, arguments)
    assert not result.ok and message in result.text


def test_bad_arguments_through_the_loop_are_recorded_and_the_model_goes_on(server, checkout, key):
    server.push({"tool_calls": [{"id": "a", "name": "read_file", "arguments": "{\"path\": "}]}, *sampler_expert()[4:])
    run = Run(tools_task(server.base_url), checkout)
    run.propose()
    first = tool_events(run)[0]
    assert run.proposer.stats.summary()["valid_tool_calls"] == 1 == run.proposer.stats.tool_calls - 1
    assert not first.ok and first.arguments == '{"path": ' and "bad arguments for read_file" in first.result
    assert server.requests[1]["body"]["messages"][-1] == {"role": "tool", "tool_call_id": "a",
                                                          "content": first.result}


def test_an_endless_tool_loop_ends_at_the_budget(server, checkout, key):
    reads = [turn(call("read_file", path="vllm/v1/sample/sampler.py", start=n)) for n in range(1, 10)]
    server.push(*[turn(call("list_dir", path="vllm"))] * 3, *reads)  # never 3 repeats in a row: never stuck
    run = Run(tools_task(server.base_url, attempts_per_proposal=2, tool_budget={"calls": 6}), checkout)
    with pytest.raises(ProposerExhausted, match="2 LLM conversations in a row ended without a proposal; the last: "
                                                "budget: 6 tool calls"):
        run.propose()
    assert len(server.requests) == 12 and len(tool_events(run)) == 12
    invalid = [e for e in run.events if isinstance(e, ProposalInvalid)]
    assert [e.reason.split(":")[0] for e in invalid] == ["budget", "budget"]
    assert len(server.requests[6]["body"]["messages"]) == 2  # the second conversation started afresh, warmer
    assert [r["body"]["temperature"] for r in server.requests] == [0.0] * 6 + [0.7] * 6
    first = tool_events(run)[:6]  # the same call again is a pointer, and the last calls are counted down
    assert first[0].ok and all(c.result.startswith("repeated: list_dir") for c in first[1:3])
    assert all(c.ok for c in first[3:])
    assert [c.result.rsplit("\n", 1)[-1] for c in first[2:5]] == [
        f"[{n} tool call{'s' * (n > 1)} left in this conversation: call propose with your change before they run "
        "out]" for n in (3, 2, 1)]
    assert not any("left in this conversation" in c.result for c in (first[1], first[5]))


def test_one_answer_with_many_tool_calls_gets_only_the_budget(server, checkout, key):
    server.push(turn(*[call("read_file", path="vllm/v1/sample/sampler.py", start=n) for n in range(1, 11)]))
    run = Run(tools_task(server.base_url, attempts_per_proposal=1, tool_budget={"calls": 6}), checkout)
    with pytest.raises(ProposerExhausted, match="budget: 6 tool calls"):
        run.propose()
    results = tool_events(run)
    assert len(server.requests) == 1 and len(results) == 10  # every call of the answer is answered
    assert [r.ok for r in results] == [True] * 6 + [False] * 4
    assert results[-1].result == "skipped: budget: 6 tool calls (tool_budget.calls) without an accepted proposal"


def test_the_token_and_dollar_budgets_end_a_conversation(server, checkout, key):
    reads = [turn(call("read_file", path="vllm/v1/sample/sampler.py", start=n)) for n in range(1, 15)]
    server.push(*reads)  # each a different range: never stuck, never a pointer
    run = Run(tools_task(server.base_url, attempts_per_proposal=1, tool_budget={"calls": 100, "tokens": 4000}),
              checkout)
    with pytest.raises(ProposerExhausted, match="budget: .* tokens used, the next turn may need"):
        run.propose()
    turns = len(server.requests)
    assert 1 < turns < 100
    server.requests.clear()
    server.script.clear()
    server.push(*reads)
    run = Run(tools_task(server.base_url, attempts_per_proposal=1, tool_budget={"calls": 100, "usd": 0.03}),
              checkout)
    with pytest.raises(ProposerExhausted, match=r"the next turn may pass tool_budget.usd \$0.0300"):
        run.propose()
    assert run.proposer.spend_usd <= 0.03 and len(server.requests) > 1


# ------------------------------------------------------------------------------------------------ replay
def test_replay_feeds_the_recorded_tool_conversation_back_without_the_endpoint(checkout, key, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with FakeOpenAI(script=sampler_expert()) as fake:
        writer = TraceWriter(trace)
        writer.append(run_started())
        recorded = Run(tools_task(fake.base_url), checkout, writer=writer)
        p1 = recorded.propose()
        writer.close()
        base_url = fake.base_url
    model = ReplayModel.from_trace(trace, strict=True)
    replayed = Run(tools_task(base_url), checkout, model=model)
    r1 = replayed.propose()
    assert r1.patch == p1.patch and model.remaining == 0 and model.mismatches == []
    strip = lambda e: e.model_dump(exclude={"latency_s", "params"})  # noqa: E731
    assert [strip(e) for e in replayed.events] == [strip(e) for e in recorded.events]
    kinds = [r.event.kind for r in read_trace(trace)]
    assert kinds.count("tool_call") == 5 and kinds.count("llm_call") == 5


# ---------------------------------------------------------------------------------------------- notebook
def test_the_notebook_records_each_candidate_and_later_proposals_see_it(server, checkout, key):
    server.push(*sampler_expert())
    run = Run(tools_task(server.base_url, repair_turns=0), checkout)
    first = run.propose()
    run.decide(first, "parity", "prompt 2 diverged at token 7: 1234 != 99")
    entry = run.events[-1]
    assert isinstance(entry, NotebookEntry) and entry.candidate == first.candidate
    assert entry.divergence == "prompt 2 diverged at token 7: 1234 != 99" and entry.stage == "parity"
    assert entry.summary.startswith("Candidate 1: skip the softmax in greedy")
    for part in ("Hypothesis: softmax is monotonic", "Files: vllm/v1/sample/sampler.py", "Reached: discard at parity",
                 "Divergence: prompt 2 diverged at token 7", "Outcome: it changes the output tokens"):
        assert part in entry.summary
    server.push(turn(call("notebook")), turn(call("propose", summary="vectorize", edits=[{
        "path": "vllm/v1/sample/sampler.py",
        "search": "    for i in range(len(penalties)):\n        logits[i] = logits[i] - penalties[i]\n",
        "replace": "    logits = logits - penalties\n"}])))
    second = run.propose()
    opening = server.requests[5]["body"]["messages"][1]["content"]
    assert "# Lab notebook" in opening and "Candidate 1: skip the softmax" in opening
    assert "a repair (candidates 1)" in opening
    assert "Divergence: prompt 2 diverged" in tool_events(run)[-2].result
    run.decide(second, "decision", "not significant", verdict="discard")
    near = run.events[-1]
    assert isinstance(near, NotebookEntry) and "Reached: discard at decision" in near.summary


def test_a_near_miss_is_named_and_restore_does_not_write_the_notebook_again(server, checkout, key, tmp_path):
    from traces.schema import Decision

    trace = tmp_path / "trace.jsonl"
    writer = TraceWriter(trace)
    writer.append(run_started())
    server.push(*sampler_expert())
    run = Run(tools_task(server.base_url), checkout, writer=writer)
    proposal = run.propose()
    decision = Decision(candidate=proposal.candidate, verdict="discard", stage="decision", reason="not significant",
                        speedup=1.03, ci_low=0.99, ci_high=1.07)
    run.record(decision)
    from agent.proposers.base import Attempt

    run.proposer.observe(Attempt(proposal, decision))
    writer.close()
    entry = run.events[-1]
    assert "speedup 1.030x [0.990, 1.070]" in entry.summary and "a near miss" in entry.learned
    assert "a refinement of a near miss (candidates 1)" in run.proposer._notebook_text()
    again = Run(tools_task(server.base_url), checkout)
    again.proposer.restore(read_trace(trace))
    assert [e.candidate for e in again.proposer.notebook] == [1] and again.events == []
    assert again.proposer.stats.summary() == run.proposer.stats.summary()  # the funnel, tool calls included


def test_a_repair_continues_the_tool_conversation(server, checkout, key):
    server.push(*sampler_expert())
    run = Run(tools_task(server.base_url, repair_turns=1), checkout)
    first = run.propose()
    run.decide(first, "build", "vllm/v1/sample/sampler.py: ImportError: cannot import name 'x'")
    server.push(turn(call("propose", summary="vectorize", edits=[{
        "path": "vllm/v1/sample/sampler.py", "search": "    return logits\n", "replace": "    return logits + 0\n"}])))
    repaired = run.propose()
    assert repaired.meta["llm"]["repair_of"] == first.candidate
    messages = server.requests[5]["body"]["messages"]
    assert len(messages) == 2 + 5 * 2 + 1  # the whole exploration, then the repair turn
    assert "ACCEPTED" in messages[-2]["content"] and "rejected at the `build` stage" in messages[-1]["content"]
    assert "ImportError: cannot import name 'x'" in messages[-1]["content"]


def test_text_calls_are_parsed_one_a_turn():
    calls = parse_text_calls('CALL grep {"pattern": "a{2}", "path": "vllm"}\nCALL list_dir {}')
    assert calls == [{"id": "text_0", "name": "grep", "arguments": json.dumps({"pattern": "a{2}", "path": "vllm"})}]
    assert parse_text_calls("nothing here") == []
    assert [t["function"]["name"] for t in definitions()][-1] == "propose"


def test_an_endpoint_that_refuses_tools_gets_the_text_protocol(server, checkout, key, tmp_path):
    server.push({"status": 400, "message": '"auto" tool choice requires --enable-auto-tool-choice and '
                                           '--tool-call-parser to be set'},
                {"text": "vllm/v1/sample/sampler.py\n<<<<<<< FUNCTION greedy\ndef greedy(logits):\n"
                         "    return logits.argmax(dim=-1)\n>>>>>>> END\n"})
    writer = TraceWriter(tmp_path / "trace.jsonl")
    writer.append(run_started())
    run = Run(tools_task(server.base_url), checkout, writer=writer)
    proposal = run.propose()
    writer.close()
    assert "tools" in server.requests[0]["body"] and "tools" not in server.requests[1]["body"]
    assert "CALL <tool>" in server.requests[1]["body"]["messages"][0]["content"]
    invalid = next(e for e in run.events if isinstance(e, ProposalInvalid))
    assert "enable-auto-tool-choice" in invalid.reason and invalid.reason.endswith("offered as text from now on)")
    assert proposal.meta["llm"]["tools"] == "text" and run.proposer.protocol == "text"
    resumed = Run(tools_task(server.base_url), checkout)
    resumed.proposer.restore(read_trace(tmp_path / "trace.jsonl"))
    assert resumed.proposer.protocol == "text"


# ------------------------------------------------------------------------------ small models' habits
def test_a_call_written_as_json_in_the_text_is_carried_out(server, checkout, key):
    """Small models (Qwen2.5-Coder-1.5B at vLLM's hermes parser, measured) often answer a tools request with the
    call as a fenced JSON object in the text: it is read as the call, and goes through the same checks."""
    fenced = '```json\n{\n  "name": "read_file",\n  "arguments": {"path": "vllm/v1/sample/sampler.py", "end": 7}\n}\n```'
    hostile = '<tool_call>{"name": "read_file", "arguments": {"path": "../../etc/passwd"}}</tool_call>'
    server.push({"text": fenced}, {"text": hostile}, *sampler_expert()[4:])
    run = Run(tools_task(server.base_url), checkout)
    run.propose()
    calls = tool_events(run)
    assert [(c.name, c.ok) for c in calls[:2]] == [("read_file", True), ("read_file", False)]
    assert calls[0].result.startswith("1| ")
    assert calls[1].result == "error: path: '../../etc/passwd' is not a path inside the checkout"
    # the model sees each result as the answer to its call
    second = server.requests[1]["body"]["messages"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert second[-1]["role"] == "tool" and second[-1]["content"] == calls[0].result


def test_json_calls_in_text_only_when_they_are_calls():
    assert parse_text_calls('{"name": "grep", "arguments": {"pattern": "x"}}') == [
        {"id": "text_0", "name": "grep", "arguments": json.dumps({"pattern": "x"})}]
    assert parse_text_calls('{"name": "grep", "parameters": {"pattern": "x"}}')[0]["arguments"] == '{"pattern": "x"}'
    assert parse_text_calls('config = {"name": 3, "arguments": []}') == []
    assert parse_text_calls('{"name": "grep", "arguments": {"pattern": ') == []  # cut off: no call
    # CALL lines win over JSON in the same answer, and only one call is taken a turn
    assert parse_text_calls('CALL list_dir {}\n{"name": "grep", "arguments": {}}')[0]["name"] == "list_dir"


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_choice_required_is_sent_with_every_tools_request(server, checkout, key, choice):
    server.push(*sampler_expert())
    run = Run(tools_task(server.base_url, tool_choice=choice), checkout)
    run.propose()
    bodies = [r["body"] for r in server.requests]
    assert len(bodies) == 5 and all("tools" in b for b in bodies)
    assert [b.get("tool_choice") for b in bodies] == [None if choice == "auto" else "required"] * 5
    params = next(e for e in run.events if isinstance(e, LlmCall)).params
    assert params.get("tool_choice") == (None if choice == "auto" else "required")


def test_a_repeated_call_is_answered_by_a_pointer_not_again(server, checkout, key):
    """Qwen2.5-Coder-1.5B at temperature 0 read the same 300 lines four times in a row until its context was full
    (measured): the second identical read-only call gets a one-line pointer to the first answer."""
    read = call("read_file", path="vllm/v1/sample/sampler.py", start=1, end=8)
    server.push(*numbered([turn(read), turn(read), turn(call("read_file", path="vllm/v1/sample/sampler.py", end=8,
                                                            start=1))]), *sampler_expert()[4:])
    run = Run(tools_task(server.base_url), checkout)
    run.propose()
    calls = tool_events(run)
    assert [c.name for c in calls] == ["read_file", "read_file", "read_file", "propose"]
    assert calls[0].ok and calls[0].result.startswith("1| ")
    for again in calls[1:3]:  # the same arguments in another order are the same call
        assert not again.ok and again.result.startswith("repeated: read_file with these arguments was answered at "
                                                        "your tool call 1, above")
    assert calls[3].ok and "ACCEPTED" in calls[3].result


def test_a_model_stuck_on_one_call_ends_its_conversation_and_the_next_starts_warmer(server, checkout, key):
    """The 1.5B read one missing file 18 times in a row at temperature 0 (measured): 3 repeats in a row end it."""
    missing = call("read_file", path="vllm/missing.py")
    server.push(*numbered([turn(missing)] * 4), *sampler_expert())
    run = Run(tools_task(server.base_url, tool_budget={"calls": 20}), checkout)
    proposal = run.propose()
    invalid = [e for e in run.events if isinstance(e, ProposalInvalid)]
    assert [e.reason for e in invalid] == ["stuck: 3 repeated tool calls in a row (the same arguments as an earlier "
                                           "call); a fresh conversation starts warmer"]
    assert len(server.requests) == 4 + 5 and server.requests[4]["body"]["temperature"] == 0.7
    assert proposal.summary.startswith("skip the softmax")


def test_the_same_rejected_propose_is_a_repeat_too(server, checkout, key):
    """Measured on the 1.5B (run I): the same propose, rejected as ambiguous, sent five times in a row."""
    bad = call("propose", summary="rename", edits=[{"path": "vllm/v1/sample/sampler.py", "search": "logits",
                                                    "replace": "scores"}])
    server.push(*numbered([turn(bad)] * 4), *sampler_expert())
    run = Run(tools_task(server.base_url, tool_budget={"calls": 20}), checkout)
    proposal = run.propose()
    calls = tool_events(run)
    assert calls[0].result.startswith("REJECTED") and "occurs" in calls[0].result
    for again in calls[1:4]:
        assert again.result.startswith("repeated: propose with these arguments was rejected at your tool call 1")
    invalid = [e for e in run.events if isinstance(e, ProposalInvalid)]
    assert [e.reason.split(":")[0] for e in invalid] == ["stuck"]
    assert proposal.summary.startswith("skip the softmax")  # the next conversation's change


def test_the_same_failing_call_and_the_same_folder_spelled_otherwise_are_repeats(server, checkout, key):
    """Measured on the 1.5B: eight reads in a row of a file that does not exist, and `list_dir .` then `./`."""
    missing = call("read_file", path="vllm/model_executor/layers/prepare_input_ids.py")
    server.push(*numbered([turn(missing), turn(missing), turn(call("list_dir", path=".")),
                           turn(call("list_dir", path="./"))]), *sampler_expert()[4:])
    run = Run(tools_task(server.base_url), checkout)
    run.propose()
    calls = tool_events(run)
    assert calls[0].result == "error: vllm/model_executor/layers/prepare_input_ids.py is not a file"
    assert calls[1].result.startswith("repeated: read_file with these arguments was answered at your tool call 1")
    assert calls[2].ok and calls[3].result.startswith("repeated: list_dir with these arguments was answered at your "
                                                      "tool call 3")


def test_old_tool_results_are_elided_to_fit_the_context(server, checkout, key):
    from agent.proposers.clients import messages_tokens
    from agent.proposers.transcript import ELIDED, fit

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for n in range(4):
        messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": str(n)}]},
                     {"role": "tool", "tool_call_id": str(n), "content": "x" * 3500}]
    assert messages_tokens(messages) > 4000
    assert fit(messages, 2500, messages_tokens)
    contents = [m["content"] for m in messages if m["role"] == "tool"]
    assert contents == [ELIDED] * 2 + ["x" * 3500] * 2  # the oldest go first, only as many as needed
    assert not fit([{"role": "system", "content": "s" * 20000}, {"role": "user", "content": "u"}], 2500,
                   messages_tokens)
    # through the proposer: a conversation that cannot fit ends, named, and a fresh one starts
    big = call("grep", pattern="def", path="vllm")
    server.push(*numbered([turn(big)]), *sampler_expert())
    run = Run(tools_task(server.base_url, context_tokens=1000, max_tokens=900), checkout)
    with pytest.raises(ProposerExhausted):
        run.propose()
    invalid = [e for e in run.events if isinstance(e, ProposalInvalid)]
    assert invalid and invalid[0].reason.startswith("context: the conversation needs about")


def test_a_long_python_file_read_whole_is_answered_by_its_outline(checkout):
    """Qwen2.5-Coder-1.5B opened a 7,255-line file at line 1 and read imports (measured): a Python file longer than
    one read, asked for without a range, is answered by its classes and functions with their lines."""
    body = "".join(f"# filler {n}\n" for n in range(400))
    body += "class Runner:\n    def step(self, x):\n        return x\n\n\ndef helper():\n    return 1\n"
    (checkout / "vllm" / "v1" / "big.py").write_text(body)
    tools = box(checkout)
    outline = tools.call("read_file", {"path": "vllm/v1/big.py"})
    assert outline.ok and outline.text.splitlines() == [
        "vllm/v1/big.py: 407 lines, more than one read shows (300). Its classes and functions (line| definition); "
        "read one with start and end:",
        "   401| class Runner  (to 403)", "   402|     def step  (to 403)", "   406| def helper  (to 407)"]
    assert tools.call("read_file", {"path": "vllm/v1/big.py", "start": 401, "end": 402}).text == (
        "401| class Runner:\n402|     def step(self, x):\n[lines 401-402 of 407]")
    assert tools.call("read_file", {"path": "vllm/v1/big.py", "end": 2}).text.startswith("1| # filler 0\n")
    (checkout / "vllm" / "v1" / "broken.py").write_text(body + "def (:\n")  # does not parse: the first lines
    assert tools.call("read_file", {"path": "vllm/v1/broken.py"}).text.startswith("  1| # filler 0\n")


def test_propose_arguments_of_an_unambiguous_wrong_shape_are_read_as_meant(checkout):
    """Qwen2.5-Coder-1.5B sent `edits: {"functions": [...]}` (measured): shapes that can mean one thing are read as
    that thing and checked as usual; an ambiguous one is refused by the schema, named."""
    code = "def greedy(logits):\n    return logits.argmax(dim=-1)\n"
    function = {"path": "vllm/v1/sample/sampler.py", "name": "greedy", "code": code}
    for shape in ({"edits": {"functions": [function]}}, {"functions": function}, {"edits": [function]},
                  {"edits": {"functions": function}}):  # the last measured in run J
        result = box(checkout).call("propose", {"summary": "argmax of the logits", **shape})
        assert result.ok and result.patch is not None and "ACCEPTED" in result.text, result.text
    long_plan = box(checkout).call("propose", {"summary": "argmax", "plan": "p" * 330, "functions": [function]})
    assert long_plan.ok and long_plan.plan == "p" * 197 + "..."  # the 1.5B's plan ran to 330 characters
    many = box(checkout).call("grep", {"pattern": "def ", "path": "vllm", "max_results": 300})  # asked by the 1.5B
    assert many.ok and "sampler.py" in many.text
    assert "greater than or equal to 1" in box(checkout).call("grep", {"pattern": "a", "max_results": 0}).text
    # measured (run H): each edit labelled by its kind, the label repeated, in a JSON string; a plain parse keeps
    # only the last edit, so every value is kept and the object read as the list of its edits
    labelled = ('{"summary": "s", "edits": {"SearchReplace": {"path": "vllm/v1/sample/sampler.py", '
                '"search": "    probs = torch.softmax(logits.float(), dim=-1)\\n    return probs.argmax(dim=-1)\\n", '
                '"replace": "    return logits.argmax(dim=-1)\\n"}, "SearchReplace": {"path": "vllm/v1/sample/sampler.py", '
                '"search": "        logits[i] = logits[i] - penalties[i]\\n", '
                '"replace": "        logits[i] -= penalties[i]\\n"}}}')
    both = box(checkout).call("propose", labelled)
    assert both.ok and both.patch is not None, both.text
    assert "return logits.argmax" in both.patch.diff and "logits[i] -= penalties[i]" in both.patch.diff
    twice = box(checkout).call("propose", '{"summary": "s", "summary": "t", "functions": []}')
    assert not twice.ok and "summary#2" in twice.text  # a repeated key elsewhere is named, not dropped
    no_path = box(checkout).call("propose", {"summary": "s", "edits": {"functions": {"name": "greedy", "code": code}}})
    assert not no_path.ok and "functions.0.path: Field required" in no_path.text  # read as meant, then named
    lone = box(checkout).call("propose", {"summary": "s", "edits": {"search": "a", "replace": "b"}})  # run J
    assert not lone.ok and "edits.0.path: Field required" in lone.text
    refused = box(checkout).call("propose", {"summary": "s", "edits": {"functions": function, "x": 1}})
    assert not refused.ok and refused.text.startswith("error: bad arguments for propose: edits: Input should be a "
                                                      "valid list")


def test_the_funnel_counts_an_identity_rejected_earlier_as_an_identity(checkout):
    """Run L's first propose replaced `rms_norm` by `rms_norm`; its SEARCH was ambiguous, so the identity check never
    ran, and the funnel counted it as a non-identity proposal. It is counted by what the edits say."""
    from agent.proposers.funnel import llm_funnel

    def propose(edits, **more):
        args = json.dumps({"summary": "x", "edits": edits, **more})
        return ToolCall(candidate=1, call_id="c", name="propose", arguments=args,
                        result=box(checkout).call("propose", json.loads(args)).text, ok=False)

    same = {"path": "vllm/v1/sample/sampler.py", "search": "logits", "replace": "logits"}
    events = [propose([same]), propose([{**same, "search": "probs", "replace": "p"}]),
              propose([same, {**same, "replace": "scores"}]), propose([same], functions=[{"path": "x", "name": "f",
                                                                                           "code": "def f(): pass"}])]
    assert "ambiguous" in events[0].result and "identity: FAILED" not in events[0].result
    funnel = llm_funnel(events)
    assert (funnel["proposes"], funnel["non_identity_proposes"]) == (4, 3)
