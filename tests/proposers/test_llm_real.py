"""Opt-in: the LLM proposer against a small real code model served locally by vLLM's CPU build.

    scripts/serve-small-model.sh &                       # Qwen2.5-Coder-0.5B-Instruct on :8011
    NIGHTSHIFT_REAL_LLM_URL=http://127.0.0.1:8011/v1 python -m pytest -m real_llm tests/proposers/test_llm_real.py -s

It asks for a handful of proposals against the CPU tiny task's edit surface on a real vLLM
checkout (made from the installed vLLM by `nightshift checkout`'s code) and prints what share of
the answers parsed and applied. With no endpoint set, the test is skipped.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from agent.proposers.base import ProposalContext, ProposerExhausted
from agent.proposers.llm import LlmProposer
from agent.world.task import parse_task

URL = os.environ.get("NIGHTSHIFT_REAL_LLM_URL")
MODEL = os.environ.get("NIGHTSHIFT_REAL_LLM_MODEL", "qwen-coder-0.5b")
PROPOSALS = int(os.environ.get("NIGHTSHIFT_REAL_LLM_PROPOSALS", "4"))
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.real_llm,
              pytest.mark.skipif(not URL, reason="set NIGHTSHIFT_REAL_LLM_URL (see scripts/serve-small-model.sh)")]


def tiny_cpu_task(base_url: str):
    return parse_task({
        "name": "gemma4-tiny-cpu",
        "description": "A small Gemma-4-architecture model with synthetic weights, served by vLLM's CPU build.",
        "target": {"vllm_version": "0.32.0"},
        "model": {"synthetic": {"config": str(ROOT / "tasks/models/gemma4-tiny/config.json")},
                  "dtype": "bfloat16", "max_model_len": 512},
        "engine": {"args": {"max_num_seqs": 4, "enforce_eager": True}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "workload": {"num_prompts": 32, "input_len": 64, "output_len": 32},
        "parity": {"num_prompts": 8, "input_len": 32, "max_tokens": 16},
        "edit_surface": {"include": ["vllm/model_executor/*", "vllm/v1/worker/*", "vllm/v1/attention/*",
                                     "vllm/v1/core/*", "vllm/v1/sample/*"],
                         "exclude": ["vllm/entrypoints/*"]},
        "budget": {"max_candidates": PROPOSALS, "wall_clock_s": 3600, "max_llm_tokens": 400_000},
        "proposer": {"kind": "llm", "base_url": base_url, "model": MODEL, "api_key_env": None,
                     "max_tokens": 1024, "request_timeout_s": 600, "max_retries": 1, "context_tokens": int(os.environ.get("NIGHTSHIFT_REAL_LLM_CONTEXT", "3000")),
                     "attempts_per_proposal": 2, "repair_turns": 1,
                     "profile": os.environ.get("NIGHTSHIFT_REAL_LLM_PROFILE", "1") == "1"},
    })


def test_small_real_model_proposes_against_the_cpu_task(tmp_path):
    from agent.world.checkout import create_checkout, default_checkout_path, installed_vllm

    _, version = installed_vllm()
    checkout, _ = create_checkout(default_checkout_path(version))
    task = tiny_cpu_task(URL)
    proposer = LlmProposer.from_task(task)
    events: list = []
    proposals = []
    started = time.monotonic()
    for n in range(1, PROPOSALS + 1):
        ctx = ProposalContext(task=task, candidate=n, checkout=checkout, incumbent_args=dict(task.engine.args),
                              record=lambda e: events.append(e) or "")
        try:
            proposals.append(proposer.propose(ctx))
        except ProposerExhausted as exc:
            events.append(type("Exhausted", (), {"kind": "exhausted", "reason": str(exc)})())
    stats = proposer.stats
    report = {"proposals_asked": PROPOSALS, "answers": stats.answers, "parsed": stats.parsed,
              "applied": stats.applied, "invalid": stats.invalid,
              "tokens_in": proposer.tokens_in, "tokens_out": proposer.tokens_out,
              "seconds": round(time.monotonic() - started, 1)}
    print("\nREAL_LLM_REPORT " + json.dumps(report))
    for p in proposals:
        print(f"--- candidate {p.candidate}: {p.summary}\n{p.patch[:1500]}")
    calls = [e for e in events if getattr(e, "kind", "") == "llm_call"]
    assert calls
    assert stats.answers >= PROPOSALS, [c.error for c in calls if c.error]  # it answered each time
    for p in proposals:  # whatever it wrote, only surface files can come out
        for line in p.patch.splitlines():
            if line.startswith("+++ b/"):
                assert line[6:].startswith(("vllm/model_executor/", "vllm/v1/"))
