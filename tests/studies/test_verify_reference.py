"""`nightshift verify` scores its token audit on a server that is neither side, as a run does."""
import git
import pytest

from agent.face.verify_view import NoProgress
from agent.studies.verify import checkout_target, verify
from tests.fake_sandbox import FakeSandbox
from tests.stand_in import REQUEST_TIMEOUT_S, fake_task, mode, stand_in_checkout

pytestmark = pytest.mark.serial  # serial: verify's cells are benchmarks of fake servers


@pytest.mark.slow
def test_verify_of_servers_that_rank_near_ties_each_their_own_way_passes_its_audit(fake_model, tmp_path):
    """Without parity servers of its own, verify scored the head's outputs on its baseline server, whose own
    outputs are the control: on a GPU, where each server's kernels rank near ties their own way, the baseline then
    leaves its top-1 nowhere and the head often, and an honest head fails (the noise study's H100 A/As failed so,
    h100-noise-20261207.md). These stand-ins rank half of the near ties per process; with the baseline as the
    reference (the old wiring, put back by hand) this test failed at the rate test."""
    checkout = stand_in_checkout(tmp_path / "seated", {"vllm/fake_mode.json": mode("exact", 0.01, process_flips=0.5)})
    repo = git.Repo(checkout)
    (checkout / "vllm" / "never_imported.py").write_text("X = 1\n")
    repo.git.add("-A")
    repo.git.commit("-qm", "a module no server imports")
    task = fake_task(checkout, fake_model, tmp_path, benchmark={"warmup_requests": 2, "repetitions": 4,
                                                                "request_timeout_s": REQUEST_TIMEOUT_S, "max_client_busy": 1.0})
    assert not task.parity.dedicated
    target = checkout_target(checkout, "HEAD~1", "HEAD", task, tmp_path / "runs")
    sandbox = FakeSandbox(tmp_path / "servers")
    data = verify(target, input_lens=[16], output_lens=[32], concurrency=[4], repetitions=4, progress=NoProgress(),
                  sandbox=sandbox, link=False)
    assert sorted(spec.name for spec in sandbox.started) == ["baseline", "head", "reference"]
    measured = [c for c in data["cells"] if c["status"] != "skipped"]
    assert measured
    for cell in measured:
        audit = cell["audit"]
        assert audit["passed"], audit["verdict"]
        # the flips are at work: the reference's ranking differs from the head's at many positions
        assert audit["deficits"]["non_top1"] > 0.05 * audit["tokens"], audit["deficits"]
