"""The `nightshift` command: run (and --resume), review, report, verify, replay, checkout, noise, validate,
propose (a dry start), status, pack."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from agent.world.task import DEFAULT_TASK, find_task, load_task, with_overrides, with_settings
from traces.errors import NightshiftError


class Commands(TyperGroup):
    """A NightshiftError (bad input, broken environment) is one red line and exit code 2, or exit code 1 once a
    run has started (run_loop: the run stopped, resumable); anything else is a bug and keeps its traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except NightshiftError as exc:
            fail(str(exc))


app = typer.Typer(cls=Commands, add_completion=False, no_args_is_help=True,
                  help="Optimize vLLM serving unattended; keep only changes with identical greedy tokens.")
console = Console()
errors = Console(stderr=True, soft_wrap=True, highlight=False)
TASK_HELP = (f"a built-in task by name, or a task YAML by path (default: {DEFAULT_TASK}, the built-in CPU task; "
             "README: Tasks)")


def _terminate(signum, frame):
    """SIGTERM (a spot host's notice): the run stops resumable; a record being written is finished first."""
    from traces.log import interrupt

    interrupt(SystemExit(128 + signum))


def fail(message: str, code: int = 2) -> NoReturn:
    errors.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


@app.command()
def run(
    task_file: str = typer.Argument(DEFAULT_TASK, help=TASK_HELP),
    runs_dir: Path = typer.Option(Path("runs"), help="where run folders are written"),
    proposer: Optional[str] = typer.Option(None, help="override the task's proposer: a registered kind (flags, "
                                           "queue, llm, or one agent/extensions.py lists)"),
    patches: Optional[Path] = typer.Option(None, help="patch folder for --proposer queue (alone: implies it)"),
    max_candidates: Optional[int] = typer.Option(None, help="override budget.max_candidates"),
    checkout: Optional[Path] = typer.Option(None, help="override target.checkout; with --resume of a pack, the "
                                            "checkout its branch goes on in (default: the installed vLLM's)"),
    settings: list[str] = typer.Option([], "--set", help="override a task field, e.g. --set workload.input_len=8192 "
                                       "(repeatable; values are YAML)"),
    quiet: bool = typer.Option(False, help="no live view"),
    workers: Optional[int] = typer.Option(None, help="evaluate N candidates at once, one per GPU, on Ray "
                                          "(sandbox.workers; docs/parallel.md)"),
    detach: bool = typer.Option(False, help="run in the background: print the run id and its log, return at once"),
    run_id: Optional[str] = typer.Option(None, hidden=True),
    resume: Optional[str] = typer.Option(None, help="continue a run whose harness was killed or stopped (run id, "
                                                    "folder, or a pack from `nightshift pack`), with its recorded "
                                                    "task"),
):
    """Run an optimization task; ends with a branch nightshift/<run-id> and runs/<run-id>/."""
    from agent.run.preflight import check_run
    from agent.proposers import make_proposer
    from agent.run.relaxed import describe as describe_relaxed
    from agent.run.setup import new_run_id, prepare_run

    if resume:
        if settings or proposer or patches or max_candidates or run_id or workers is not None:
            fail("--resume continues the run with its recorded task; it takes no task options (only --checkout)")
        checkout = checkout and checkout.resolve()
        if detach:
            from agent.run.resume import check_resumable

            run_dir = check_resumable(resume, runs_dir)
            start_detached(["run", "--resume", str(run_dir), "--runs-dir", str(runs_dir.resolve()), "--quiet",
                            *(["--checkout", str(checkout)] if checkout else [])],
                           run_dir.parent / f"{run_dir.name}.log", run_dir.name, append=True)
            return
        resume_loop(resume, runs_dir, quiet, checkout=checkout)
        return
    if workers is not None and workers < 1:
        fail(f"--workers {workers}: a run needs at least one worker (1 is the single-process loop)")
    task_as_written = load_task(task_file)
    task = with_settings(task_as_written, settings + ([f"sandbox.workers={workers}"] if workers else []))
    if kind := proposer or ("queue" if patches else None):
        from agent.extensions import PROPOSERS

        try:
            section = PROPOSERS.get(kind).cli_section(patches)
        except ValueError as exc:
            fail(str(exc))
        if section is not None:
            task = with_overrides(task, proposer=section)
        elif kind != task.proposer.kind:
            fail(f"the task has no configuration for proposer {proposer!r}; set it in the task file")
    if max_candidates:
        task = with_overrides(task, budget={"max_candidates": max_candidates})
    if checkout:
        task = with_overrides(task, target={"checkout": str(checkout.resolve())})
    chosen = make_proposer(task)
    if detach:
        argv = ["run", str(find_task(task_file).resolve()), "--runs-dir", str(runs_dir.resolve())]
        for flag, value in (("--proposer", proposer), ("--patches", patches and patches.resolve()),
                            ("--max-candidates", max_candidates), ("--checkout", checkout and checkout.resolve()),
                            ("--workers", workers)):
            argv += [flag, str(value)] if value is not None else []
        for setting in settings:
            argv += ["--set", setting]
        run_id = run_id or new_run_id()
        runs_dir = runs_dir.resolve()
        if (runs_dir / run_id).exists():
            fail(f"run {run_id} already exists in {runs_dir}")
        start_detached([*argv, "--run-id", run_id, "--quiet"], runs_dir / f"{run_id}.log", run_id)
        return
    if task.sandbox.workers > 1:
        from agent.run.parallel import preflight

        preflight(task)
    check_run(task)
    setup = prepare_run(task, runs_dir, run_id=run_id, task_file=task_as_written)
    console.print(f"run [bold]{setup.run_id}[/bold] -> {setup.run_dir}  branch {setup.workspace.branch}",
                  soft_wrap=True)
    console.print(escape(setup.model.describe()), soft_wrap=True, highlight=False)
    if setup.relaxed:
        console.print(f"[yellow]relaxed:[/yellow] {escape('; '.join(map(describe_relaxed, setup.relaxed)))}",
                      soft_wrap=True, highlight=False)
    for warning in setup.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True, highlight=False)
    run_loop(setup, chosen, quiet)


