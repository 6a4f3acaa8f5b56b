"""The opening of an LLM proposer's conversation: what the model is told before its first answer.

With tools (`tools_system.md`, `tools_propose.md`): the goal and its numbers, the edit surface and the engine levers,
the machine (agent/proposers/machine.py), a short profile and the notebook, newest first, and the last result to
reflect on; the model reads the code itself. Without read tools (`system.md`, `propose.md`): the same goal, the
machine, the profile and the history, the branch's diff, a map of the surface and the most relevant files' contents
within the context budget, since the model can read nothing else. Files are ranked by the profile, then the branch's
diff, then the model's architecture and known hot paths; each fresh conversation puts another of the four hottest
first, and a file too big for the budget is shown as an exact excerpt around its hottest profiled function.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from agent import prompts
from agent.proposers import tools
from agent.proposers.base import Attempt, ProposalContext
from agent.proposers.clients import Messages, estimate_tokens
from agent.stages.surface import surface_allows
from agent.world.task import Task
from traces.schema import NotebookEntry

EXCERPT_LINES = 160
HOT_PATH_HINTS = ["sample/sampler", "logits_processor", "worker/cpu_model_runner", "worker/gpu_model_runner",
                  "core/sched/scheduler", "layers/layernorm", "rotary_embedding", "layers/activation",
                  "attention/backends/cpu", "sample/ops", "worker/gpu_input_batch", "block_table",
                  "kv_cache_manager", "layers/linear", "vocab_parallel_embedding"]
TOOLS_REPAIR_NOTE = ("\nThe files are unchanged. Look again with the tools if needed, then call propose with the "
                     "corrected change.")


def profile_text(profile: Any) -> str:
    """The profile as the model reads it: its summary, or why there is none."""
    if profile is None:
        return "(no profile)"
    return profile if isinstance(profile, str) else profile.summary()


def hot_files(profile: Any) -> list[str]:
    return [] if profile is None or isinstance(profile, str) else list(profile.hot_files())


def goal(task: Task, ctx: ProposalContext) -> dict[str, str]:
    """The fields both openings share: the task, its numbers and the incumbent."""
    return {
        "task_name": task.name, "task_description": (task.description or "").strip(),
        "metric": task.benchmark.metric, "workload": workload(task),
        "min_speedup": f"{task.acceptance.min_speedup:g}", "confidence": f"{task.acceptance.confidence:g}",
        "parity": f"{task.parity.num_prompts} prompts, {task.parity.max_tokens} greedy tokens each",
        "best_speedup": f"{ctx.best_speedup:.3f}", "engine_args": json.dumps(ctx.incumbent_args, sort_keys=True),
    }


def with_tools(task: Task, ctx: ProposalContext, protocol: str, calls: int, context_tokens: int, machine: str,
               profile: str, notebook: str, reflect: NotebookEntry | None) -> Messages:
    """The system prompt and the opening of a conversation with tools."""
    surface = ", ".join(task.edit_surface.include)
    if task.edit_surface.exclude:
        surface += f" (except {', '.join(task.edit_surface.exclude)})"
    fields = {**goal(task, ctx), "surface": surface, "calls": str(calls), "machine": machine,
              "profile": clip(profile, context_tokens * 0.2), "notebook": clip(notebook, context_tokens * 0.2),
              "levers": levers(task, ctx.incumbent_args), "reflect": ""}
    if reflect is not None:
        fields["reflect"] = (f"\n# Your last result: candidate {reflect.candidate}\n{reflect.summary[:1500]}\n"
                             "In propose's `reflection`, say what this result teaches (judge the evidence: is the "
                             "interval wide, did the tokens diverge, is the spot really cold?); it goes into the "
                             "notebook.\n")
    text = "" if protocol == "native" else prompts.load("tools_text").substitute(tools=tools.text_protocol())
    return [{"role": "system", "content": prompts.load("tools_system").substitute(protocol=text)},
            {"role": "user", "content": prompts.load("tools_propose").substitute(fields)}]


def single_shot(task: Task, ctx: ProposalContext, focus: int, context_tokens: int, machine: str, profile: Any,
                invalid_log: list[str]) -> Messages:
    """The system prompt and the opening of a conversation without read tools: the files are in it. `focus`: how
    many fresh conversations came before, each with another of the four hottest files first."""
    checkout = Path(ctx.checkout)
    files = surface_files(task, checkout)
    ranked = rank_files(task, hot_files(profile), files, ctx.branch_diff)
    if ranked:
        k = focus % min(len(ranked), 4)
        ranked = ranked[k:k + 1] + ranked[:k] + ranked[k + 1:]
    fields = {
        **goal(task, ctx), "machine": machine,
        "profile": clip(profile_text(profile), context_tokens * 0.12),
        "history": clip(history_text(ctx, invalid_log), context_tokens * 0.12),
        "branch_diff": clip(ctx.branch_diff.strip() or "(none yet: the files are vLLM as released)",
                            context_tokens * 0.10),
        "file_map": "", "files": "", "example_path": ranked[0] if ranked else "vllm/v1/sample/sampler.py",
    }
    system = prompts.load("system").substitute()
    left = context_tokens - estimate_tokens(system) - estimate_tokens(prompts.load("propose").substitute(fields))
    fields["file_map"] = clip(file_map(files, ranked, checkout), min(left * 0.25, context_tokens * 0.15))
    left -= estimate_tokens(fields["file_map"])
    fields["files"] = file_contents(checkout, ranked, max(left, 200), profile)
    return [{"role": "system", "content": system},
            {"role": "user", "content": prompts.load("propose").substitute(fields)}]


def repair(attempt: Attempt, with_tools: bool) -> str:
    """The turn after the proposer's own candidate failed at a stage a repair can fix: the stage and the evidence."""
    detail = ""
    if attempt.decision.stage == "parity":
        detail = ("The output tokens differ from the baseline: the change alters the computation. "
                  "Make sure the new code computes exactly the same values in the same order.\n")
    return (prompts.load("repair").substitute(candidate=attempt.proposal.candidate, stage=attempt.decision.stage,
                                              reason=attempt.decision.reason[:3000], detail=detail)
            + (TOOLS_REPAIR_NOTE if with_tools else ""))


