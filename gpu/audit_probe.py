"""Which configuration's greedy tokens are right? The reference (batch-invariant, TRITON_ATTN, eager)
and the production server (the task's engine args) each generate for the same prompts under load;
every output is scored teacher-forced on both servers (vLLM prompt_logprobs) and, after the servers
stop, on the Hugging Face forward of the same checkpoint.

    python3 gpu/audit_probe.py tasks/gemma4-e2b.yaml probe.json [--prompts 64] [--hf 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.world.checkpoint import prepare_model  # noqa: E402
from agent.stages.completions import complete_all, draw_prompts  # noqa: E402
from agent.world.task import load_task  # noqa: E402
from agent.stages.token_audit import Output, deficits_of, score_all  # noqa: E402
from sandbox.base import Endpoint, serve_argv  # noqa: E402
from sandbox.base import ServerSpec  # noqa: E402


class Probe:
    def __init__(self, name: str, port: int):
        self.name, self.endpoint = name, Endpoint(f"http://127.0.0.1:{port}")

    def client(self, timeout: float):
        return self.endpoint.client(timeout)


def start(task, model: Path, name: str, port: int, parity: bool, log: Path, extra: dict) -> subprocess.Popen:
    env = {**os.environ, **task.engine.env, **(task.parity.env if parity else {})}
    args = {"dtype": task.model.dtype, "max_model_len": task.model.max_model_len, **task.engine.args,
            **(task.parity.args if parity else extra)}
    spec = ServerSpec(name=name, source_tree=Path("."), model_dir=model, engine_args=args)
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *serve_argv(spec), "--port", str(port)]
    return subprocess.Popen(argv, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def wait(probes: list[Probe], processes: list[subprocess.Popen], timeout_s: float = 900) -> None:
    import httpx

    deadline = time.time() + timeout_s
    for probe, process in zip(probes, processes):
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{probe.name} exited at start")
            try:
                if httpx.get(probe.endpoint.base_url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit(f"{probe.name} not healthy")
            time.sleep(2)


def summary(outputs: list[Output], scored) -> dict:
    values, positions, agree = [], 0, 0
    for scores in scored:
        for p in scores:
            positions += 1
            agree += p.token == p.top1
            if p.token != p.top1:
                values.append(p.deficit)
    return {"top1_agreement": round(agree / positions, 4), **deficits_of(values, positions).model_dump()}


def hf_scores(model_dir: Path, outputs: list[Output]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    values, positions, agree = [], 0, 0
    with torch.no_grad():
        for o in outputs:
            ids = torch.tensor([o.prompt + o.tokens], device="cuda")
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            for j, token in enumerate(o.tokens):
                row = logprobs[len(o.prompt) + j - 1]
                positions += 1
                top = int(row.argmax())
                agree += top == token
                if top != token:
                    values.append(float(row[top] - row[token]))
    return {"top1_agreement": round(agree / positions, 4), **deficits_of(values, positions).model_dump()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hf", type=int, default=8)
    parser.add_argument("--production-args", type=json.loads, default={}, help="JSON engine args added to production")
    a = parser.parse_args()
    task = load_task(a.task)
    model = prepare_model(task).path
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    probes = [Probe("reference", 8100), Probe("production", 8101)]
    logs = a.out.parent
    processes = [start(task, model, "reference", 8100, True, logs / "probe-reference.log", {}),
                 start(task, model, "production", 8101, False, logs / "probe-production.log", a.production_args)]
    result: dict = {"model": str(model), "production_args": a.production_args}
    try:
        wait(probes, processes)
        prompts = draw_prompts(1, a.prompts, task.workload.input_len, vocab)
        outputs = {}
        for probe in probes:
            done = asyncio.run(complete_all(probe, prompts, a.tokens, None, 600))
            outputs[probe.name] = [Output(0, i, p, c.tokens) for i, (p, c) in enumerate(zip(prompts, done))]
        sequential = asyncio.run(complete_all(probes[1], prompts[:8], a.tokens, 1, 600))
        result["production_sequential_equals_batched"] = sum(
            c.tokens == o.tokens for c, o in zip(sequential, outputs["production"]))
        result["reference_equals_production"] = sum(
            x.tokens == y.tokens for x, y in zip(outputs["reference"], outputs["production"]))
        for maker, outs in outputs.items():
            for scorer in probes:
                scored = asyncio.run(score_all(scorer, outs, 64, 600))
                result[f"{maker}_outputs_on_{scorer.name}"] = summary(outs, scored)
                print(maker, "on", scorer.name, result[f"{maker}_outputs_on_{scorer.name}"], flush=True)
    finally:
        for process in processes:
            os.killpg(process.pid, 9)
            process.wait()
    if a.hf:
        time.sleep(5)
        for maker, outs in outputs.items():
            result[f"{maker}_outputs_on_hf"] = hf_scores(model, outs[:a.hf])
            print(maker, "on hf", result[f"{maker}_outputs_on_hf"], flush=True)
    a.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
