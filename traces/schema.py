"""The trace event schema: every object that flows through the loop, in order.

task -> Proposal -> PatchApplied -> Build -> ParityReport -> BenchReport -> TokenAudit -> Decision -> Commit

Each is one pydantic model and one line of `trace.jsonl`. A rejection at any stage is a
`Decision` whose `stage` names where it happened.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

FORMAT_VERSION = 1

Stage = Literal[
    "proposal", "surface", "apply", "build", "start", "parity", "benchmark", "liveness", "audit", "decision",
]
"""The stages in the order a candidate meets them (the loop checks liveness on the benchmarked server, after its
passes); the funnel, the report and the proposers' statistics read this order."""
Verdict = Literal["keep", "discard", "crash", "timeout"]


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CheckpointWritten(BaseModel):
    """How a seeded synthetic checkpoint was written (agent/world/checkpoint.py): the same seed gives other weights
    on another device, dtype or library version, so two hosts whose sha256 differ name the cause here."""

    sha256: str = ""
    seed: int | None = None
    recipe: str = ""
    device: str = ""
    """`cuda` or `cpu`: where the seeded initialisation ran."""
    device_name: str = ""
    """The GPU's name (torch.cuda.get_device_name), or the CPU's machine type."""
    dtype: str = ""
    torch: str = ""
    cuda: str = ""
    """The CUDA torch was built with ("" on a CPU build)."""
    transformers: str = ""
    safetensors: str = ""
    numpy: str = ""

    CAUSES: ClassVar[tuple[str, ...]] = ("device", "device_name", "dtype", "torch", "cuda", "transformers",
                                         "safetensors", "numpy", "seed", "recipe")

    def describe(self) -> str:
        where = self.device + (f" ({self.device_name})" if self.device_name else "")
        return (f"sha256 {self.sha256[:16]}, seed {self.seed}, written on {where or '?'} in {self.dtype or '?'} "
                f"with torch {self.torch or '?'}" + (f" (CUDA {self.cuda})" if self.cuda else "")
                + f", transformers {self.transformers or '?'}, safetensors {self.safetensors or '?'}, "
                  f"numpy {self.numpy or '?'}")

    def differences(self, other: "CheckpointWritten") -> list[str]:
        """`name: ours -> theirs` for each way of writing that differs (unknown on either side: not compared)."""
        return [f"{name} {getattr(self, name)} -> {getattr(other, name)}" for name in self.CAUSES
                if getattr(self, name) not in ("", None) and getattr(other, name) not in ("", None)
                and getattr(self, name) != getattr(other, name)]


class RunStarted(Event):
    kind: Literal["run_started"] = "run_started"
    format_version: int = FORMAT_VERSION
    run_id: str
    nightshift_version: str
    vllm_version: str
    torch_version: str
    python_version: str
    platform: str
    checkout: str
    base_commit: str
    branch: str
    model_sha256: str
    model_margins: dict[str, float] | None = None
    model_written: CheckpointWritten | None = None
    """How the seeded synthetic checkpoint was written (None: real weights, or a run from before it was recorded)."""
    task: dict[str, Any]
    host: str = ""
    run_dir: str = ""
    cache: str = ""
    """Where the run started (its NIGHTSHIFT_CACHE): a resumed run that moved records the way from here."""
    relaxed: list[dict[str, Any]] | None = None
    """The checks the task loosens (agent/run/relaxed.py): each setting, its value, its default and the task file's."""


class SelfParity(Event):
    """Baseline against a second, independently started baseline: the setup must be deterministic."""

    kind: Literal["self_parity"] = "self_parity"
    ok: bool
    prompts: int
    identical: int
    regime: str
    detail: str = ""
    margins: dict[str, float] | None = None
    """Top-1 minus top-2 log-probability (nats) of the reference server's greedy steps."""
    margins_error: str = ""


class Proposal(Event):
    kind: Literal["proposal"] = "proposal"
    candidate: int
    proposer: str
    summary: str
    patch: str = ""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    meta: dict[str, Any] = Field(default_factory=dict)