def start_detached(argv: list[str], log: Path, run_id: str, append: bool = False) -> None:
    """`nightshift ARGV` in its own session, its output to `log` (a new file unless `append`: a resumed run's
    output goes on after the killed one's)."""
    if log.exists() and not append:
        fail(f"run {run_id} already exists in {log.parent}")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab" if append else "xb") as out:
        child = subprocess.Popen([sys.executable, "-m", "agent.face.cli", *argv], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    console.print(f"run [bold]{run_id}[/bold] {'resumed' if append else 'started'} in the background "
                  f"(pid {child.pid}); log {log}", soft_wrap=True)


def resume_loop(run: str, runs_dir: Path, quiet: bool, vllm_version: str | None = None, sandbox=None,
                worker_sandbox=None, checkout: Path | None = None) -> None:
    """`sandbox`: the run's sandbox, or a callable making it for the run folder (default: the task's backend)."""
    from agent.run.resume import describe, resume_run

    started = time.monotonic()
    setup, proposer, sandbox, state = resume_run(run, runs_dir, vllm_version=vllm_version, sandbox=sandbox,
                                                 checkout=checkout)
    console.print(f"run [bold]{setup.run_id}[/bold] {escape(describe(state.event))} "
                  f"(checked in {time.monotonic() - started:.1f} s)", soft_wrap=True)
    console.print(escape(setup.model.describe()), soft_wrap=True, highlight=False)
    run_loop(setup, proposer, quiet, sandbox=sandbox, resume=state, worker_sandbox=worker_sandbox)


def run_loop(setup, proposer, quiet: bool, sandbox=None, resume=None, worker_sandbox=None) -> None:
    """`worker_sandbox(config, folder)`: a parallel worker's sandbox (default: the task's backend)."""
    from agent.run.loop import Loop
    from agent.face.report import write_summary
    from agent.face.view import LiveView

    trace = setup.run_dir / "trace.jsonl"
    view = LiveView(setup.task, console, enabled=not quiet)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        with view:
            runner = Loop(setup, proposer, on_event=view.update, sandbox=sandbox, resume=resume,
                          sandbox_factory=worker_sandbox, on_workers=view.show_workers)
            finished = runner.run()
    except NightshiftError as exc:
        write_summary(setup.run_dir)
        fail(f"run stopped at {exc.stage}: {exc} (the trace up to here: {trace}); the run can go on: "
             f"nightshift run --resume {setup.run_dir}", 1)
    except Exception:
        write_summary(setup.run_dir)
        errors.print(f"the run stopped on a bug (the trace up to here: {trace})")
        raise
    finally:
        setup.release_worktrees()
    summary = write_summary(setup.run_dir)
    console.print(summary)
    console.print(f"finished: {finished.reason}; kept {finished.kept} of {finished.candidates}; "
                  f"cumulative speedup {finished.best_speedup:.3f}x; {finished.seconds:.0f}s"
                  + (f"; LLM spend ${finished.spend_usd:.4f}" if finished.spend_usd else ""))
    if runner.state.end.failed:
        raise typer.Exit(1)


@app.command()
def review(run: str = typer.Argument(..., help="run folder or run id"),
           runs_dir: Path = typer.Option(Path("runs"))):
    """Show the run's branch as a table: what changed, speedup and interval, parity evidence."""
    from agent.replay.chain import resolve_run
    from agent.face.report import review_tables

    run_dir = resolve_run(run, runs_dir)
    for table in review_tables(run_dir):
        console.print(table)
    from agent.face.html_report import write_report

    console.print(f"report: {write_report(run_dir)}", soft_wrap=True, highlight=False)


@app.command()
def report(run: str = typer.Argument(..., help="run folder or run id"),
           runs_dir: Path = typer.Option(Path("runs"))):
    """Write runs/<id>/report.html: one self-contained page (works offline) of the run and its verify grid."""
    from agent.replay.chain import resolve_run
    from agent.face.html_report import write_report

    console.print(f"report: {write_report(resolve_run(run, runs_dir))}", soft_wrap=True, highlight=False)


@app.command()
def verify(run: Optional[str] = typer.Argument(None, help="run folder or run id (or --checkout, --head)"),
           runs_dir: Path = typer.Option(Path("runs")),
           base: Optional[str] = typer.Option(None, help="baseline ref (default: the run's base commit)"),
           head: Optional[str] = typer.Option(None, help="ref to verify (default: the run's branch)"),
           checkout: Optional[Path] = typer.Option(None, help="a vLLM checkout, to verify --head without a run"),
           task_file: Optional[str] = typer.Option(None, "--task", help="task for --checkout: a built-in "
                                                   f"task's name or a YAML's path (default: {DEFAULT_TASK})"),
           input_lens: Optional[str] = typer.Option(None, help="e.g. 512,2048,8192 (default: the task's verify)"),
           output_lens: Optional[str] = typer.Option(None, help="e.g. 128,256"),
           concurrency: Optional[str] = typer.Option(None, help="e.g. 1,16,64,256"),
           repetitions: Optional[int] = typer.Option(None, min=2, help="paired passes per cell"),
           settings: list[str] = typer.Option([], "--set", help="override a task field for this verify, e.g. "
                                              "--set parity.num_prompts=4 (repeatable; recorded in verify.json)"),
           quiet: bool = typer.Option(False, help="no progress bars")):
    """Measure the branch's head against its base over a grid of input/output lengths and concurrency.
    Exit code 1: a cell regressed beyond its interval, failed parity or the audit, or failed to run."""
    from agent.face.verify_cli import run_verify

    raise typer.Exit(run_verify(console, run, runs_dir, base, head, checkout, task_file or DEFAULT_TASK,
                                input_lens, output_lens, concurrency, repetitions, quiet, settings))


@app.command()
def replay(run: str = typer.Argument(..., help="run folder or run id"),
           runs_dir: Path = typer.Option(Path("runs")),
           rerun: bool = typer.Option(False, help="after the audit, run the loop again with the same task, "
                                                  "feeding recorded LLM responses back instead of calling an LLM")):
    """Audit a run: the trace's hash chain is intact and the branch is exactly what it accepted."""
    from agent.replay.chain import audit, resolve_run
    from traces import TraceError

    run_dir = resolve_run(run, runs_dir)
    try:
        result = audit(run_dir)
    except TraceError as exc:
        console.print(f"[red]audit failed[/red] at record {exc.line}: {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"[green]audit ok[/green]: {result.records} records, chain intact; "
                  f"{result.commits} commit(s) on the branch, each matching its keep decision; "
                  f"{result.decisions} decision(s) follow from their recorded evidence")
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if rerun:
        rerun_from_trace(run_dir, runs_dir)


def rerun_from_trace(run_dir: Path, runs_dir: Path) -> None:
    """The recorded task, with the LLM replaced by its recorded responses (a model like any other)."""
    from agent.run.loop import Loop
    from agent.proposers.clients import ReplayModel
    from agent.run.preflight import check_run
    from agent.proposers import make_proposer
    from agent.proposers.llm import LlmProposer
    from agent.run.setup import prepare_run
    from agent.world.task import parse_task
    from traces import read_trace

    trace = run_dir / "trace.jsonl"
    task = parse_task(read_trace(trace)[0].event.task, f"{trace} (run_started.task)")
    proposer = (LlmProposer.from_task(task, model=ReplayModel.from_trace(trace)) if task.proposer.kind == "llm"
                else make_proposer(task))
    check_run(task)
    setup = prepare_run(task, runs_dir)
    console.print(f"rerun of {run_dir.name} as [bold]{setup.run_id}[/bold]")
    finished = Loop(setup, proposer).run()
    console.print(f"rerun finished: {finished.reason}; kept {finished.kept} of {finished.candidates}")


@app.command()
def checkout(dest: Optional[Path] = typer.Option(None, help="where to create it (default: the cache)")):
    """Make a git repo of the installed vLLM's Python sources, tagged v<version>."""
    from agent.world.checkout import create_checkout

    path, version = create_checkout(dest)
    console.print(json.dumps({"checkout": str(path), "vllm_version": version, "tag": f"v{version}"}))


@app.command()
def noise(task_file: str = typer.Argument(DEFAULT_TASK, help=TASK_HELP),
          aa: int = typer.Option(10, "--aa", help="A/A benchmarks: the baseline against a second copy of itself"),
          patch: list[Path] = typer.Option([], "--patch", help="a patch with a known effect (repeatable)"),
          repeat: int = typer.Option(10, help="benchmarks of each patch"),
          both_ways: bool = typer.Option(False, "--both-ways", help="also benchmark each patch the other way round "
                                         "(the patched server as the incumbent): a known slowdown seen as a speedup"),
          settings: list[str] = typer.Option([], "--set", help="override a task field (repeatable)"),
          runs_dir: Path = typer.Option(Path("runs"), help="where the study's folder is written")):
    """What this machine's benchmark can see: false accepts and the minimum detectable effect from repeated
    A/As, and how often a known effect is detected; servers start once (runs/<id>/noise.json, noise.md)."""
    from agent.run.preflight import check_run, study_servers
    from agent.run.setup import new_run_id, prepare_run

    if aa < 0 or repeat < 1:
        fail(f"--aa {aa} --repeat {repeat}: counts must be positive")
    if aa < 2 and not patch:
        fail("a noise study needs at least 2 A/A benchmarks (--aa) or a patch (--patch)")
    for path in patch:
        if not path.is_file():
            fail(f"patch file not found: {path}")
    task = with_settings(load_task(task_file), settings)
    check_run(task)
    setup = prepare_run(task, runs_dir, run_id=f"noise-{new_run_id()}", servers=study_servers(task, 2 + len(patch)))
    return noise_study(setup, aa, patch, repeat, both_ways)


def noise_study(setup, aa: int, patches: list[Path], repeat: int, both_ways: bool, sandbox=None) -> dict:
    """The `noise` command once its run is prepared (tests/resume_driver.py runs it on fake servers)."""
    from agent.studies.noise_study import study

    console.print(f"noise study [bold]{setup.run_id}[/bold] -> {setup.run_dir}", soft_wrap=True)
    signal.signal(signal.SIGTERM, _terminate)  # a stopped study writes the benchmarks it has (noise.json, noise.md)
    try:
        data = study(setup, aa, patches, repeat, sandbox=sandbox, on_line=console.print, both_ways=both_ways)
    finally:
        setup.release_worktrees()
    console.print((setup.run_dir / "noise.md").read_text(), soft_wrap=True, markup=False)
    console.print(f"written: {setup.run_dir / 'noise.json'}")
    return data


@app.command()
def validate(task_file: str = typer.Argument(..., help="a built-in task by name, or a task YAML by path")):
    """Check a task and print it resolved (its model config's path included)."""
    console.print_json(load_task(task_file).model_dump_json())


@app.command()
def propose(task_file: str = typer.Argument(DEFAULT_TASK, help="a built-in task by name, or a task YAML by path"),
            checkout: Optional[Path] = typer.Option(None, help="the vLLM source checkout to read (default: the "
                                                    "task's target.checkout, else the installed vLLM's)"),
            settings: list[str] = typer.Option([], "--set", help="override a task field (repeatable; values are "
                                               "YAML)"),
            patch_out: Optional[Path] = typer.Option(None, "--patch", help="also write the proposed patch here")):
    """A dry start: the task's proposer asked once for the first candidate, with no server and no GPU.
    Shows, before a night on the GPU, that the task, the sources and the proposer (an LLM's endpoint, its request
    contract and tools) work together. Runs nothing it proposes. Exit code 1: no proposal."""
    from agent.proposers.base import ProposerExhausted
    from agent.run.dry import dry_start

    task = with_settings(load_task(task_file), settings)

    def say(note: str) -> None:
        console.print(f"[yellow]note:[/yellow] {escape(note)}", soft_wrap=True, highlight=False)

    try:
        dry = dry_start(task, checkout, say)
    except ProposerExhausted as exc:
        fail(f"no proposal: {exc}", 1)
    proposal = dry.proposal
    calls = dry.llm_calls
    tokens = sum(c.usage.get("prompt_tokens", 0) + c.usage.get("completion_tokens", 0) for c in calls)
    tools = [e.name for e in dry.events if e.kind == "tool_call"]
    console.print(f"proposal 1 by {proposal.proposer}: {escape(proposal.summary)}", soft_wrap=True, highlight=False)
    if calls:
        console.print(f"{len(calls)} LLM calls ({sum(1 for c in calls if c.error)} failed), {tokens:,} tokens, "
                      f"${dry.spend_usd:.4f}; tools: {', '.join(tools) or 'none'}", soft_wrap=True, highlight=False)
    if proposal.engine_args:
        console.print(f"engine args: {json.dumps(proposal.engine_args, sort_keys=True)}", highlight=False)
    if proposal.patch:
        print(proposal.patch, end="" if proposal.patch.endswith("\n") else "\n")
    if patch_out:
        patch_out.write_text(proposal.patch)


@app.command()
def status(run: str = typer.Argument(..., help="run folder or run id"),
           runs_dir: Path = typer.Option(Path("runs")),
           as_json: bool = typer.Option(False, "--json", help="print the status as JSON")):
    """A run's state from its trace, also while it runs. Exit code 0: finished; 3: not finished."""
    from agent.replay.chain import resolve_run
    from agent.face.ops import run_status, status_table
    from traces import TraceError

    run_dir = resolve_run(run, runs_dir)
    try:
        result = run_status(run_dir)
    except TraceError as exc:
        fail(f"the trace cannot be read: {exc}", 1)
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        console.print(status_table(result))
    raise typer.Exit(0 if result.finished else 3)


@app.command()
def pack(run: str = typer.Argument(..., help="run folder or run id"),
         dest: Path = typer.Argument(..., help="the .tgz to write"),
         runs_dir: Path = typer.Option(Path("runs"))):
    """Pack a run to audit elsewhere: trace, JSON files, log heads and tails, the branch as a git bundle.
    Unpack it anywhere and `nightshift replay` the folder: no checkout needed."""
    from rich.markup import escape

    from agent.replay.chain import resolve_run
    from agent.face.ops import pack_run
    from traces import TraceError

    run_dir = resolve_run(run, runs_dir)
    try:
        manifest = pack_run(run_dir, dest)
    except TraceError as exc:
        fail(f"the trace cannot be read: {exc}", 1)
    console.print(escape(f"packed {manifest['run_id']} -> {dest}: {manifest['records']} records, branch "
                         f"{manifest['branch']} at {manifest['head_commit'][:12]}, {len(manifest['files'])} files"
                         + ("" if manifest["finished"] else " (the run has not finished)")), soft_wrap=True)


if __name__ == "__main__":
    app()
