"""The live view's bars, from the events a run writes, rendered by rich as a terminal would show them."""
from pathlib import Path

from rich.console import Console

from agent.world.task import load_task, with_overrides
from agent.face.view import LiveView
from traces.schema import Build, Decision, ParityReport, Sample, SampleTaken

ROOT = Path(__file__).resolve().parents[2]


def shown(view: LiveView) -> str:
    console = Console(record=True, width=140, force_terminal=True, color_system=None)
    console.print(view.render())
    return console.export_text()


def sample(role: str, repetition: int) -> Sample:
    return Sample(role=role, repetition=repetition, seconds=1.0, input_tokens=64, output_tokens=32,
                  total_tokens_per_s=96.0, output_tokens_per_s=32.0)


def test_server_starts_and_benchmark_passes_show_as_bars():
    task = with_overrides(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"),
                          benchmark={"repetitions": 4, "max_repetitions": 8})
    view = LiveView(task, Console(file=open("/dev/null", "w")), enabled=False)
    view.update(Build(candidate=3, tree="t", source_sha256="s", compiled_from="c", seconds=1.0))
    assert "candidate 3: servers starting" in shown(view)
    view.update(ParityReport(candidate=3, ok=True, regime="sequential", prompts=4, tokens_per_prompt=8, digest="d"))
    assert "candidate 3: production server, warmup" in shown(view)
    for i in range(3):
        view.update(SampleTaken(candidate=3, sample=sample("incumbent" if i % 2 == 0 else "candidate", i // 2)))
    text = shown(view)
    assert "candidate 3: benchmark passes" in text and "3/8" in text, text
    for i in range(3, 10):  # past `repetitions`: adaptive repetitions, up to max_repetitions pairs
        view.update(SampleTaken(candidate=3, sample=sample("incumbent", i // 2)))
    assert "10/16" in shown(view)
    view.update(SampleTaken(candidate=3, sample=sample("incumbent", 0), confirmation=1))
    assert "benchmark passes (confirmation 1)" in shown(view) and "1/8" in shown(view)
    view.update(Decision(candidate=3, verdict="discard", stage="benchmark", reason="not faster"))
    text = shown(view)
    assert "benchmark passes" not in text and "#3 discard at benchmark" in text


def test_a_parity_failure_ends_the_start_bar():
    view = LiveView(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"), Console(file=open("/dev/null", "w")),
                    enabled=False)
    view.update(Build(candidate=1, tree="t", source_sha256="s", compiled_from="c", seconds=1.0))
    view.update(ParityReport(candidate=1, ok=False, regime="sequential", prompts=4, tokens_per_prompt=8, digest="d"))
    assert "starting" not in shown(view) and "warmup" not in shown(view)


def test_output_after_the_live_view_begins_on_a_line_of_its_own_without_a_terminal():
    import io

    out = io.StringIO()
    console = Console(file=out, width=100)  # not a terminal: the live view prints its last frame once, at exit
    assert not console.is_terminal
    for events in ([], [Build(candidate=1, tree="t", source_sha256="s", compiled_from="c", seconds=1.0)]):
        out.seek(0), out.truncate()
        with LiveView(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"), console) as view:
            for event in events:
                view.update(event)
        console.print("summary")
        lines = out.getvalue().splitlines()
        assert "summary" in lines and lines[-2].strip() and "summary" not in lines[-2], out.getvalue()