class PatchApplied(Event):
    kind: Literal["patch_applied"] = "patch_applied"
    candidate: int
    worktree: str
    parent_commit: str
    files: list[str]
    engine_args: dict[str, Any]


class Build(Event):
    kind: Literal["build"] = "build"
    candidate: int
    tree: str
    source_sha256: str
    compiled_from: str
    seconds: float


class Divergence(BaseModel):
    prompt_index: int
    position: int
    expected: int | None
    got: int | None
    expected_len: int
    got_len: int


class LongRequest(BaseModel):
    """One of parity's long requests (agent/stages/parity.py check_long): its shape, drawn per check."""

    input_len: int
    max_tokens: int
    production: bool = False
    """EOS honoured and `stop_token_ids` set (drawn from the reference's own answer), as production requests are;
    otherwise EOS is ignored and exactly max_tokens come back."""
    stop_token_ids: list[int] = Field(default_factory=list)


class ParityReport(Event):
    kind: Literal["parity"] = "parity"
    candidate: int
    ok: bool
    regime: str
    prompts: int
    tokens_per_prompt: int
    digest: str
    divergence: Divergence | None = None
    long_seed: int | None = None
    """The seed the long requests' shapes and prompts were drawn with (absent: a trace from before them)."""
    long_reach: int | None = None
    """Positions (prompt plus output) the longest request reached: the benchmark's and verify grid's longest, up to
    max_model_len."""
    long_requests: list[LongRequest] = Field(default_factory=list)
    long_divergence: Divergence | None = None
    """The first long request whose tokens or finish reason differ; its position counts from the prompt's start."""


class GpuPass(BaseModel):
    """NVML readings over one pass, per GPU the server uses (agent/world/gpu_state.py)."""

    gpus: list[int]
    readings: int
    sm_clock_mhz_min: int
    sm_clock_mhz_max: int
    mem_clock_mhz_min: int
    temperature_c_max: int
    power_w_mean: float
    utilization_mean: float
    throttle_reasons: list[str] = Field(default_factory=list)
    neighbour_utilization_max: float | None = None
    """The highest SM utilisation of a process on these GPUs that is not the measured server's."""


class Sample(BaseModel):
    """One timed pass of the workload against one server, measured by the harness."""

    role: Literal["incumbent", "candidate"]
    repetition: int
    seconds: float
    input_tokens: int
    output_tokens: int
    total_tokens_per_s: float
    output_tokens_per_s: float
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p99: float | None = None
    client_cpu_s: float | None = None
    """CPU time the harness's load client spent on the pass, all its processes together."""
    client_busy: float | None = None
    """The busiest client process's CPU time over its wall time; near 1, the client set the pace."""
    outputs_sha256: str | None = None
    """sha256 of the pass's prompts and returned token ids (kept under outputs/ in the run folder)."""
    steady_seconds: float | None = None
    """The steady-state window: from the first moment the target concurrency was in flight to the moment
    in-flight fell below it at the drain (agent/stages/load.py)."""
    steady_total_tokens_per_s: float | None = None
    steady_output_tokens_per_s: float | None = None
    gpu: GpuPass | None = None
    flags: list[str] = Field(default_factory=list)
    """Why the pass may not measure the server alone: `throttled: ...`, `neighbour busy: ...`."""
    neighbour_cpu_s: float | None = None
    """CPU time the other side's server (idle, waiting its turn) used during this pass, from /proc; None where
    the harness cannot see its processes."""
    neighbour_held: bool | None = None
    """Whether the other side's server was frozen for this pass (benchmark.hold_idle); None in older traces."""
    settle_s: float | None = None
    """Seconds the harness waited before the pass for both servers to go quiet (benchmark.settle_s)."""
    engine_steps: int | None = None
    """Engine steps the measured server ran during the pass: the growth of its Prometheus histogram
    `vllm:iteration_tokens_total`'s _count, read before and after the pass; None where the server has no such
    metric (older vLLM, stand-ins). The server reports it: a diagnostic, never read by the decision."""
    step_tokens: int | None = None
    """Tokens (prompt and output) those steps processed: the same histogram's _sum; step_tokens / engine_steps
    is the pass's batch occupancy (agent/stages/stats.py tokens_per_step, off_schedule)."""
    max_num_seqs: int | None = None
    """The measured server's declared engine argument max_num_seqs (None: not set, vLLM's default)."""
    decoding_at_once: int | None = None
    """How many requests the harness's client saw streaming at once (first token arrived, last not yet) for all but a
    tenth of the pass's streaming time: what the server did with max_num_seqs, seen from outside it
    (agent/stages/load.py, agent/stages/stats.py moved_by_code)."""
    server_cpu_s: float | None = None
    """CPU time the measured server's processes used during the pass, from /proc (None where not visible)."""
    machine_cpu_s: float | None = None
    """CPU time every process of the machine used during the pass (/proc/stat, all cores); what is left after
    the measured server, the idle side and the load client is work the harness did not ask for (`foreign`)."""
    steal_s: float | None = None
    """CPU time the hypervisor gave to others while this machine wanted to run, during the pass (/proc/stat)."""
    major_faults: int | None = None
    """Page faults of the measured server that read from disk during the pass (code or weights evicted earlier)."""
    server_nice: int | None = None
    """The measured server's niceness during the pass (its first process, from /proc; sandbox.nice), None where
    not visible."""
    client_nice: int | None = None
    """The niceness of the harness's client thread during the pass (sandbox/priority.py `raised`)."""


