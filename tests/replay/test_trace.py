import pytest

from traces import TraceError, TraceWriter, read_trace
from traces.schema import Decision, Proposal, RunStarted


def started() -> RunStarted:
    return RunStarted(run_id="r", nightshift_version="0", vllm_version="0.32.0", torch_version="t",
                      python_version="3", platform="p", checkout="/c", base_commit="b" * 40, branch="nightshift/r",
                      model_sha256="m", task={"name": "x"})


def write(path, n=4):
    writer = TraceWriter(path)
    hashes = [writer.append(started())]
    for i in range(1, n):
        hashes.append(writer.append(Proposal(candidate=i, proposer="queue", summary=f"p{i}")))
    writer.close()
    return hashes


def test_chain_round_trip(tmp_path):
    path = tmp_path / "trace.jsonl"
    hashes = write(path)
    records = read_trace(path)
    assert [r.sha256 for r in records] == hashes
    assert records[1].prev_sha256 == hashes[0]
    assert records[3].event.summary == "p3"


def test_writer_resumes_the_chain(tmp_path):
    path = tmp_path / "trace.jsonl"
    hashes = write(path)
    writer = TraceWriter(path)
    writer.append(Decision(candidate=3, verdict="discard", stage="parity", reason="x"))
    records = read_trace(path)
    assert len(records) == 5 and records[4].prev_sha256 == hashes[-1]


def tampered(tmp_path, edit) -> TraceError:
    """Write a trace, change its lines with `edit`, and return the error reading it raises."""
    path = tmp_path / "trace.jsonl"
    write(path)
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(edit(lines)))
    with pytest.raises(TraceError) as err:
        read_trace(path)
    return err.value


@pytest.mark.parametrize("line", [1, 2, 3, 4])
def test_one_changed_byte_fails_at_its_line(tmp_path, line):
    def change_a_digit(lines):
        target = lines[line - 1]
        index = target.index(b'"time":') + 8
        digit = target[index:index + 1]
        lines[line - 1] = target[:index] + (b"9" if digit != b"9" else b"8") + target[index + 1:]
        return lines

    assert tampered(tmp_path, change_a_digit).line == line


def test_changed_prev_hash_fails_at_its_line(tmp_path):
    def change_prev_hash(lines):
        lines[2] = lines[2].replace(b'"prev_sha256":"', b'"prev_sha256":"0', 1)
        return lines

    assert tampered(tmp_path, change_prev_hash).line == 3


def test_dropped_line_breaks_the_chain(tmp_path):
    assert tampered(tmp_path, lambda lines: lines[:1] + lines[2:]).line == 2


def test_torn_last_line_is_reported(tmp_path):
    path = tmp_path / "trace.jsonl"
    write(path)
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(TraceError, match="torn last line") as err:
        read_trace(path)
    assert err.value.line == 4


def test_the_stage_order_is_the_loops_a_liveness_rejection_was_benchmarked():
    """The loop checks liveness on the server it has just benchmarked: the funnel counts such a candidate as
    benchmarked and not as audited, as it counts one rejected at the audit as benchmarked and built."""
    from agent.proposers.funnel import STAGES, got_through
    assert STAGES.index("parity") < STAGES.index("benchmark") < STAGES.index("liveness") < STAGES.index("audit")
    live = Decision(candidate=1, verdict="discard", stage="liveness", reason="patched files never imported")
    assert got_through(live, "benchmark") and got_through(live, "parity") and not got_through(live, "audit")
    audited = Decision(candidate=2, verdict="discard", stage="audit", reason="hard bound")
    assert got_through(audited, "benchmark") and not got_through(audited, "audit")


def test_a_sigterm_while_a_record_is_written_stops_after_it_and_the_closing_record_follows_it(tmp_path, monkeypatch):
    """What a spot host's notice can do: SIGTERM arrives while a record is being written (its bytes on disk, not yet
    counted). The run's handler stops the run only once the record is whole and counted, so the record the run
    closes with (a `finally`) follows it: no repeated sequence number, an unbroken chain."""
    import os
    import signal

    from agent.face.cli import _terminate
    from traces.log import TraceWriter as Writer

    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(path)
    writer.append(started())
    real_write = Writer._write

    def write_then_signalled(self, data):
        real_write(self, data)
        if b'"kind":"proposal"' in data:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before append has counted the record

    previous = signal.signal(signal.SIGTERM, _terminate)
    monkeypatch.setattr(Writer, "_write", write_then_signalled)
    try:
        with pytest.raises(SystemExit) as stopped:
            writer.append(Proposal(candidate=1, proposer="queue", summary="p1"))
        writer.append(Decision(candidate=1, verdict="timeout", stage="start", reason="stopped"))  # the closing one
    finally:
        signal.signal(signal.SIGTERM, previous)
        writer.close()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert [r.seq for r in read_trace(path)] == [0, 1, 2]


def test_a_stop_that_code_on_its_way_out_swallowed_is_raised_again_until_the_run_takes_it():
    """SIGTERM's handler raises SystemExit(143) wherever the harness is (traces.log.interrupt). Should code between
    there and the run's top swallow it, the next safe point (between benchmark passes, between candidates) raises it
    again; once the run's top has taken it, nothing is pending."""
    from traces import log

    stop = SystemExit(143)
    try:
        log.interrupt(stop)
    except SystemExit:
        pass  # swallowed on its way out
    with pytest.raises(SystemExit) as again:
        log.raise_pending()
    assert again.value is stop
    log.taken(SystemExit(1))  # another exception reaching the top leaves the stop pending
    with pytest.raises(SystemExit):
        log.raise_pending()
    log.taken(stop)
    log.raise_pending()  # delivered: nothing is raised
