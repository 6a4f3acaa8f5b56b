"""The level of requests in flight over a pass (agent/stages/load.py `levels`), which the steady-state window and
the streaming level (`decoding_at_once`, read by the moved-by-code rule) both walk."""
from agent.stages.completions import Completion
from agent.stages.load import decoding_at_once, levels, steady_window


def streaming(first: float, done: float, sent: float = 0.0) -> Completion:
    return Completion(tokens=[1, 2], sent=sent, first_token=first, done=done, chunks=[(first, 1), (done, 1)])


def test_an_end_and_a_start_at_the_same_instant_do_not_add_up():
    assert levels([(0.0, 1.0), (1.0, 2.0)]) == [(0.0, 1), (1.0, 0), (1.0, 1), (2.0, 0)]
    assert levels([]) == []


def test_four_seats_read_four_and_a_late_read_end_does_not_raise_it():
    """Eight requests through four seats, two waves of 1 s; one end of the first wave read 0.05 s late while the
    second wave streams: the peak is 5, the level held for nine tenths of the time 4."""
    first_wave = [streaming(0.0, 1.0) for _ in range(3)] + [streaming(0.0, 1.05)]
    second_wave = [streaming(1.0, 2.0) for _ in range(4)]
    assert max(level for _, level in levels([(c.first_token, c.done) for c in first_wave + second_wave])) == 5
    assert decoding_at_once(first_wave + second_wave) == 4
    assert decoding_at_once([streaming(0.0, 1.0) for _ in range(16)]) == 16
    assert decoding_at_once([Completion(sent=0.0, done=1.0)]) == 0  # no token came: nothing streamed


def test_the_window_starts_where_the_level_first_reaches_the_lanes():
    done = [streaming(0.2, 1.0, sent=0.0), streaming(0.3, 1.5, sent=0.1), streaming(1.1, 3.0, sent=1.0)]
    assert (steady_window(done, [7, 7, 7], lanes=2).start, steady_window(done, [7, 7, 7], lanes=2).end) == (0.1, 1.5)