class Liveness(BaseModel):
    patched_files: list[str]
    imported_patched: list[str]
    imported_vllm_modules: int
    imported_sha256: str


class SampleTaken(Event):
    """One timed pass, written as soon as it is measured: a run cut short keeps its measurements."""

    kind: Literal["sample"] = "sample"
    candidate: int
    sample: Sample
    confirmation: int = 0


class Look(BaseModel):
    pairs: int
    spent_alpha: float
    """Error spent by this look, cumulative (the spending function at pairs / planned maximum)."""
    z_boundary: float
    boundary: float
    """The t boundary used: accept once the statistic exceeds it."""
    futility: float | None
    """Stop and discard once the statistic falls below minus this (none at the last planned look)."""
    statistic: float
    df: int


class Sequential(BaseModel):
    spending: str = "lan-demets-obrien-fleming"
    estimator: str = "mean-t"
    """Which location and interval each look used (agent/stages/stats.py ESTIMATORS); traces written before
    it was recorded were decided by the mean with the order term and a t interval, "mean-t"."""
    alpha: float
    """One-sided: (1 - confidence) / 2, the chance of accepting at a true speedup of min_speedup."""
    planned: list[int]
    order_term: bool = True
    looks: list[Look]
    stopped: Literal["efficacy", "futility", "max"] | None
    """None: the planned looks so far neither crossed a boundary nor reached the maximum."""


class BenchReport(Event):
    kind: Literal["benchmark"] = "benchmark"
    candidate: int
    metric: str
    samples: list[Sample]
    speedup: float
    ci_low: float
    ci_high: float
    confidence: float
    p_value: float
    liveness: Liveness | None = None
    output_check: str
    confirmation: int = 0
    """0: the first benchmark; k: the k-th independent confirmation of a candidate that passed."""
    sequential: Sequential | None = None
    """The stopping rule's looks (agent/stages/stats.py); absent in traces written before it existed."""


class Violation(BaseModel):
    repetition: int
    """The timed pass (repetition) of the benchmark."""
    request: int
    position: int
    """The generated position (0 = the first output token)."""
    returned: int
    expected: int
    """The reference's top-1 token there."""
    deficit_nats: float


class Deficits(BaseModel):
    """How far below the reference's top-1 the returned tokens lay, over the positions that were not top-1."""

    positions: int
    non_top1: int
    max: float
    p50: float
    p90: float
    p99: float


class AuditSide(BaseModel):
    """One side's audited outputs: how often, and how far, its tokens left the reference's top-1."""

    requests: int
    tokens: int
    non_top1: int
    per_request: list[int]
    """Positions not the reference's top-1, per audited request (in the order drawn)."""
    request_tokens: list[int]
    """Positions audited per request."""
    values: list[float]
    """Every non-top-1 position's deficit (nats, rounded to 1e-4), in order."""


