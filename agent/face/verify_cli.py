"""`nightshift verify` between the command line and agent/studies/verify.py: which two trees, which grid, the exit code."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from agent.studies.grid import parse_lens
from agent.world.task import load_task
from agent.studies.verify import VerifyError, checkout_target, run_target, verify
from agent.face.verify_view import VerifyProgress


def run_verify(console: Console, run: str | None, runs_dir: Path, base: str | None, head: str | None,
               checkout: Path | None, task_file: str | Path, input_lens: str | None, output_lens: str | None,
               concurrency: str | None, repetitions: int | None, quiet: bool,
               settings: list[str] = ()) -> int:
    """0: no regression; 1: a cell regressed, failed parity or the audit, or failed to run."""
    from agent.replay.chain import resolve_run
    from agent.face.html_report import write_report
    from agent.run.preflight import check_vllm_install

    if run and checkout:
        raise VerifyError("give a run or --checkout, not both")
    if run:
        target = run_target(resolve_run(run, runs_dir), base, head)
    elif checkout:
        if not head:
            raise VerifyError("--checkout needs --head REF (and --base REF, default: the task's vLLM version tag)")
        task = load_task(task_file)
        target = checkout_target(checkout, base or f"v{task.target.vllm_version}", head, task, runs_dir)
    else:
        raise VerifyError("verify needs a run (id or folder), or --checkout PATH --head REF")
    if settings:
        target.set(settings)
    v = target.task.verify
    lens = [parse_lens(text, name) if text else default for text, name, default in
            ((input_lens, "input-lens", v.input_lens), (output_lens, "output-lens", v.output_lens),
             (concurrency, "concurrency", v.concurrency))]
    check_vllm_install()
    console.print(escape(f"verify {target.head_ref} ({target.head[:12]}) against {target.base_ref} "
                         f"({target.base[:12]}) -> {target.out_dir}"), soft_wrap=True, highlight=False)
    with VerifyProgress(console, enabled=not quiet) as progress:
        data = verify(target, *lens, repetitions, progress)
    report = write_report(target.run_dir)
    console.print(escape(f"{len(data['cells'])} cells: {len(data['regressions'])} regression(s), "
                         f"{len(data['failed'])} failed, {len(data['skipped'])} skipped; "
                         f"{target.out_dir / 'verify.json'}, {target.out_dir / 'verify.md'}, {report}"),
                  soft_wrap=True, highlight=False)
    for key in data["regressions"]:
        console.print(f"[red]regression[/red] {escape(key)}", highlight=False)
    for key in data["failed"]:
        cell = next(c for c in data["cells"] if c["key"] == key)
        console.print(f"[red]failed[/red] {escape(key)}: {escape(cell['reason'])}", soft_wrap=True, highlight=False)
    return 1 if data["regressions"] or data["failed"] else 0
