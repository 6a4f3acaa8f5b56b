"""The live view: candidate, stage, best speedup so far, budget left; a bar for what takes long (server starts,
a benchmark's passes)."""
from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from agent.run.phases import phase_after
from agent.world.task import Task
from agent.stages.token_audit import calibration_summary



def noise_line(event) -> str:
    return (f"noise floor (A/A, {event.repetitions} pairs): pass CV {event.cv_incumbent:.1%} / {event.cv_peer:.1%}, "
            f"log-ratio SD {event.log_ratio_sd:.3f}, A/A {event.speedup:.3f}x, MDE {event.mde_speedup:.3f}x"
            + (f" ({event.mde_speedup_max:.3f}x at {event.max_repetitions})" if event.mde_speedup_max else ""))


class LiveView:
    def __init__(self, task: Task, console: Console, enabled: bool = True):
        self.task, self.console, self.enabled = task, console, enabled
        self.started = time.time()
        self.candidate, self.stage, self.best, self.kept, self.spend = 0, "preparing", 1.0, 0, 0.0
        self.last = ""
        self.workers: list[dict] = []
        """A parallel run's workers: GPU, candidate, stage (agent/run/worker.py, agent/run/phases.py)."""
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        self.bar: tuple[str, int] | None = None
        """(what, rich task id) of the long step under way."""
        self.live = Live(self.render(), console=console, refresh_per_second=2, transient=False) if enabled else None

    def render(self) -> Group:
        return Group(self.table(), self.progress) if self.bar else Group(self.table())

    def track(self, event) -> None:
        """Start, advance or end the bar of the long step an event begins, continues or ends."""
        b, n = self.task.benchmark, getattr(event, "candidate", 0)
        starting = {"run_started": "baseline servers starting", "resumed": "baseline servers starting",
                    "build": f"candidate {n}: servers starting"}
        if event.kind in starting and not getattr(event, "finishing", ""):
            self.begin(starting[event.kind], None)
        elif event.kind == "sample":
            what = (f"candidate {n}: benchmark passes" if n else "baseline A/A: benchmark passes") + \
                (f" (confirmation {event.confirmation})" if event.confirmation else "")
            if self.bar is None or self.bar[0] != what:
                self.begin(what, 2 * b.repetitions)
            done = next(t for t in self.progress.tasks if t.id == self.bar[1]).completed + 1
            total = 2 * max(b.repetitions, b.max_repetitions or 0) if done > 2 * b.repetitions else 2 * b.repetitions
            self.progress.update(self.bar[1], completed=done, total=total)
        elif event.kind == "parity" and event.ok:
            self.begin(f"candidate {n}: production server, warmup", None)
        elif event.kind in ("self_parity", "parity", "benchmark", "audit", "decision", "run_finished"):
            self.end()

    def begin(self, what: str, total: int | None) -> None:
        self.end()
        self.bar = (what, self.progress.add_task(what, total=total))

    def end(self) -> None:
        if self.bar is not None:
            self.progress.remove_task(self.bar[1])
            self.bar = None

    def table(self) -> Table:
        budget = self.task.budget
        left_s = max(0.0, budget.wall_clock_s - (time.time() - self.started))
        table = Table(title=f"nightshift · {self.task.name}", show_header=False)
        table.add_row("candidate", f"{self.candidate} of {budget.max_candidates}")
        table.add_row("stage", self.stage)
        table.add_row("kept", str(self.kept))
        table.add_row("best speedup", f"{self.best:.3f}x")
        table.add_row("budget left", f"{budget.max_candidates - self.candidate} candidates, {left_s / 60:.1f} min"
                      + (f", ${self.spend:.4f} spent" if self.spend else ""))
        table.add_row("last", self.last)
        for w in self.workers:
            gpus = ",".join(map(str, w.get("gpus") or [])) or "-"
            table.add_row(f"worker {w['worker']}", f"GPU {gpus}: candidate {w.get('candidate') or '-'}, {w.get('stage')}")
        return table

    def show_workers(self, rows: list[dict]) -> None:
        self.workers = rows
        if self.live:
            self.live.update(self.render())

    def update(self, event) -> None:
        self.stage = phase_after(event).doing
        self.track(event)
        self.candidate = getattr(event, "candidate", self.candidate) or self.candidate
        if event.kind == "decision":
            self.last = f"#{event.candidate} {event.verdict} at {event.stage}: {event.reason[:90]}"
            if event.verdict == "keep":
                self.kept += 1
                self.best *= event.speedup
        if event.kind == "llm_call":
            self.spend += event.cost_usd
        if event.kind == "audit" and event.calibration:
            self.last = calibration_summary(event)
        if event.kind == "noise_floor":
            self.last = noise_line(event)
            if event.warning:
                self.console.print(f"[yellow]warning:[/yellow] {event.warning}")
        if event.kind == "resumed":
            self.started, self.kept, self.best = time.time() - event.spent_s, event.kept, event.best_speedup
            self.candidate = event.candidate or event.candidates_done
            self.last = f"resumed after record {event.after_seq + 1} ({event.after_event})"
        if self.live:
            self.live.update(self.render())
        else:
            shown = event.kind == "decision" or (event.kind == "audit" and event.calibration)
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {event.kind} {self.last if shown else ''}")

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.__exit__(*exc)
            if not self.console.is_terminal:  # rich ends the last frame with a newline only on a terminal
                self.console.line()