class AuditVerdict(BaseModel):
    """The audit rule's decision for one candidate benchmark (agent/stages/token_audit.py `judge`): a hard bound on any
    position, then the candidate's rate of non-top-1 tokens against the honest rate measured beside it."""

    passed: bool
    test: Literal["pass", "hard_bound", "rate", "concentration", "magnitude", "invalid"]
    """The first part of the rule that rejected, or `pass`; `invalid`: outputs the reference cannot score (ids outside
    the vocabulary, a wrong count of tokens, a malformed answer, or tokens the reference refused while it answered
    the harness's own prompt), listed in the audit's `invalid`."""
    reason: str
    hard_bound_nats: float
    rate_ratio: float
    """The candidate's non-top-1 rate may be up to this multiple of the reference rate."""
    alpha: float
    reference: Literal["control", "calibration", "none"]
    """Whose rate is the reference: the larger of the control's (the incumbent in the same benchmark) and the
    run's A/A (calibration)."""
    reference_non_top1: int
    reference_tokens: int
    rate_p_value: float
    """One-sided, exact: P(X >= candidate's count) for X ~ Binomial(both counts, rate_ratio-weighted share)."""
    calibration_seed: int | None = None
    """The sample_seed of the A/A audit whose rate was considered (the trace's TokenAudit with calibration)."""
    concentration_p_value: float
    """Bonferroni over requests: the most non-top-1 positions in one request against Binomial(its tokens,
    rate_ratio x the reference rate, floored at one position per request)."""
    magnitude_p_value: float | None = None
    """Exact, under exchangeability with the honest deficits (the control's and the A/A's, pooled): P(the j largest
    of all deficits are all the candidate's), j its deficits above every honest one. None: a trace from before it."""
    honest_seeds: list[int] | None = None
    """The sample_seeds of the run's earlier audits whose controls were pooled into the magnitude test's honest
    deficits beside this audit's control and A/A: the base tree's own outputs, measured beside candidates while the
    incumbent served the base commit, their control verdicts passed (agent/stages/token_audit.py `base_controls`).
    None: a trace from before the pool (the control and the A/A alone)."""


class InvalidOutput(BaseModel):
    """One output the reference cannot score, found before it was sent (`vocabulary`, `count`, `malformed`) or
    refused by a reference that answered the harness's own prompt right after (`refused`)."""

    side: Literal["candidate", "control"] = "candidate"
    repetition: int
    request: int
    kind: Literal["vocabulary", "count", "malformed", "refused"]
    detail: str
    position: int | None = None
    token: int | None = None
    """The offending id (`vocabulary`)."""
    limit: int | None = None
    """The bound it broke: the model's vocab_size (`vocabulary`) or the tokens asked for (`count`)."""


class TokenAudit(Event):
    """The benchmark's own outputs, scored teacher-forced on the trusted reference (agent/stages/token_audit.py).
    With `calibration`, the baseline's outputs under the benchmark load (the A/A that calibrates the tolerance)."""

    kind: Literal["audit"] = "audit"
    candidate: int
    confirmation: int = 0
    calibration: bool = False
    requests: int
    of_requests: int
    tokens: int
    tolerance_nats: float
    """The hard bound (audit.hard_bound_nats): a position further than this below the top-1 is a violation."""
    deficits: Deficits
    violation_count: int
    violations: list[Violation] = Field(default_factory=list)
    """The first violations (at most 20)."""
    sample_seed: int
    """Drawn after the passes ran; recorded so the sample can be checked."""
    seconds: float
    side: AuditSide | None = None
    """This audit's own outputs in full (absent in traces written before the rate rule)."""
    control: AuditSide | None = None
    """The incumbent's outputs of the same benchmark, drawn and scored the same way."""
    verdict: AuditVerdict | None = None
    """The rule's decision; absent on the A/A and in traces written before the rate rule, whose verdict is
    `violation_count == 0` against `tolerance_nats`."""
    invalid: list[InvalidOutput] = Field(default_factory=list)
    """Outputs the reference cannot score (the first 20 per side): a candidate's reject it with test `invalid`, the
    control's flag the incumbent."""
    invalid_count: int = 0
    control_verdict: AuditVerdict | None = None
    """The incumbent's outputs of this benchmark (the control) judged by the same rule against the run's A/A alone.
    Failed, the control is not a reference for the candidate, and the incumbent is audited again on fresh prompts
    (agent/run/recheck.py). Absent in traces written before the incumbent was checked."""
    incumbent: bool = False
    """The incumbent's own audit on fresh prompts, its verdict against the A/A: after a flagged control
    (`candidate` is the candidate whose benchmark flagged it), or the branch head at the end of a run (`candidate`
    0). `commit` names the commit it served; in a candidate's audit, the commit its control (the incumbent) served
    ('' in traces written before)."""
    commit: str = ""


