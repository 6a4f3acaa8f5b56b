"""The verify grid, planned before any server starts: which cells can run, and the context length and
KV cache the servers need for the largest of them. Pure: no I/O beyond what the caller passes in."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from traces.errors import NightshiftError

GIB = 1 << 30
SCORING_TOKENS = 1
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "auto": 2, "fp8": 1}


class GridError(NightshiftError, ValueError):
    stage = "verify"


@dataclass(frozen=True)
class Cell:
    input_len: int
    output_len: int
    concurrency: int
    skipped: str = ""
    """Why the cell cannot run (empty: it runs)."""

    @property
    def tokens(self) -> int:
        """Context the cell needs: input + output, and one position more for the audit's scoring request
        (the prompt and output sent back with one token to generate)."""
        return self.input_len + self.output_len + SCORING_TOKENS

    @property
    def key(self) -> str:
        return f"in{self.input_len}-out{self.output_len}-c{self.concurrency}"


@dataclass
class GridPlan:
    cells: list[Cell]
    max_model_len: int
    """The longest runnable cell's context (input + output + the scoring token)."""
    kv_cache_bytes: int | None
    """KV cache the largest runnable cell uses with all its sequences resident (capped at the budget)."""
    kv_bytes_per_token: int
    notes: list[str] = field(default_factory=list)

    @property
    def runnable(self) -> list[Cell]:
        return [c for c in self.cells if not c.skipped]


def parse_lens(text: str, name: str) -> list[int]:
    """`512,2048,8192` as sorted distinct positive ints; GridError naming the option otherwise."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) <= 0:
            raise GridError(f"--{name} {text!r}: expected positive integers separated by commas")
        values.append(int(part))
    return sorted(set(values))


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def context_limit(config: dict) -> int | None:
    """The model's own limit on input + output tokens (max_position_embeddings), if its config names one."""
    c = text_config(config)
    value = c.get("max_position_embeddings") or c.get("n_positions") or c.get("max_sequence_length")
    return int(value) if value else None


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """K and V of one token over the layers that own a cache (KV-shared layers reuse another's); a full
    attention layer counts its own head size where the config gives one. Sliding layers are counted whole:
    an upper bound."""
    c = text_config(config)
    layers = int(c.get("num_hidden_layers", 0))
    owning = layers - int(c.get("num_kv_shared_layers") or 0)
    heads = int(c.get("num_key_value_heads") or c.get("num_attention_heads") or 1)
    head_dim = int(c.get("head_dim") or c.get("hidden_size", 0) // max(1, int(c.get("num_attention_heads") or 1)))
    types = c.get("layer_types") or ["full_attention"] * layers
    width = 0
    for kind in types[:owning]:
        if kind == "full_attention" and c.get("global_head_dim"):
            width += int(c.get("num_global_key_value_heads") or heads) * int(c["global_head_dim"])
        else:
            width += heads * head_dim
    return 2 * width * DTYPE_BYTES.get(str(dtype), 2)


def plan_grid(input_lens: list[int], output_lens: list[int], concurrency: list[int], *, model_limit: int | None,
              kv_per_token: int, kv_budget_bytes: int | None, max_num_seqs: int | None) -> GridPlan:
    """Every cell of input x output x concurrency, in that order; one that cannot run is kept, skipped with why.

    A cell cannot run if its input + output exceeds the model's limit, or if one of its sequences needs more
    KV cache than the budget. The servers get the longest runnable cell's length and the KV cache of the
    largest cell with min(concurrency, max_num_seqs) sequences resident, at most the budget."""
    for name, values in (("input-lens", input_lens), ("output-lens", output_lens), ("concurrency", concurrency)):
        if not values or any(int(v) <= 0 for v in values):
            raise GridError(f"--{name}: expected at least one positive integer, got {values}")
    cells = []
    for i, o, c in itertools.product(sorted(set(input_lens)), sorted(set(output_lens)), sorted(set(concurrency))):
        reason, need = "", Cell(i, o, c).tokens
        if model_limit is not None and need > model_limit:
            reason = (f"input + output + 1 scoring token = {need} tokens exceeds the model's max_position_embeddings "
                      f"{model_limit}")
        elif kv_budget_bytes is not None and need * kv_per_token > kv_budget_bytes:
            reason = (f"one sequence of {need} tokens needs {need * kv_per_token / GIB:.2f} GiB of KV cache, "
                      f"more than the {kv_budget_bytes / GIB:.2f} GiB available")
        cells.append(Cell(i, o, c, reason))
    runnable = [c for c in cells if not c.skipped]
    if not runnable:
        return GridPlan(cells, 0, None, kv_per_token, ["no cell of the grid can run"])
    longest = max(c.tokens for c in runnable)
    resident = max(min(c.concurrency, max_num_seqs or c.concurrency) * c.tokens for c in runnable)
    kv = resident * kv_per_token
    notes = []
    if kv_budget_bytes is not None and kv > kv_budget_bytes:
        notes.append(f"the largest cell's {kv / GIB:.2f} GiB of KV cache exceeds the {kv_budget_bytes / GIB:.2f} GiB "
                     "budget: some of its requests wait for cache")
        kv = kv_budget_bytes
    return GridPlan(cells, longest, kv if kv_budget_bytes is not None else None, kv_per_token, notes)


def cpu_kv_space_gib(plan: GridPlan, configured_gib: float) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB) for the plan: at least what the task configures."""
    need = math.ceil((plan.kv_cache_bytes or 0) / GIB)
    return max(1, int(math.ceil(configured_gib)), need)
