"""The harness client against a real loopback server: concurrency is what the task says."""
import asyncio
import gc
import json

import pytest

from agent.stages.load import LoadClient
from agent.stages.completions import RequestError, complete_all, completion_body
from sandbox.base import Endpoint


pytestmark = pytest.mark.serial  # serial: the load client's busy share


class CountingServer:
    """Minimal HTTP/1.1 server: answers each completion with one SSE token after a short wait,
    and records the largest number of requests in flight."""

    def __init__(self):
        self.in_flight = self.peak = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = json.loads(await reader.readexactly(length))
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                await asyncio.sleep(0.3)
                self.in_flight -= 1
                first = body["prompt"][0] + 2
                events = "".join(f'data: {json.dumps({"choices": [{"token_ids": [first + i]}]})}\n\n'
                                 for i in range(body["max_tokens"])) + "data: [DONE]\n\n"
                payload = events.encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_more_than_a_default_pool_of_requests_are_in_flight():
    async def main():
        counting = CountingServer()
        server = await asyncio.start_server(counting.handle, "127.0.0.1", 0, backlog=1024)
        port = server.sockets[0].getsockname()[1]

        target = Endpoint(f"http://127.0.0.1:{port}")
        async with server:
            many = await complete_all(target, [[5, 6]] * 300, 3, 150, 30)
            peak_many = counting.peak
            counting.peak = 0
            one = await complete_all(target, [[5, 6]] * 5, 3, 1, 30)
        return many, peak_many, one, counting.peak

    many, peak_many, one, peak_one = asyncio.run(main())
    assert peak_many == 150 and peak_one == 1
    assert [c.tokens for c in many] == [[7, 8, 9]] * 300 and [c.tokens for c in one] == [[7, 8, 9]] * 5


def test_load_over_several_processes_keeps_prompt_order_and_the_total_concurrency():
    async def main():
        counting = CountingServer()
        server = await asyncio.start_server(counting.handle, "127.0.0.1", 0, backlog=1024)
        target = Endpoint(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        async with server:
            with LoadClient(3) as load:
                result = await load.run(target, [[10 + i, 0] for i in range(40)], 3, 8, 30)
        return result, counting.peak

    result, peak = asyncio.run(main())
    assert peak == 8  # lanes 3 + 3 + 2, never more
    assert [c.tokens for c in result.completions] == [[12 + i, 13 + i, 14 + i] for i in range(40)]
    assert all(c.ttft_ms >= 290 for c in result.completions)  # each process's clock, each request's own
    assert 0 < result.busy < 0.5 and result.cpu_s > 0


def test_a_failing_request_in_a_client_process_surfaces_as_a_request_error():
    async def main():
        with LoadClient(2) as load:
            await load.run(Endpoint("http://127.0.0.1:9"), [[5, 6]] * 4, 2, 4, 5)

    with pytest.raises(RequestError, match="ConnectError"):
        asyncio.run(main())


def test_the_completion_body_is_greedy_and_extra_fields_come_last():
    assert completion_body([5, 6], 3) == {"model": "model", "prompt": [5, 6], "max_tokens": 3, "temperature": 0.0,
                                          "ignore_eos": True, "return_token_ids": True, "stream": False, "seed": 0}
    body = completion_body([5], 1, stream=True, prompt_logprobs=1, seed=7)
    assert body["stream"] is True and body["prompt_logprobs"] == 1 and body["seed"] == 7


class QueueingServer:
    """Streams `tokens` tokens `gap_s` apart to at most `slots` requests at a time; the others wait without a
    byte (as vLLM queues requests beyond max_num_seqs). `frozen`: every stream stops after its first token."""

    def __init__(self, slots: int, tokens: int = 4, gap_s: float = 0.2, frozen: bool = False):
        self.slots, self.tokens, self.gap_s, self.frozen = asyncio.Semaphore(slots), tokens, gap_s, frozen

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            async with self.slots:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
                for i in range(self.tokens):
                    await asyncio.sleep(self.gap_s)
                    writer.write(f'data: {json.dumps({"choices": [{"token_ids": [5 + i]}]})}\n\n'.encode())
                    await writer.drain()
                    if self.frozen:
                        await asyncio.sleep(3600)
                writer.write(b"data: [DONE]\n\n")
                await writer.drain()
            writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def run_against(handler, prompts: int, stall_s: float):
    """(completions or None, RequestError or None, seconds); also checks that the call left no future or task
    whose failure nobody saw (asyncio logs those when they are collected, from wherever the collector runs)."""
    unseen = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: unseen.append(context) if "never retrieved" in context.get("message", "") else None)
        server = await asyncio.start_server(handler.handle, "127.0.0.1", 0, backlog=64)
        target = Endpoint(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        async with server:
            began = asyncio.get_running_loop().time()
            try:
                return await complete_all(target, [[5, 6]] * prompts, 4, None, 30, stall_s), None, \
                    asyncio.get_running_loop().time() - began
            except RequestError as exc:  # kept without its frames, which would keep the call's futures alive
                return None, exc.with_traceback(None), asyncio.get_running_loop().time() - began
    result = asyncio.run(main())
    gc.collect()
    assert unseen == [], [c.get("message") for c in unseen]
    return result


def test_a_request_queued_longer_than_the_stall_timeout_is_not_a_stall_while_others_stream():
    done, error, seconds = run_against(QueueingServer(slots=2, gap_s=0.2), prompts=8, stall_s=0.6)
    assert error is None and [c.tokens for c in done] == [[5, 6, 7, 8]] * 8
    assert max(c.ttft_ms for c in done) > 600  # the last ones waited past stall_s for their first token


def test_a_server_that_stops_streaming_fails_the_call_at_the_stall_timeout():
    done, error, seconds = run_against(QueueingServer(slots=8, gap_s=0.05, frozen=True), prompts=8, stall_s=0.6)
    assert done is None and "stalled: no token arrived on any of 8 streams" in str(error)
    assert 0.6 < seconds < 5


def test_the_stall_watch_does_not_hold_the_call_past_its_last_token():
    """The watch sleeps between its looks; the call must return when the work is done, not when it wakes."""
    done, error, seconds = run_against(QueueingServer(slots=8, gap_s=0.05), prompts=8, stall_s=20)
    assert error is None and len(done) == 8 and seconds < 0.9
