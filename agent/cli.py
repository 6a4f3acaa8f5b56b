"""The `nightshift` command: run, review, replay, checkout."""
from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from agent.task import TaskError, load_task, with_overrides, with_settings

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Optimize vLLM serving unattended; keep only changes with identical greedy tokens.")
console = Console()
DEFAULT_TASK = Path(__file__).resolve().parent.parent / "tasks" / "gemma4-tiny-cpu.yaml"


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def fail(message: str, code: int = 2) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


@app.command()
def run(
    task_file: Path = typer.Argument(DEFAULT_TASK, help="task YAML (default: the built-in CPU task)"),
    runs_dir: Path = typer.Option(Path("runs"), help="where run folders are written"),
    proposer: Optional[str] = typer.Option(None, help="override the task's proposer: flags or queue"),
    patches: Optional[Path] = typer.Option(None, help="patch folder for --proposer queue"),
    max_candidates: Optional[int] = typer.Option(None, help="override budget.max_candidates"),
    checkout: Optional[Path] = typer.Option(None, help="override target.checkout"),
    settings: list[str] = typer.Option([], "--set", help="override a task field, e.g. --set workload.input_len=8192 "
                                       "(repeatable; values are YAML)"),
    quiet: bool = typer.Option(False, help="no live view"),
):
    """Run an optimization task; ends with a branch nightshift/<run-id> and runs/<run-id>/."""
    from agent.loop import Loop
    from agent.proposers import make_proposer
    from agent.report import write_summary
    from agent.setup import RunSetup, SetupError
    from agent.view import LiveView

    try:
        task = with_settings(load_task(task_file), settings)
        if proposer == "queue" or patches:
            if not patches:
                fail("--proposer queue needs --patches DIR")
            task = with_overrides(task, proposer={"kind": "queue", "patches": str(patches.resolve())})
        elif proposer and proposer != task.proposer.kind:
            fail(f"the task has no configuration for proposer {proposer!r}; set it in the task file")
        if max_candidates:
            task = with_overrides(task, budget={"max_candidates": max_candidates})
        if checkout:
            task = with_overrides(task, target={"checkout": str(checkout.resolve())})
        setup = RunSetup(task, runs_dir)
        chosen = make_proposer(task)
    except (TaskError, SetupError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    console.print(f"run [bold]{setup.run_id}[/bold] -> {setup.run_dir}  branch {setup.workspace.branch}")
    view = LiveView(task, console, enabled=not quiet)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        with view:
            finished = Loop(setup, chosen, on_event=view.update).run()
    except Exception as exc:
        write_summary(setup.run_dir)
        fail(f"run stopped: {type(exc).__name__}: {exc}\n(the trace up to here is in {setup.run_dir})", 1)
    summary = write_summary(setup.run_dir)
    console.print(summary)
    console.print(f"finished: {finished.reason}; kept {finished.kept} of {finished.candidates}; "
                  f"cumulative speedup {finished.best_speedup:.3f}x; {finished.seconds:.0f}s"
                  + (f"; LLM spend ${finished.spend_usd:.4f}" if finished.spend_usd else ""))
    if finished.reason.startswith("proposer failed"):
        raise typer.Exit(1)


@app.command()
def review(run: str = typer.Argument(..., help="run folder or run id"),
           runs_dir: Path = typer.Option(Path("runs"))):
    """Show the run's branch as a table: what changed, speedup and interval, parity evidence."""
    from agent.audit import resolve_run
    from agent.report import review_tables

    try:
        run_dir = resolve_run(run, runs_dir)
    except FileNotFoundError as exc:
        fail(str(exc))
    for table in review_tables(run_dir):
        console.print(table)


@app.command()
def replay(run: str = typer.Argument(..., help="run folder or run id"),
           runs_dir: Path = typer.Option(Path("runs")),
           rerun: bool = typer.Option(False, help="after the audit, run the loop again with the same task, "
                                                  "feeding recorded LLM responses back instead of calling an LLM")):
    """Audit a run: the trace's hash chain is intact and the branch is exactly what it accepted."""
    from agent.audit import audit, resolve_run
    from traces import TraceError

    try:
        run_dir = resolve_run(run, runs_dir)
        result = audit(run_dir)
    except FileNotFoundError as exc:
        fail(str(exc))
    except TraceError as exc:
        console.print(f"[red]audit failed[/red] at record {exc.line}: {exc}")
        raise typer.Exit(1)
    console.print(f"[green]audit ok[/green]: {result.records} records, chain intact; "
                  f"{result.commits} commit(s) on the branch, each matching its keep decision")
    for note in result.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if rerun:
        rerun_from_trace(run_dir, runs_dir)


def rerun_from_trace(run_dir: Path, runs_dir: Path) -> None:
    """The recorded task, with the LLM replaced by its recorded responses (a model like any other)."""
    from agent.loop import Loop
    from agent.models import ReplayModel
    from agent.proposers import make_proposer
    from agent.proposers.llm import LlmProposer
    from agent.setup import RunSetup
    from agent.task import parse_task
    from traces import read_trace

    trace = run_dir / "trace.jsonl"
    task = parse_task(read_trace(trace)[0].event.task, f"{trace} (run_started.task)")
    proposer = (LlmProposer.from_task(task, model=ReplayModel.from_trace(trace)) if task.proposer.kind == "llm"
                else make_proposer(task))
    setup = RunSetup(task, runs_dir)
    console.print(f"rerun of {run_dir.name} as [bold]{setup.run_id}[/bold]")
    finished = Loop(setup, proposer).run()
    console.print(f"rerun finished: {finished.reason}; kept {finished.kept} of {finished.candidates}")


@app.command()
def checkout(dest: Optional[Path] = typer.Option(None, help="where to create it (default: the cache)")):
    """Make a git repo of the installed vLLM's Python sources, tagged v<version>."""
    from agent.checkout import CheckoutError, create_checkout

    try:
        path, version = create_checkout(dest)
    except CheckoutError as exc:
        fail(str(exc))
    console.print(json.dumps({"checkout": str(path), "vllm_version": version, "tag": f"v{version}"}))


@app.command()
def validate(task_file: Path):
    """Check a task file and print it resolved."""
    try:
        task = load_task(task_file)
    except TaskError as exc:
        fail(str(exc))
    console.print_json(task.model_dump_json())


if __name__ == "__main__":
    app()
