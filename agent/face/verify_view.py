"""Progress of `nightshift verify` in the terminal: one bar for the server starts, one for the grid's cells."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class VerifyProgress:
    def __init__(self, console: Console, enabled: bool = True):
        self.console, self.enabled = console, enabled
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, disable=not enabled)
        self.server_task = self.cell_task = None

    def __enter__(self) -> VerifyProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def servers(self, count: int) -> None:
        self.server_task = self.bar.add_task(f"starting {count} servers", total=count)

    def server_up(self, name: str) -> None:
        self.bar.update(self.server_task, advance=1, description=f"servers: {name} up")

    def cells(self, count: int) -> None:
        self.cell_task = self.bar.add_task("grid cells", total=count)

    def cell_started(self, cell) -> None:
        self.bar.update(self.cell_task, description=f"cell {cell.key}")

    def cell_done(self, result: dict) -> None:
        self.bar.update(self.cell_task, advance=1)
        if result["status"] == "skipped":
            line = f"{result['key']}: skipped ({result['reason']})"
        elif "speedup" in result:
            s = result["speedup"]["total_token_throughput"]
            line = (f"{result['key']}: {s['speedup']:.3f}x [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
                    + (" REGRESSION" if result["regression"] else "")
                    + (f" FAILED: {result['reason']}" if result["status"] == "failed" else ""))
        else:
            line = f"{result['key']}: failed ({result['reason']})"
        if self.enabled:
            self.bar.console.print(escape(line), soft_wrap=True, highlight=False)


class NoProgress:
    def servers(self, count: int) -> None: ...
    def server_up(self, name: str) -> None: ...
    def cells(self, count: int) -> None: ...
    def cell_started(self, cell) -> None: ...
    def cell_done(self, result: dict) -> None: ...
