"""Trying before the GPU is spent (undefined names, the changed modules imported, engine args against the levers) and
a memory that lasts the night (the notebook newest first, `candidate`, the model's reflections, the trace's deltas
rebuilt by replay and resume)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from agent.proposers.clients import ReplayModel, expand_messages
from agent.proposers.tools import Toolbox
from fake_openai_server import FakeOpenAI
from scripted_models import call, sampler_expert, turn
from tests.proposers.test_llm_proposer import Run, checkout, key, make_task, run_started, server  # noqa: F401
from traces.log import TraceWriter, read_trace
from traces.schema import LlmCall, NotebookEntry, ToolCall


def git_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    return root


def propose(box: Toolbox, **arguments) -> str:
    return box.call("propose", json.dumps({"summary": "s", **arguments})).text


# ------------------------------------------------------------------------------------------ before the GPU
def test_an_undefined_name_and_a_failed_import_are_refused_before_any_server(tmp_path):
    root = git_tree(tmp_path / "t", {"pkg/__init__.py": "", "pkg/mod.py": "import os\n\n\ndef f():\n    return os.sep\n",
                                     "pkg/other.py": "VALUE = 1\n"})
    box = Toolbox(root, ["pkg/*"], [], import_timeout_s=60)
    answer = propose(box, edits=[{"path": "pkg/mod.py", "search": "    return os.sep\n", "replace": "    return sepp\n"}])
    assert "names: FAILED" in answer and "pkg/mod.py: undefined name 'sepp'" in answer and "REJECTED" in answer
    answer = propose(box, edits=[{"path": "pkg/other.py", "search": "VALUE = 1\n",
                                  "replace": "from pkg.mod import g\nVALUE = 1\n"}])
    assert "names: ok" in answer and "import: FAILED" in answer and "ImportError" in answer, answer
    answer = propose(box, edits=[{"path": "pkg/other.py", "search": "VALUE = 1\n", "replace": "VALUE = 2\n"}])
    assert "import: ok" in answer and "ACCEPTED" in answer, answer


def test_an_import_the_incumbent_fails_too_is_not_blamed_on_the_candidate(tmp_path):
    root = git_tree(tmp_path / "t", {"pkg/__init__.py": "", "pkg/mod.py": "import not_on_this_host\nX = 1\n"})
    box = Toolbox(root, ["pkg/*"], [], import_timeout_s=60)
    answer = propose(box, edits=[{"path": "pkg/mod.py", "search": "X = 1\n", "replace": "X = 2\n"}])
    assert "ACCEPTED" in answer and "not checked: the incumbent's fails on this host too" in answer, answer


def test_engine_args_are_proposable_and_checked_against_the_levers(server, checkout, key):  # noqa: F811
    task = make_task(server.base_url, tools="native")
    task.edit_surface.engine_args = ["max_num_seqs", "async_scheduling"]
    task.edit_surface.engine_values = {"async_scheduling": [None, False]}
    server.push(turn(call("propose", summary="more sequences", engine_args={"block_size": 32})),
                turn(call("propose", summary="more sequences", engine_args={"max_num_seqs": "many"})),
                turn(call("propose", summary="more sequences", engine_args={"async_scheduling": True})),
                turn(call("propose", summary="more sequences", engine_args={"max_num_seqs": 4})),
                turn(call("propose", summary="more sequences", engine_args={"max_num_seqs": 16})))
    run = Run(task, checkout)
    proposal = run.propose()
    results = [e.result for e in run.events if isinstance(e, ToolCall)]
    assert "block_size is not a lever of this task" in results[0]
    assert "not of the incumbent's type (int, now 4)" in results[1]
    assert "async_scheduling=true is not allowed (allowed: null, false)" in results[2]
    assert "no change" in results[3]
    assert "engine args: ok (max_num_seqs=16)" in results[4] and "ACCEPTED" in results[4]
    assert proposal.engine_args == {"max_num_seqs": 16} and proposal.patch == ""
    opening = server.requests[0]["body"]["messages"][1]["content"]
    assert "max_num_seqs=4; async_scheduling=null (one of null, false)" in opening


# ------------------------------------------------------------------------------------------ the memory
def test_newest_first_the_candidate_tool_and_the_models_reflection(server, checkout, key, tmp_path):  # noqa: F811
    trace = tmp_path / "trace.jsonl"
    writer = TraceWriter(trace)
    writer.append(run_started())
    server.push(*sampler_expert())
    run = Run(make_task(server.base_url, tools="native", repair_turns=0), checkout, writer=writer)
    first = run.propose()
    run.decide(first, "parity", "prompt 2 diverged at token 7: 1234 != 99")
    server.push(turn(call("candidate", number=1)),
                turn(call("propose", summary="vectorize the penalties", plan="a new hot spot",
                          reflection="argmax after softmax is not argmax of the logits in float: ties differ",
                          edits=[{"path": "vllm/v1/sample/sampler.py",
                                  "search": "    for i in range(len(penalties)):\n        logits[i] = logits[i] - "
                                            "penalties[i]\n",
                                  "replace": "    logits = logits - penalties\n"}])))
    second = run.propose()
    opening = server.requests[5]["body"]["messages"][1]["content"]
    assert "# Your last result: candidate 1" in opening and "`reflection`" in opening
    shown = [e for e in run.events if isinstance(e, ToolCall)][-2].result
    assert shown.startswith("Candidate 1 [llm]: skip the softmax in greedy")
    assert "Decision: discard at parity" in shown and "Evidence (parity): prompt 2 diverged" in shown
    assert "Diff:\n--- a/vllm/v1/sample/sampler.py" in shown or "Diff:\ndiff --git" in shown
    reflected = [e for e in run.events if isinstance(e, NotebookEntry)]
    assert [e.candidate for e in reflected] == [1, 1] and reflected[1].reflection.startswith("argmax after softmax")
    assert "Reflection: argmax after softmax" in reflected[1].summary
    run.decide(second, "decision", "not significant", verdict="discard")
    text = run.proposer._notebook_text()
    assert text.startswith("Next, choose explicitly")
    assert text.index("Candidate 2:") < text.index("Candidate 1:")  # newest first
    writer.close()
    again = Run(make_task(server.base_url, tools="native"), checkout)
    again.proposer.restore(read_trace(trace))
    assert [(e.candidate, bool(e.reflection)) for e in again.proposer.notebook] == [(1, True), (2, False)]


def forty_turns() -> list[dict]:
    """A 40-turn conversation: 39 reads of the toy sampler (each a different range), then a propose."""
    reads = [turn(call("read_file", path="vllm/v1/sample/sampler.py", start=1 + n % 5, end=6 + n % 5 + n // 5))
             for n in range(39)]
    return reads + [turn(call("propose", summary="vectorize the penalties", edits=[{
        "path": "vllm/v1/sample/sampler.py",
        "search": "    for i in range(len(penalties)):\n        logits[i] = logits[i] - penalties[i]\n",
        "replace": "    logits = logits - penalties\n"}]))]


def test_the_trace_keeps_each_calls_new_messages_and_replay_and_resume_rebuild_them(checkout, key, tmp_path):  # noqa: F811
    from scripted_models import numbered

    trace = tmp_path / "trace.jsonl"
    writer = TraceWriter(trace)
    writer.append(run_started())
    with FakeOpenAI(script=numbered(forty_turns())) as fake:
        task = make_task(fake.base_url, tools="native", context_tokens=200_000,
                         tool_budget={"calls": 60})
        run = Run(task, checkout, writer=writer)
        proposal = run.propose()
        sent = [r["body"]["messages"] for r in fake.requests]
    writer.close()
    calls = [r.event for r in read_trace(trace) if isinstance(r.event, LlmCall)]
    assert len(calls) == 40 and all(c.prefix > 0 for c in calls[1:])
    rebuilt = expand_messages(calls)
    assert [[m.get("content") for m in r] for r in rebuilt] == [[m.get("content") for m in s] for s in sent]
    # the same trace with whole conversations, as every trace was written before deltas
    whole = tmp_path / "whole.jsonl"
    out = TraceWriter(whole)
    n = 0
    for record in read_trace(trace):
        event = record.event
        if isinstance(event, LlmCall):
            event = event.model_copy(update={"messages": rebuilt[n], "prefix": 0, "elided": []})
            n += 1
        out.append(event)
    out.close()
    after, before = trace.stat().st_size, whole.stat().st_size
    print(f"\n40-turn trace: {before} bytes with whole conversations, {after} bytes with each call's new messages")
    assert after * 3 < before
    for path in (trace, whole):  # replay, strict: every request the same as recorded
        model = ReplayModel.from_trace(path, strict=True)
        replayed = Run(make_task("http://127.0.0.1:9", tools="native", context_tokens=200_000,
                                 tool_budget={"calls": 60}), checkout, model=model)
        assert replayed.propose().patch == proposal.patch and model.mismatches == [] and model.remaining == 0
    # resume: the restored proposer rebuilds the conversation behind the proposal (for its repair turn)
    again = Run(task, checkout)
    again.proposer.restore(read_trace(trace))
    last = again.proposer._last
    assert last is not None and last.messages[:len(sent[-1])] == sent[-1]
