"""A whole CPU run per provider contract: the LLM task on the real vLLM CPU build, its proposer a scripted model
served by a loopback server that enforces one provider's request rules (tests/fake_providers.py: an OpenAI reasoning
model, Gemini's and Anthropic's OpenAI-compatible endpoints, `vllm serve` with tool calling).

Each run is `nightshift run tasks/gemma4-tiny-cpu-llm.yaml` through the CLI, the endpoint set by the environment only
(NIGHTSHIFT_LLM_URL / _MODEL / _KEY, as a user would), one candidate: the scripted expert's conversation (list, grep,
read, a failed proposal, the fix) reaches the gate, and `nightshift replay` re-derives the run. Prints one line per
contract and writes a Markdown table.

    python benchmarks/provider_runs.py --out benchmarks/results/provider-runs.md [--contracts openai-reasoning,gemini]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fake_openai_server import FakeOpenAI  # noqa: E402
from fake_providers import Anthropic, Gemini, OpenAIReasoning, Vllm  # noqa: E402
from scripted_models import GEMMA4, gemma4_expert, numbered  # noqa: E402
from traces import read_trace  # noqa: E402

CONTRACTS = {c.name: c for c in (OpenAIReasoning(), Gemini(), Anthropic(), Vllm())}
REASONING = ["--set", "proposer.temperature=null", "--set", "proposer.max_tokens=null",
             "--set", "proposer.max_completion_tokens=16000", "--set", "proposer.context_tokens=60000",
             "--set", "proposer.tool_choice=auto"]
"""What tasks/gemma4-tiny-cpu-llm.yaml's header tells a user of a hosted reasoning model to set."""
SHORT = ["--set", "budget.max_candidates=1", "--set", "benchmark.max_repetitions=null",
         "--set", "acceptance.confirmations=0"]
"""One candidate, a fixed 8 pairs and no confirmation: the conversation and the gate's stages are what is run here,
not the judge's precision (benchmarks/results/cpu-judge.md)."""


def script_for(contract, checkout: Path) -> list[dict]:
    script = gemma4_expert((checkout / GEMMA4).read_text())
    if isinstance(contract, (OpenAIReasoning, Vllm)):
        return numbered(script)
    return [{**s, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in s["tool_calls"]]}
            for s in script]  # the provider names its calls


def one_run(name: str, checkout: Path, runs: Path) -> dict:
    contract = CONTRACTS[name]
    run_id = f"provider-{name}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIGHTSHIFT_LLM_MODEL": "frontier", "NIGHTSHIFT_LLM_KEY": "sk-run"}
    began = time.monotonic()
    with FakeOpenAI(script=script_for(contract, checkout), contract=contract) as server:
        env["NIGHTSHIFT_LLM_URL"] = server.base_url
        argv = [sys.executable, "-m", "agent.face.cli", "run", str(ROOT / "tasks" / "gemma4-tiny-cpu-llm.yaml"),
                "--runs-dir", str(runs), "--checkout", str(checkout), "--run-id", run_id, "--quiet", *SHORT,
                *(REASONING if isinstance(contract, OpenAIReasoning) else [])]
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        requests, refused = len(server.requests), len(server.refused)
    wall = time.monotonic() - began
    row = {"contract": name, "exit": proc.returncode, "wall_s": round(wall), "requests": requests,
           "refused": refused}
    trace = runs / run_id / "trace.jsonl"
    if not trace.exists():
        row["error"] = (proc.stderr or proc.stdout)[-400:]
        return row
    events = [r.event for r in read_trace(trace)]
    calls = [e for e in events if e.kind == "llm_call"]
    row["llm_calls"] = len(calls)
    row["failed_calls"] = sum(1 for c in calls if c.error)
    row["tokens"] = sum(c.usage.get("prompt_tokens", 0) + c.usage.get("completion_tokens", 0) for c in calls)
    row["tools"] = ", ".join(e.name for e in events if e.kind == "tool_call")
    decision = next((e for e in events if e.kind == "decision"), None)
    if decision is not None:
        interval = (f" {decision.speedup:.3f}x [{decision.ci_low:.3f}, {decision.ci_high:.3f}]"
                    if decision.speedup is not None else "")
        row["decision"] = f"{decision.verdict} at {decision.stage}{interval}"
    row["finished"] = events[-1].kind == "run_finished" and events[-1].reason
    replay = subprocess.run([sys.executable, "-m", "agent.face.cli", "replay", run_id, "--runs-dir", str(runs)],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    row["replay"] = "audit ok" if replay.returncode == 0 and "audit ok" in replay.stdout else \
        f"failed: {(replay.stdout + replay.stderr)[-200:]}"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the Markdown table here")
    parser.add_argument("--contracts", default=",".join(CONTRACTS))
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/nightshift-provider-runs"))
    parser.add_argument("--checkout", type=Path, help="a vLLM checkout (default: built from the installed vLLM)")
    args = parser.parse_args()
    names = [n for n in args.contracts.split(",") if n]
    unknown = [n for n in names if n not in CONTRACTS]
    if unknown:
        parser.error(f"unknown contract {', '.join(unknown)}; known: {', '.join(CONTRACTS)}")
    checkout = args.checkout
    if checkout is None:
        from agent.world.checkout import create_checkout
        checkout, _ = create_checkout(args.runs_dir / "checkout")
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        row = one_run(name, checkout, args.runs_dir)
        rows.append(row)
        print(" | ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    if args.out:
        head = ["contract", "exit", "wall_s", "requests", "refused", "llm_calls", "failed_calls", "tokens", "tools", "decision",
                "finished", "replay"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(r.get(k, r.get("error", ""))) if k != "tools" else str(r.get(k, ""))
                                    for k in head) + " |" for r in rows]
        args.out.write_text("\n".join(lines) + "\n")
    return 0 if all(r["exit"] == 0 and r.get("refused") == 0 and r.get("replay") == "audit ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
