"""Honest real vLLM at max_num_seqs 4 and 32: how many requests the harness's client sees streaming at once
(Sample.decoding_at_once, agent/stages/stats.py moved_by_code). python3 benchmarks/noise-checks/decoding_probe.py
from the project root. 2026-12-05, 2-core AMD EPYC, quiet: 4 in each of 6 passes at max_num_seqs 4 and 32 in each of 6
at 32, both as the momentary peak and as the level held nine tenths of the time."""
import asyncio
import random
import sys
import uuid
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from agent.stages.bench import timed_pass
from agent.stages.load import LoadClient
from sandbox.local import LocalSandbox
from tests.real_vllm import probe_tree, real_vllm_spec


if __name__ == "__main__":
    base, tree = probe_tree("decoding-probe")
    for seqs in (4, 32):
        run_dir = base / f"run-{uuid.uuid4().hex[:6]}"; run_dir.mkdir()
        spec = real_vllm_spec(tree, f"probe-{seqs}")
        spec = spec.model_copy(update={"engine_args": {**spec.engine_args, "max_num_seqs": seqs}})
        server = LocalSandbox(None, run_dir).start(spec)
        try:
            rng = random.Random(0)
            prompts = [[rng.randrange(3, 4000) for _ in range(64)] for _ in range(32)]
            seen = []
            with LoadClient(1) as load:
                for rep in range(6):
                    p = asyncio.run(timed_pass(load, server, "incumbent", rep, prompts, 32, None, 120))
                    seen.append((p.sample.decoding_at_once, p.sample.max_num_seqs, round(p.sample.seconds, 2)))
            print("max_num_seqs", seqs, "passes (decoding_at_once, declared, s):", seen, flush=True)
        finally:
            server.stop()
