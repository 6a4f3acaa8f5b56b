from pathlib import Path

from agent.stages.parity import first_divergence
from agent.stages.completions import FIRST_REGULAR_TOKEN, draw_prompts
from agent.stages.surface import engine_args_violation, patch_paths, surface_violation
from agent.world.task import EditSurface

PATCHES = Path(__file__).parents[1] / "fixtures" / "patches"
SURFACE = EditSurface(include=["vllm/model_executor/*"], exclude=["vllm/model_executor/models/secret.py"])


def test_patch_paths_and_surface():
    numerics = (PATCHES / "02-mlp-numerics.patch").read_text()
    assert patch_paths(numerics) == ["vllm/model_executor/models/gemma4.py"]
    assert surface_violation(numerics, SURFACE) is None
    outside = (PATCHES / "01-outside-surface.patch").read_text()
    assert "outside the edit surface" in surface_violation(outside, SURFACE)


def test_surface_refuses_escapes_symlinks_and_exclusions():
    escape = "--- a/vllm/model_executor/../../etc/x\n+++ b/vllm/model_executor/../../etc/x\n"
    assert "inside the checkout" in surface_violation(escape, SURFACE)
    link = "diff --git a/vllm/model_executor/l b/vllm/model_executor/l\nnew file mode 120000\n"
    assert "symlinks" in surface_violation(link, SURFACE)
    excluded = "--- a/vllm/model_executor/models/secret.py\n+++ b/vllm/model_executor/models/secret.py\n"
    assert "excluded" in surface_violation(excluded, SURFACE)
    assert surface_violation("", SURFACE) is None


def test_engine_args_outside_the_allowed_list():
    assert engine_args_violation({"max_num_seqs": 8}, {"max_num_seqs": 4}, ["max_num_seqs"]) is None
    assert "seed" in engine_args_violation({"seed": 1}, {}, ["max_num_seqs"])


def test_first_divergence_names_prompt_and_position():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert first_divergence(ref, [[1, 2, 3, 4], [5, 6, 7, 8]], 4) is None
    d = first_divergence(ref, [[1, 2, 3, 4], [5, 6, 9, 8]], 4)
    assert (d.prompt_index, d.position, d.expected, d.got) == (1, 2, 7, 9)
    short = first_divergence(ref, [[1, 2, 3], [5, 6, 7, 8]], 4)
    assert (short.prompt_index, short.position, short.expected, short.got, short.got_len) == (0, 3, 4, None, 3)


def test_prompts_are_seeded_and_avoid_special_ids():
    a = draw_prompts(7, 4, 16, 4096)
    assert a == draw_prompts(7, 4, 16, 4096)
    assert a != draw_prompts(8, 4, 16, 4096)
    assert min(min(p) for p in a) >= FIRST_REGULAR_TOKEN and max(max(p) for p in a) < 4096
