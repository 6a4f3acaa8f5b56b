"""Serving levers beyond plain flags, and their check against a vLLM's own flags, variables and fields."""
import json
from pathlib import Path

import pytest

from agent.world.serve_args import UnknownLever, check_levers, help_flags, levers, unknown_levers
from sandbox.base import split_serve_args as split_args
from agent.world.task import load_task
from sandbox.base import serve_argv
from tests.conftest import has_vllm

ROOT = Path(__file__).resolve().parents[2]
KNOWN_032 = json.loads((ROOT / "tests" / "data" / "levers-vllm-0.32.0.json").read_text())
KNOWN_032["flags"] = set(KNOWN_032["flags"])


def test_dotted_keys_become_one_json_flag_and_env_keys_variables():
    cli, env = split_args({"max_num_seqs": 8, "compilation_config.cudagraph_mode": "FULL",
                           "compilation_config.max_cudagraph_capture_size": 256, "block_size": None,
                           "env.VLLM_USE_V2_MODEL_RUNNER": "1", "env.VLLM_X": True, "env.VLLM_Y": None})
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_X": "1"}
    assert json.loads(cli["compilation_config"]) == {"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 256}
    from sandbox.base import ServerSpec
    argv = serve_argv(ServerSpec(name="x", source_tree=Path("/t"), model_dir=Path("/m"), engine_args=cli))
    assert argv[argv.index("--compilation-config") + 1] == cli["compilation_config"] and "--block-size" not in argv
    assert json.loads(split_args({"compilation_config": '{"level": 3}', "compilation_config.mode": 1})[0]
                      ["compilation_config"]) == {"level": 3, "mode": 1}


def test_help_text_flags_are_read_with_their_negations():
    text = "  --async-scheduling, --no-async-scheduling\n  --block-size BLOCK_SIZE  (default: None)\n"
    assert help_flags(text) == {"async-scheduling", "no-async-scheduling", "block-size"}


def test_the_e2b_levers_against_vllm_0_32():
    task = load_task(ROOT / "tasks" / "gemma4-e2b.yaml")
    assert {"compilation_config.cudagraph_mode", "env.VLLM_USE_V2_MODEL_RUNNER", "performance_mode"} <= levers(task)
    problems = unknown_levers(levers(task), KNOWN_032)
    assert [p.split(":")[0] for p in problems] == ["max_num_partial_prefills"]  # a 0.26 flag that 0.32 dropped
    assert unknown_levers({"compilation_config.no_such_field", "env.VLLM_NOT_A_VARIABLE"}, KNOWN_032) == [
        "compilation_config.no_such_field: --compilation-config has no field no_such_field",
        "env.VLLM_NOT_A_VARIABLE: vLLM reads no environment variable VLLM_NOT_A_VARIABLE"]


@pytest.mark.skipif(not has_vllm(), reason="vLLM is not installed")
@pytest.mark.slow  # not `vllm`: it imports the installed vLLM in a subprocess and serves nothing (wait-bound tier)
def test_the_installed_vllm_is_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_CACHE", str(tmp_path))
    check_levers(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"), "0.32.0")
    with pytest.raises(UnknownLever, match="max_num_partial_prefills"):
        check_levers(load_task(ROOT / "tasks" / "gemma4-e2b.yaml"), "0.32.0")