class Decision(Event):
    kind: Literal["decision"] = "decision"
    candidate: int
    verdict: Verdict
    stage: Stage
    reason: str
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None


class Commit(Event):
    kind: Literal["commit"] = "commit"
    candidate: int
    branch: str
    commit: str
    decision_sha256: str


class LlmCall(Event):
    kind: Literal["llm_call"] = "llm_call"
    candidate: int
    model: str
    params: dict[str, Any]
    messages: list[dict[str, Any]]
    response: str | None
    finish_reason: str | None
    usage: dict[str, int] = Field(default_factory=dict)
    cost_usd: float = 0.0
    latency_s: float
    error: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    """The tool calls of the answer, each {id, name, arguments} (`arguments` as the model sent it, a string)."""
    message: dict[str, Any] | None = None
    """The assistant message as the endpoint streamed it, provider fields included (e.g. a tool call's
    `extra_content`), which the next turn sends back verbatim; None in traces written before it was kept."""
    prefix: int = 0
    """How many of the request's messages are the previous `llm_call`'s (its request as rebuilt); `messages` holds
    only those after them. 0: `messages` is the whole request (every trace written before deltas)."""
    elided: list[int] = Field(default_factory=list)
    """Indexes among the `prefix` messages whose content was replaced by the elision placeholder since the previous
    call (agent/proposers/tools.py ELIDED)."""


class ToolCall(Event):
    """One tool call of the LLM proposer's conversation and what the harness answered (agent/proposers/tools.py)."""

    kind: Literal["tool_call"] = "tool_call"
    candidate: int
    call_id: str
    name: str
    arguments: str
    result: str
    ok: bool
    """False for a call the harness refused (bad arguments, a path outside the tree) or a rejected `propose`."""


class NotebookEntry(Event):
    """The lab notebook: what one LLM candidate tried and what came of it (agent/proposers/notebook.py)."""

    kind: Literal["notebook"] = "notebook"
    candidate: int
    summary: str
    """One paragraph: hypothesis, files, stage reached, speedup with its interval, what was learned."""
    hypothesis: str = ""
    files: list[str] = Field(default_factory=list)
    verdict: str = ""
    stage: str = ""
    speedup: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    learned: str = ""
    """The outcome as the harness states it (stage, numbers); what it teaches is the model's `reflection`."""
    divergence: str = ""
    """From a parity or audit failure: where the tokens diverged."""
    reflection: str = ""
    """What the candidate's result teaches, written by the model in a later turn (propose's `reflection`); an entry
    written again with it replaces the earlier one of the same candidate."""


class ProposalInvalid(Event):
    kind: Literal["proposal_invalid"] = "proposal_invalid"
    candidate: int
    reason: str


class ErrorSpent(Event):
    """One candidate's share of the night's error budget (acceptance.night_alpha), written before its benchmark so
    that a resumed run goes on counting from the trace (agent/run/budget.py); replay re-derives it."""

    kind: Literal["error_spent"] = "error_spent"
    candidate: int
    index: int
    """1 for the first measurement of the run, counting every candidate's first benchmark, resumed runs included."""
    alpha: float
    """The one-sided level this candidate is tested at: night_alpha x 6 / (pi index)^2."""
    spent: float
    """The budget spent through this candidate; never above night_alpha."""
    night_alpha: float
    confidence: float
    """The interval's level its benchmark used: 1 - 2 alpha."""