def surface_files(task: Task, checkout: Path) -> list[str]:
    inc, exc = task.edit_surface.include, task.edit_surface.exclude
    return [f for f in git_ls_files(checkout) if f.endswith(".py") and surface_allows(f, inc, exc)]


def rank_files(task: Task, hot: list[str], files: list[str], branch_diff: str) -> list[str]:
    present = set(files)
    ranked: dict[str, None] = {}
    for f in hot:
        if f in present:
            ranked.setdefault(f, None)
    for f in files:
        if f"b/{f}" in branch_diff:
            ranked.setdefault(f, None)
    arch = architecture_hint(task)
    for hint in ([arch] if arch else []) + HOT_PATH_HINTS:
        for f in files:
            if hint and hint in f and not f.endswith("__init__.py"):
                ranked.setdefault(f, None)
    for f in files:  # then the rest of the surface, in path order
        if not f.endswith("__init__.py"):
            ranked.setdefault(f, None)
    return list(ranked)


def file_contents(checkout: Path, ranked: list[str], budget_tokens: float, profile: Any) -> str:
    blocks: list[str] = []
    left = budget_tokens
    for rel in ranked[:6]:
        try:
            text = (checkout / rel).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        lines = text.splitlines()
        if len(lines) <= EXCERPT_LINES and estimate_tokens(text) + 30 <= left:
            block = f"### FILE {rel}\n```python\n{text.rstrip()}\n```"
        else:
            window = excerpt(rel, lines, left, profile)
            if window is None:
                continue
            start, end = window
            body = "\n".join(lines[start:end])
            block = f"### FILE {rel} (lines {start + 1}-{end})\n```python\n{body}\n```"
        cost = estimate_tokens(block)
        if cost > left:
            continue
        blocks.append(block)
        left -= cost
        if left < 300:
            break
    return "\n\n".join(blocks) or "(no file fits in the context budget)"


