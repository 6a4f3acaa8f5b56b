"""The run's state: one budget check for the loop and the Ray coordinator, and a typed end whose recorded reason is
the text traces have always held (old traces replay, `status` and the report read it)."""
import time
from pathlib import Path

import pytest
import typer

from agent.face.cli import run_loop
from agent.proposers.base import ProposerExhausted
from agent.run.state import End, RunState
from agent.world.task import load_task, with_overrides
from tests.stand_in import new_file_patch, mode
from traces import read_trace

ROOT = Path(__file__).resolve().parents[2]


def task(**budget):
    return with_overrides(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"),
                          budget={"max_candidates": 3, "wall_clock_s": 60, **budget})


def test_each_end_reads_as_the_reason_traces_hold():
    assert End("candidates").reason == "budget: candidates"
    assert End("wall_clock").reason == "budget: wall clock"
    assert End("gpu_hours").reason == "budget: GPU-hours"
    assert End.of_proposer(ProposerExhausted("queue empty")).reason == "proposer exhausted: queue empty"
    failed = End.of_proposer(ProposerExhausted("bad key", kind="fatal"))
    assert failed.reason == "proposer failed: bad key" and failed.failed
    assert End.of_exception(SystemExit(128 + 15)) == End("stopped", "stopped by SIGTERM")
    assert End.of_exception(ValueError("x")) == End("error", "error: ValueError: x")
    assert End("finishing", "budget spent before the kill").reason == "budget spent before the kill"
    assert not any(End(kind).failed for kind in ("candidates", "wall_clock", "proposer_exhausted", "error"))


def test_one_budget_check_counts_candidates_then_the_clock_then_gpu_hours():
    state = RunState(task(max_gpu_hours=1.0), gpu_hours=lambda: 2.0)
    assert state.over_budget(3) == End("candidates")
    assert state.over_budget(2) == End("gpu_hours")
    state.began = time.time() - 61  # a resumed run's clock counts what it spent before
    assert state.over_budget(3) == End("candidates") and state.over_budget(2) == End("wall_clock")
    # a coordinator that may still measure a recorded candidate again asks for the clock and GPU-hours alone
    assert state.over_budget(None) == End("wall_clock")
    fresh = RunState(task())
    assert fresh.over_budget(0) is None and fresh.over_budget(None) is None


def test_keeps_multiply_the_best_speedup_and_the_record_carries_the_end():
    state = RunState(task())
    state.keep(1.5)
    state.keep(1.2)
    state.end = End("wall_clock")
    finished = state.finished("abc", 0.25)
    assert (finished.kept, round(finished.best_speedup, 6), finished.reason) == (2, 1.8, "budget: wall clock")
    assert finished.head_commit == "abc" and finished.spend_usd == 0.25 and not finished.resumable


class FailingProposer:
    """A proposer whose endpoint refuses the key: the run cannot do its work."""
    name, spend_usd = "failing", 0.0

    def propose(self, ctx):
        raise ProposerExhausted("the endpoint refused the API key", kind="fatal")

    def observe(self, attempt):
        pass

    def restore(self, records):
        pass


def test_a_failed_proposer_ends_the_run_with_exit_1_read_from_its_kind(run):
    setup, loop = run({"1.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact"), "x")})
    with pytest.raises(typer.Exit) as stopped:
        run_loop(setup, FailingProposer(), quiet=True, sandbox=loop.pool.sandbox)
    assert stopped.value.exit_code == 1
    finished = read_trace(setup.run_dir / "trace.jsonl")[-1].event
    assert finished.kind == "run_finished" and finished.reason == "proposer failed: the endpoint refused the API key"
    assert finished.candidates == 0 and not finished.resumable
