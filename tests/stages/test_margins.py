import pytest

from agent.stages.margins import margins_of, served_margins
from agent.world.numerics import Margins
from agent.stages.parity import ReferenceFailed
from agent.stages.completions import RequestError
from agent.world.task import Parity
from sandbox.base import Endpoint


def test_margin_is_top_one_minus_top_two_whatever_the_order():
    steps = [{"token_id:7": -2.5, "token_id:9": -0.5}, {"token_id:3": -1.0, "token_id:4": -1.0, "token_id:5": -4.0}]
    assert margins_of(steps) == [2.0, 0.0]


def test_a_position_with_one_logprob_is_an_error():
    with pytest.raises(RequestError, match="two top logprobs"):
        margins_of([{"token_id:7": -0.1}])


def test_summary_quantiles_and_share_below_a_tenth():
    summary = Margins.of([i / 10 for i in range(11)])
    assert (summary.median, summary.p10, summary.p90, summary.positions) == (0.5, 0.1, 0.9, 11)
    assert summary.below_0_1 == round(1 / 11, 4)


class Unreachable:
    name = "reference"
    endpoint = Endpoint("http://127.0.0.1:9")

    def client(self, timeout):
        return self.endpoint.client(timeout)

    def sync_client(self, timeout):
        return self.endpoint.sync_client(timeout)


def test_a_reference_that_dies_while_measuring_stops_the_run_and_is_named():
    parity = Parity(num_prompts=4, input_len=8, max_tokens=4, margin_prompts=2)
    with pytest.raises(ReferenceFailed, match="died while its margins were measured: ConnectError"):
        served_margins(Unreachable(), parity, vocab_size=4096, timeout_s=5)


def test_no_margin_prompts_measures_nothing():
    parity = Parity(num_prompts=4, input_len=8, max_tokens=4, margin_prompts=0)
    assert served_margins(Unreachable(), parity, vocab_size=4096, timeout_s=5) == (None, "")
