"""The tool-using LLM proposer through the real loop: scripted models on the loopback OpenAI-compatible server,
fake vLLM servers in real processes (tests/fake_vllm.py), a real git checkout and trace. The expert's patch reaches
the benchmark and is kept, with the notebook in `review` and the report; the adversary's patch, right alone and
wrong in batches, passes parity and is rejected at the audit."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.replay.chain import audit
from agent.face.html_report import write_report
from agent.run.loop import Loop
from agent.proposers.llm import LlmProposer
from agent.face.report import review_tables
from agent.proposers.clients import ReplayModel
from agent.run.setup import prepare_run
from agent.world.task import parse_task
from fake_openai_server import FakeOpenAI
from scripted_models import call, numbered, turn
from tests.fake_sandbox import FakeSandbox
from tests.stand_in import REQUEST_TIMEOUT_S, VERSION, fake_task, mode
from traces import read_trace


def expert(config: str, summary: str) -> list[dict]:
    """List, grep, read, a propose outside the surface (the mistake), then the fix."""
    return numbered([
        turn(call("list_dir", path="vllm")),
        turn(call("grep", pattern="VERSION", path="vllm")),
        turn(call("read_file", path="vllm/__init__.py")),
        turn(call("propose", summary=summary, hypothesis="the stand-in server reads its speed from this file",
                  edits=[{"path": "vllm/entrypoints/fake_mode_1.json", "search": "", "replace": config}])),
        turn(call("propose", summary=summary, hypothesis="the stand-in server reads its speed from this file",
                  plan="a new hot spot", edits=[{"path": "vllm/fake_mode_1.json", "search": "", "replace": config}])),
    ])


PROFILE = "(the stand-in has no profile)"


def llm_run(tmp_path, checkout, model, script):
    """The loop, one candidate, the LLM proposer talking to the scripted model: (setup, run_finished)."""
    with FakeOpenAI(script=script) as server:
        # 8 pairs, not 5: a keep is confirmed, and one stalled pass of 5 on a busy 2-core host can sink it
        task = fake_task(checkout, model, tmp_path, budget={"max_candidates": 1},
                         benchmark={"warmup_requests": 2, "repetitions": 8, "request_timeout_s": REQUEST_TIMEOUT_S,
                                    "max_client_busy": 1.0},
                         proposer={"kind": "llm", "base_url": server.base_url, "model": "scripted",
                                   "api_key_env": None, "profile": False, "tools": "native", "request_timeout_s": 10,
                                   "max_retries": 0})
        setup = prepare_run(task, tmp_path / "runs", vllm_version=VERSION)
        loop = Loop(setup, LlmProposer.from_task(task, profile=PROFILE),
                    sandbox=FakeSandbox(tmp_path / "servers"))
        return setup, loop.run()


def events(setup) -> list:
    return [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]


@pytest.mark.serial  # a keep by speed: beside the heavy tier the 4x-faster stand-in measured 1.6-1.8x, [0.8, 3.4]
def test_the_scripted_expert_is_kept_and_review_shows_the_notebook(tmp_path, fake_checkout, fake_model):
    setup, finished = llm_run(tmp_path, fake_checkout, fake_model, expert(mode("exact", 0.0025) + "\n",
                                                                          "serve 4x faster"))
    trace = events(setup)
    calls = [e for e in trace if e.kind == "tool_call"]
    assert [c.name for c in calls] == ["list_dir", "grep", "read_file", "propose", "propose"]
    assert "surface: vllm/entrypoints/fake_mode_1.json is outside the edit surface" in calls[3].result
    assert "ACCEPTED" in calls[4].result
    decision = next(e for e in trace if e.kind == "decision")
    assert decision.verdict == "keep" and decision.ci_low > 1.05, decision.reason
    assert finished.kept == 1 and audit(setup.run_dir).commits == 1
    entry = next(e for e in trace if e.kind == "notebook")
    assert f"speedup {decision.speedup:.3f}x [{decision.ci_low:.3f}, {decision.ci_high:.3f}]" in entry.summary
    assert "Outcome: kept" in entry.summary
    tables = review_tables(setup.run_dir)
    branch = next(t for t in tables if t.title.startswith("branch "))  # after the relaxed checks the fake task names
    assert branch.row_count == 1 and tables[-1].title.startswith("lab notebook")
    assert entry.summary in str(tables[-1].columns[1]._cells)
    page = write_report(setup.run_dir).read_text()
    assert "<h2>Lab notebook</h2>" in page and "Candidate 1: serve 4x faster." in page
    # replay --rerun: the recorded task again, the recorded answers fed back, the endpoint gone
    task = parse_task(trace[0].task, "run_started.task")
    model = ReplayModel.from_trace(setup.run_dir / "trace.jsonl", strict=True)
    rerun = prepare_run(task, tmp_path / "rerun", vllm_version=VERSION)
    Loop(rerun, LlmProposer.from_task(task, model=model, profile=PROFILE),
         sandbox=FakeSandbox(tmp_path / "rerun-servers")).run()
    again = events(rerun)
    assert model.remaining == 0 and model.mismatches == []
    assert [(c.name, c.result) for c in again if c.kind == "tool_call"] == [(c.name, c.result) for c in calls]
    assert next(e for e in again if e.kind == "proposal").patch == next(e for e in trace if e.kind == "proposal").patch


def test_the_scripted_adversary_right_alone_wrong_in_batches_is_rejected_at_the_audit(tmp_path, fake_checkout,
                                                                                         fake_model):
    setup, finished = llm_run(tmp_path, fake_checkout, fake_model, expert(mode("batched", 0.0025) + "\n",
                                                                          "serve 4x faster in batches"))
    trace = events(setup)
    parity = next(e for e in trace if e.kind == "parity" and e.candidate == 1)
    decision = next(e for e in trace if e.kind == "decision")
    assert parity.ok and (decision.verdict, decision.stage) == ("discard", "audit"), decision.reason
    assert finished.kept == 0 and audit(setup.run_dir).commits == 0
    entry = next(e for e in trace if e.kind == "notebook")
    assert entry.stage == "audit" and entry.divergence.startswith(decision.reason[:100])
    assert "right alone, wrong in a batch" in entry.learned
