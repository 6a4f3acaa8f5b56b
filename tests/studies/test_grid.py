"""Grid planning for `verify`: which cells run, why the others are skipped, and what the servers need."""
import pytest

from agent.studies.grid import GIB, GridError, context_limit, cpu_kv_space_gib, kv_bytes_per_token, parse_lens, plan_grid

GEMMA_TINY = {"num_hidden_layers": 8, "num_kv_shared_layers": 4, "num_key_value_heads": 1, "head_dim": 64,
              "global_head_dim": 128, "max_position_embeddings": 4096,
              "layer_types": ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
              + ["full_attention"]}


def plan(**overrides):
    args = dict(input_lens=[512, 2048, 8192], output_lens=[128, 256], concurrency=[1, 16, 64, 256],
                model_limit=8192, kv_per_token=1024, kv_budget_bytes=None, max_num_seqs=None)
    return plan_grid(**{**args, **overrides})


def test_a_cell_exactly_at_the_limit_is_skipped_since_the_audit_scores_one_position_more():
    p = plan(input_lens=[4064, 4063], output_lens=[32], concurrency=[1], model_limit=4096)
    assert [(c.input_len, bool(c.skipped)) for c in p.cells] == [(4063, False), (4064, True)]
    assert p.max_model_len == 4096


def test_every_cell_is_kept_in_order_and_too_long_ones_are_skipped_with_the_limit():
    p = plan()
    assert len(p.cells) == 24
    assert [(c.input_len, c.output_len, c.concurrency) for c in p.cells[:5]] == [
        (512, 128, 1), (512, 128, 16), (512, 128, 64), (512, 128, 256), (512, 256, 1)]
    skipped = [c for c in p.cells if c.skipped]
    assert {(c.input_len, c.output_len) for c in skipped} == {(8192, 128), (8192, 256)} and len(skipped) == 8
    assert skipped[0].skipped == ("input + output + 1 scoring token = 8321 tokens exceeds the model's "
                                  "max_position_embeddings 8192")
    assert p.max_model_len == 2048 + 256 + 1


def test_context_length_and_kv_come_from_the_largest_runnable_cell():
    p = plan(model_limit=None, kv_budget_bytes=64 * GIB, max_num_seqs=64)
    assert p.max_model_len == 8192 + 256 + 1 and not [c for c in p.cells if c.skipped]
    assert p.kv_cache_bytes == 64 * (8192 + 256 + 1) * 1024  # 256 in flight, but at most 64 sequences resident
    assert p.notes == []


def test_a_cell_whose_one_sequence_exceeds_the_kv_budget_is_skipped_and_the_largest_is_capped():
    p = plan(model_limit=None, kv_per_token=256 * 1024, kv_budget_bytes=1 * GIB)
    skipped = [c for c in p.cells if c.skipped]
    assert {c.input_len for c in skipped} == {8192}
    assert "needs 2.03 GiB of KV cache, more than the 1.00 GiB available" in skipped[0].skipped
    assert p.max_model_len == 2305 and p.kv_cache_bytes == 1 * GIB and "exceeds the 1.00 GiB budget" in p.notes[0]
    assert cpu_kv_space_gib(p, 0.5) == 1 and cpu_kv_space_gib(p, 3) == 3


def test_a_grid_with_no_runnable_cell_plans_nothing():
    p = plan(input_lens=[9000], model_limit=4096)
    assert p.runnable == [] and p.max_model_len == 0 and all("4096" in c.skipped for c in p.cells)


def test_kv_per_token_counts_only_the_layers_that_own_a_cache():
    assert kv_bytes_per_token(GEMMA_TINY, "bfloat16") == 2 * (3 * 64 + 128) * 2
    assert kv_bytes_per_token({"text_config": GEMMA_TINY}, "float32") == 2 * (3 * 64 + 128) * 4
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}, "half") \
        == 2 * 2 * 4 * 64 * 2
    assert context_limit({"text_config": {"max_position_embeddings": 32768}}) == 32768 and context_limit({}) is None


@pytest.mark.parametrize("text", ["", "512,,2048", "0", "-4", "12k", "1.5"])
def test_bad_grid_values_are_one_line_errors(text):
    with pytest.raises(GridError, match=r"^--input-lens .*positive integers"):
        parse_lens(text, "input-lens")


def test_grid_values_are_sorted_and_distinct():
    assert parse_lens(" 8192,512, 512 ", "input-lens") == [512, 8192]
    with pytest.raises(GridError, match="--concurrency"):
        plan(concurrency=[])


def test_the_task_verify_section_has_defaults_and_rejects_bad_values():
    from pathlib import Path

    from agent.world.task import TaskError, load_task, with_settings

    tasks = Path(__file__).resolve().parents[2] / "tasks"
    assert load_task(tasks / "gemma4-e2b.yaml").verify.concurrency == [1, 16, 64, 256]
    cpu = load_task(tasks / "gemma4-tiny-cpu.yaml")
    assert cpu.verify.input_lens == [64, 256] and cpu.verify.repetitions == 3
    with pytest.raises(TaskError, match="verify.concurrency"):
        with_settings(cpu, ["verify.concurrency=[1, 0]"])
    with pytest.raises(TaskError, match="verify.input_lens"):
        with_settings(cpu, ["verify.input_lens=[]"])