class NoiseFloor(Event):
    """The A/A before the first candidate: the baseline's production server against an independently started
    copy of itself, interleaved as a candidate would be (agent/stages/noise.py)."""

    kind: Literal["noise_floor"] = "noise_floor"
    candidate: int = 0
    metric: str
    samples: list[Sample]
    cv_incumbent: float
    cv_peer: float
    """Coefficient of variation of each server's passes."""
    log_ratio_sd: float
    """SD of the per-pair log ratios, the pair order taken out."""
    speedup: float
    ci_low: float
    ci_high: float
    confidence: float
    repetitions: int
    mde_speedup: float
    """The smallest speedup over the incumbent that `repetitions` pairs detect with probability `power`
    (against no change, at the task's confidence)."""
    max_repetitions: int | None = None
    mde_speedup_max: float | None = None
    power: float
    pairs_needed: int | None = None
    """Pairs at which the MDE would reach acceptance.min_speedup."""
    warning: str = ""


class Moved(BaseModel):
    """Where a resumed run was last (its run_started record, the last `moved`, or the pack's manifest) and where
    it goes on: the host, the run folder, the vLLM checkout holding its branch, and NIGHTSHIFT_CACHE."""

    from_host: str = ""
    from_run_dir: str = ""
    from_checkout: str = ""
    from_cache: str = ""
    to_host: str
    to_run_dir: str
    to_checkout: str
    to_cache: str
    pack: str = ""
    """The pack (`nightshift pack`) it was resumed from, and its sha256 ("": a folder)."""
    pack_sha256: str = ""
    packed_live: bool = False
    """The pack was taken while its harness still ran: that harness went on without this continuation."""
    queue: str = ""
    """A queue run's patch folder here: the recorded one, the same place in this project, or the pack's copy in the
    run folder (`queued-patches`) where neither exists."""


class Resumed(Event):
    """The run continues after its harness was killed (`nightshift run --resume`, agent/run/resume.py): where the
    trace stood, what a torn last line held (cut off), and what comes next. The baseline phase follows again,
    unless the budget was spent before the kill (`finishing`): then the run only records its end."""

    kind: Literal["resumed"] = "resumed"
    after_seq: int
    after_event: str
    dropped_bytes: int = 0
    dropped: str = ""
    """The start of the torn last line that was cut off."""
    candidate: int = 0
    """The candidate in flight at the kill, evaluated again from its recorded proposal (0: none)."""
    in_flight: list[int] = Field(default_factory=list)
    """Every candidate in flight at the kill (a parallel run has several), each evaluated again."""
    pending_keep: str = ""
    """A keep decided but not recorded as committed: `found <sha>` on the branch, or `commit` (made now)."""
    head_commit: str
    candidates_done: int
    kept: int
    best_speedup: float
    spent_s: float
    """Wall clock the run had used before the kill (the time it was down not counted)."""
    downtime_s: float
    reaped: int = 0
    """Leftover servers or containers of the dead harness that were killed."""
    finishing: str = ""
    """Why nothing is left to evaluate (e.g. `budget: candidates`): no baseline phase, the run finishes."""
    worktrees_removed: int = 0
    moved: Moved | None = None
    """Set when the run goes on elsewhere (another host, run folder, checkout or cache) than where it was."""


class Remeasured(Event):
    """A parallel run's candidate measured against an incumbent that is no longer the branch head: its evidence
    is void, and it is evaluated again on the new head (agent/run/parallel.py)."""
    kind: Literal["remeasured"] = "remeasured"
    candidate: int
    measured_against: str
    head_commit: str
    worker: int
    reason: str


class IncumbentRestarted(Event):
    """The incumbent's server failed during a candidate's benchmark (an error, a dead process, or no token on
    any stream for benchmark.stall_timeout_s). A fresh server of the same tree and flags replaces it, and the
    candidate is benchmarked again on fresh prompts; the failed attempt left no benchmark record."""
    kind: Literal["incumbent_restarted"] = "incumbent_restarted"
    candidate: int
    confirmation: int = 0
    failed_server: str
    server: str
    reason: str
    seconds: float
    """The replacement's start, until it answered."""
    post_mortem: dict = Field(default_factory=dict)
    """The failed server's processes just before it was stopped (sandbox/host.py snapshot)."""