def excerpt(rel: str, lines: list[str], budget_tokens: float, profile: Any) -> tuple[int, int] | None:
    """A window of at most EXCERPT_LINES lines around the file's hottest profiled function, or from its first line of
    code (past the license header)."""
    if budget_tokens < 150 or not lines:
        return None
    hot = [ln for ln in (profile.hot_lines(rel) if hot_files(profile) else []) if 0 < ln <= len(lines)]
    if hot:
        start = max(0, hot[0] - 1 - 8)
    else:
        start = next((i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")), 0)
    average = max(1.0, sum(len(x) for x in lines) / len(lines) / 3.5 + 1)
    span = min(EXCERPT_LINES, int(budget_tokens / average) - 4)
    if span < 20:
        return None
    return start, min(len(lines), start + span)


def history_text(ctx: ProposalContext, invalid_log: list[str]) -> str:
    out: list[str] = []
    for attempt in ctx.history[-12:]:
        d, p = attempt.decision, attempt.proposal
        numbers = ""
        if d.speedup is not None:
            numbers = f", speedup {d.speedup:.3f}"
            if d.ci_low is not None and d.ci_high is not None:
                numbers += f" (CI {d.ci_low:.3f}..{d.ci_high:.3f})"
        what = p.summary or "(no summary)"
        if p.engine_args:
            what += f" engine args {json.dumps(p.engine_args, sort_keys=True)}"
        out.append(f"- candidate {p.candidate} [{p.proposer}] {what}: {d.verdict} at {d.stage}{numbers}: "
                   f"{d.reason[:300]}")
    if invalid_log:
        out.append("Your recent answers that could not be used:")
        out += [f"- {x}" for x in invalid_log[-5:]]
    return "\n".join(out) or "(none yet)"


def git_ls_files(checkout: Path) -> list[str]:
    try:
        proc = subprocess.run(["git", "ls-files", "-z"], cwd=checkout, capture_output=True, timeout=60)
        if proc.returncode == 0 and proc.stdout:
            return sorted(p for p in proc.stdout.decode("utf-8", "replace").split("\0") if p)
    except (OSError, subprocess.SubprocessError):
        pass
    root = Path(checkout)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if ".git" not in p.parts and "__pycache__" not in p.parts)


def file_map(files: list[str], ranked: list[str], checkout: Path) -> str:
    """The surface: the ranked files one a line (with their size), the rest counted per folder."""
    lines: list[str] = []
    shown = set(ranked[:20])
    for rel in ranked[:20]:
        try:
            n = sum(1 for _ in open(checkout / rel, "rb"))
        except OSError:
            n = 0
        lines.append(f"{rel} ({n} lines)")
    folders: dict[str, int] = {}
    for rel in files:
        if rel not in shown:
            folder = rel.rsplit("/", 1)[0]
            folders[folder] = folders.get(folder, 0) + 1
    if folders:
        lines.append("Other files you may edit, per folder:")
        lines += [f"{folder}/ ({count} files)" for folder, count in sorted(folders.items())]
    return "\n".join(lines) or "(no files)"


def clip(text: str, budget_tokens: float) -> str:
    limit = int(max(budget_tokens, 50) * 3.5)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def levers(task: Task, incumbent: dict[str, Any]) -> str:
    """The engine args `propose` may change, each with its incumbent value and the values allowed."""
    surface = task.edit_surface
    if not surface.engine_args:
        return "none (code changes only)"
    out = []
    for name in surface.engine_args:
        now = json.dumps(incumbent.get(name))
        allowed = surface.engine_values.get(name)
        out.append(f"{name}={now}" + (f" (one of {', '.join(json.dumps(v) for v in allowed)})" if allowed else ""))
    return ("; ".join(out) + ". Give them in propose's `engine_args`, alone or with code; null is vLLM's default; "
            "any other value must be of the current value's type")


def workload(task: Task) -> str:
    return (f"{task.workload.num_prompts} prompts of {task.workload.input_len} input tokens, "
            f"{task.workload.output_len} output tokens each, concurrency "
            f"{task.workload.concurrency or 'all at once'}; model {model_name(task)}, dtype {task.model.dtype}")


def model_name(task: Task) -> str:
    if task.model.path:
        return task.model.path.name
    if task.model.synthetic:
        return f"synthetic from {task.model.synthetic.config.name}"
    return "?"


def architecture_hint(task: Task) -> str:
    config = None
    if task.model.synthetic:
        config = task.model.synthetic.config
    elif task.model.path:
        config = task.model.path / "config.json"
    try:
        data = json.loads(Path(config).read_text()) if config else {}
    except (OSError, ValueError):
        return ""
    arch = (data.get("architectures") or [""])[0]
    model_type = str(data.get("model_type") or "")
    if model_type:
        return f"models/{model_type.split('_')[0]}.py"
    return f"models/{arch.lower().replace('forcausallm', '')}.py" if arch else ""
