"""The one table from event kind to stage (agent/run/phases.py), and the record of a dropped duplicate."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import get_args

from agent.face.view import LiveView
from agent.proposers.queue import QueueProposer
from agent.run.loop import DUPLICATE_TRIES, Loop, Slot
from agent.run.phases import AFTER, STAGES, phase_after, stage_after, stage_at_death
from agent.run.state import RunState
from agent.world.task import load_task
from traces.schema import AnyEvent, DuplicateDropped, Proposal, Record

ROOT = Path(__file__).resolve().parents[2]


def event_kinds() -> set[str]:
    return {cls.model_fields["kind"].default for cls in get_args(get_args(AnyEvent)[0])}


def test_every_event_kind_has_a_stage_in_the_one_table():
    assert event_kinds() - set(AFTER) == set()
    assert all(p.stage is None or p.stage in STAGES for p in AFTER.values())


def test_the_audit_shows_as_its_own_stage():
    benchmark = SimpleNamespace(kind="benchmark")
    assert phase_after(benchmark).doing == "auditing"
    assert stage_after(benchmark, "benchmark") == "audit"
    assert stage_at_death(stage_after(benchmark, "benchmark")) == "audit"
    assert stage_at_death("idle") == stage_at_death(None) == "start"
    assert stage_after(SimpleNamespace(kind="audit", calibration=True), "starting") == "starting"


def test_status_and_the_live_view_read_the_same_table(monkeypatch):
    import agent.face.ops as ops

    view = LiveView(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"), console=None, enabled=False)
    view.console = SimpleNamespace(print=lambda *a, **k: None)
    for kind in ("proposal", "build", "benchmark"):
        view.update(SimpleNamespace(kind=kind, candidate=1))
        assert view.stage == AFTER[kind].doing
    assert ops.phase_after is phase_after


class Repeating:
    """Proposes the same patch every time."""
    name, spend_usd = "queue", 0.0

    def propose(self, ctx):
        return Proposal(candidate=0, proposer="queue", summary="same", patch="diff", meta={"file": "1.patch"})


class OneSlotInFlight:
    remote = False

    def __init__(self):
        self.slots = [Slot(0, None, 0.0, candidate=1), Slot(1, None, 0.0)]

    def in_flight(self):
        return [(self.slots[0], 1)]

    def checkout(self, head):
        return Path(".")

    def incumbent_args(self, head):
        return {}


def test_each_dropped_duplicate_is_recorded_and_a_resumed_queue_takes_it_as_proposed(tmp_path):
    task = load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml")
    events: list = []
    loop = Loop.__new__(Loop)
    loop.s = SimpleNamespace(trace=SimpleNamespace(append=lambda e: events.append(e) or ""), branch_diff=lambda: "",
                             run_dir=tmp_path)
    loop.task, loop.proposer, loop.on_event, loop.head = task, Repeating(), lambda e: None, "abc"
    loop.slots, loop.redo, loop.results, loop.proposed_on = OneSlotInFlight(), [], {}, {}
    loop.state = RunState(task)
    loop.proposals = {1: Repeating().propose(None).model_copy(update={"candidate": 1})}
    assert loop.fill() is None  # nothing new to evaluate: the run ends as it did, but with a record of each
    records = [Record.model_validate_json(Record(seq=i, time=0.0, prev_sha256="", event=e).model_dump_json())
               for i, e in enumerate(events)]  # the record reads back as written
    dropped = [r.event for r in records]
    assert len(dropped) == DUPLICATE_TRIES and all(isinstance(e, DuplicateDropped) for e in dropped)
    assert {(e.candidate, e.duplicate_of, e.meta["file"]) for e in dropped} == {(2, 1, "1.patch")}

    folder = tmp_path / "patches"
    folder.mkdir()
    for name in ("1.patch", "2.patch"):
        (folder / name).write_text("Nightshift-Engine-Args: {max_num_seqs: 8}\n")
    queue = QueueProposer(folder)
    queue.restore(records)
    assert [p.name for p in queue.pending] == ["2.patch"]