class IncumbentReverted(Event):
    """A kept change found wrong later: the incumbent (the branch head's server) failed its audit in a benchmark and
    again on fresh prompts, or at the end-of-run check. The branch goes back to the commit before that keep by a new
    commit restoring its tree (`reverted`), and the incumbent is served from it."""
    kind: Literal["incumbent_reverted"] = "incumbent_reverted"
    candidate: int
    """The candidate whose benchmark found it (0: the end-of-run check)."""
    confirmation: int = 0
    failed_commit: str
    """The branch head whose server failed."""
    kept_by: int
    """The candidate whose keep made `failed_commit`."""
    restored: str
    """The commit whose tree the branch goes back to (the one before the keep)."""
    audit_seed: int
    """The sample_seed of the incumbent's failing audit on fresh prompts (a TokenAudit with `incumbent`)."""
    speedup: float
    """The reverted keep's speedup, taken out of the run's cumulative speedup."""
    reason: str


class Reverted(Event):
    """The commit that restored the branch after an `incumbent_reverted` record (its trailer names that record)."""
    kind: Literal["reverted"] = "reverted"
    candidate: int
    """The candidate whose keep was reverted."""
    branch: str
    commit: str
    reverts: str
    event_sha256: str


class DuplicateDropped(Event):
    """A proposal dropped unevaluated: the same patch and serving flags as a candidate still in flight (a parallel
    run asks its proposer again, at most five times per idle worker). It takes no candidate number: `candidate` is
    the number the next proposal gets."""
    kind: Literal["duplicate_dropped"] = "duplicate_dropped"
    candidate: int = 0
    duplicate_of: int = 0
    """The candidate in flight with the same patch and flags."""
    proposer: str = ""
    summary: str = ""
    meta: dict[str, Any] = Field(default_factory=dict)
    """The dropped proposal's `meta` (a queued patch's file, say): a resumed proposer takes it as proposed."""
    patch_sha256: str = ""
    """sha256 of the patch and its serving flags (the key that matched)."""


class RunFinished(Event):
    kind: Literal["run_finished"] = "run_finished"
    reason: str
    candidates: int
    kept: int
    best_speedup: float
    head_commit: str
    seconds: float
    spend_usd: float = 0.0
    gpu_hours: float = 0.0
    """Held by the run's workers, all of them together (parallel runs only)."""
    resumable: bool = False
    """The run was stopped (a check refused, a signal), not ended: `nightshift run --resume` goes on from here."""


class NullCheck(Event):
    """The gate tried on a null (acceptance.null_every, with night_alpha): the incumbent benchmarked against a second
    server of itself at the level of the last candidate's share of the night's budget. A keep here is a false keep
    of the gate itself; it is reported, and replay re-derives the estimate and the verdict from the samples."""

    kind: Literal["null_check"] = "null_check"
    index: int
    """The budget index (error_spent) whose level the check ran at."""
    report: BenchReport | None
    """The A/A's benchmark: its samples, estimate and interval at that level (candidate 0); None if it failed."""
    min_speedup: float
    false_keep: bool
    """The interval lies wholly above min_speedup: the gate would have kept a change that changes nothing."""
    failed: str = ""
    """Why the check could not be made (its second server did not start, a pass failed); the run goes on."""


AnyEvent = Annotated[
    Union[
        RunStarted, SelfParity, Proposal, PatchApplied, Build, ParityReport, SampleTaken, BenchReport, TokenAudit,
        Decision,
        Commit, LlmCall, ToolCall, NotebookEntry, ProposalInvalid, NoiseFloor, Resumed, Remeasured, IncumbentRestarted,
        IncumbentReverted, Reverted, DuplicateDropped, RunFinished, ErrorSpent, NullCheck,
    ],
    Field(discriminator="kind"),
]


class Record(BaseModel):
    """One line of the trace: the event plus its place in the hash chain."""

    model_config = ConfigDict(extra="forbid")
    sha256: str = ""
    seq: int
    time: float
    prev_sha256: str
    event: AnyEvent
