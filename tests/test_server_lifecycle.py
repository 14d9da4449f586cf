"""The worker's lifecycle over real HTTP: clients that leave abort their engine requests and give
their KV blocks back; SIGTERM drains (readiness and new requests 503, in-flight streams finish,
exit 0), and a drain that runs past --drain-timeout still ends every stream and exits 0. Then the
engine thread's edges, in process: shutdown, failures outside a step, the waiting count."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import ServerProcess, start_server

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine.async_llm import AsyncLLM, EngineDeadError
from kvscale.worker.sample.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n"  # shorter than a KV block: no prefix-cache sharing between requests

SMALL_POOL = ("--num-kv-blocks", "512")  # the CPU default (4 GiB) takes seconds to allocate

pytestmark = pytest.mark.slow


@dataclass
class Stream:
    """What one streaming completion delivered to its client."""

    chunks: int = 0
    completion_tokens: int | None = None  # from the final usage chunk
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]`
    cut: bool = False  # the server closed the connection mid-stream


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    max_tokens: int,
    disconnect_after: int | None = None,
    flowing: asyncio.Event | None = None,
) -> Stream:
    """Stream a completion; leave (close the connection) after `disconnect_after` chunks."""
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = Stream()
    async with session.post(base_url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        try:
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line.removeprefix(b"data: ").strip()
                if data == b"[DONE]":
                    stream.done = True
                    continue
                event = json.loads(data)
                if event.get("usage"):
                    stream.completion_tokens = event["usage"]["completion_tokens"]
                if not event["choices"]:
                    continue
                stream.chunks += 1
                stream.finish_reason = event["choices"][0]["finish_reason"] or stream.finish_reason
                if flowing is not None:
                    flowing.set()
                if disconnect_after is not None and stream.chunks >= disconnect_after:
                    response.close()  # drops the connection, as a client that goes away does
                    return stream
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            stream.cut = True
    return stream


def client() -> aiohttp.ClientSession:
    # No connection cap: every request needs its own connection to be in flight at once.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(server: ServerProcess) -> dict[tuple[str, frozenset], float]:
    status, body = server.get("/metrics")
    assert status == 200
    return parse_metrics(body.decode())


def metric(samples: dict, name: str, **labels: str) -> float:
    (value,) = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    return value


def exit_code_by(proc: subprocess.Popen, deadline: float) -> int | None:
    """The exit code, or None if the process still runs at `deadline` (time.monotonic)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(deadline - time.monotonic(), 0.01))
    return proc.poll()


def wait_ready_closely(server: ServerProcess, timeout: float = 300.0) -> str:
    """Poll /ready every few ms until it says 200; the server's log at that moment."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log()
        with contextlib.suppress(OSError):  # not listening yet
            if server.get("/ready")[0] == 200:
                return server.log_path.read_text(errors="replace")
        time.sleep(0.005)


@pytest.fixture(scope="module")
def roomy_server(target_model, tmp_path_factory):
    server = start_server(
        target_model, tmp_path_factory.mktemp("lifecycle"), *SMALL_POOL, "--max-num-seqs", "64", wait=False
    )
    try:
        server.log_when_ready = wait_ready_closely(server)
    except BaseException:
        server.stop()
        raise
    yield server
    assert server.stop() == 0, server.log()


def test_health_and_ready_when_idle(roomy_server):
    for path, expected in [("/health", "ok"), ("/ready", "ready")]:
        status, body = roomy_server.get(path)
        assert (status, json.loads(body)["status"]) == (200, expected)


def test_ready_only_once_the_start_up_is_done(roomy_server):
    # The server's start-up ends with a full garbage collection that holds the event loop (and so
    # every probe) for ~0.7 s, then logs "ready": /ready must not say 200 before it. (It did: the
    # first /health probes of bench hostile waited out that collection, issue 26.)
    assert '"msg": "ready"' in roomy_server.log_when_ready


def greedy_completion(server: ServerProcess) -> str:
    async def run() -> str:
        async with client() as session:
            body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
            async with session.post(server.base_url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return (await response.json())["choices"][0]["text"]

    return asyncio.run(run())


def test_disconnected_clients_abort_and_free_their_blocks(roomy_server):
    # Leavers ask for far more tokens than they wait for: however late a client reads its chunks,
    # its request is still running when it leaves (and only the abort can free its blocks).
    num_requests, max_tokens, leaver_max_tokens = 200, 128, 1000
    before = greedy_completion(roomy_server)
    finished_before = {
        reason: metric(scrape(roomy_server), "kvscale_requests_finished_total", finished_reason=reason)
        for reason in ("abort", "length")
    }

    async def load() -> list[Stream]:
        async with client() as session:
            url = roomy_server.base_url
            requests = [
                stream_completion(session, url, leaver_max_tokens, disconnect_after=3)
                if i % 2
                else stream_completion(session, url, max_tokens)
                for i in range(num_requests)
            ]
            return await asyncio.gather(*requests)

    streams = asyncio.run(load())
    kept, left = streams[::2], streams[1::2]
    assert [(s.chunks, s.done) for s in left] == [(3, False)] * len(left)
    for s in kept:
        assert s == Stream(s.chunks, completion_tokens=max_tokens, finish_reason="length", done=True)

    def finished(samples: dict, reason: str) -> float:
        return (
            metric(samples, "kvscale_requests_finished_total", finished_reason=reason)
            - finished_before[reason]
        )

    # The server notices a disconnect asynchronously: poll until the engine has settled.
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(roomy_server)
        settled = finished(samples, "abort") == len(left) and metric(samples, "kvscale_requests_running") == 0
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert finished(samples, "abort") == len(left)
    assert finished(samples, "length") == len(kept)
    assert metric(samples, "kvscale_kv_cache_usage_ratio") == 0
    assert metric(samples, "kvscale_requests_running") == 0
    assert metric(samples, "kvscale_requests_waiting") == 0

    assert greedy_completion(roomy_server) == before


async def flowing_streams(session, base_url: str, num_requests: int, max_tokens: int) -> list[asyncio.Task]:
    """Start streaming completions and return once every one of them has received tokens."""
    flowing = [asyncio.Event() for _ in range(num_requests)]
    tasks = [
        asyncio.create_task(stream_completion(session, base_url, max_tokens, flowing=f)) for f in flowing
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flowing)), 30)
    return tasks


async def poll_status(session, url: str, status: int, timeout: float = 5) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(url) as response:
            if response.status == status or time.monotonic() > deadline:
                assert response.status == status
                return await response.json()
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("engine", [(), ("--engine-process",)], ids=["engine-thread", "engine-process"])
def test_sigterm_drains_in_flight_streams(target_model, tmp_path, engine):
    drain_timeout, num_requests, max_tokens = 30, 8, 200
    server = start_server(target_model, tmp_path, *SMALL_POOL, "--drain-timeout", str(drain_timeout), *engine)
    try:

        async def scenario() -> tuple[list[Stream], float]:
            async with client() as session:
                tasks = await flowing_streams(session, server.base_url, num_requests, max_tokens)
                server.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                # The signal is handled asynchronously: readiness turns 503 soon after.
                ready = await poll_status(session, server.base_url + "/ready", 503)
                assert ready == {"status": "draining"}
                body = {"prompt": PROMPT, "max_tokens": 4}
                async with session.post(server.base_url + "/v1/completions", json=body) as response:
                    assert response.status == 503
                    error = (await response.json())["error"]
                assert (error["code"], error["type"]) == ("draining", "server_error")
                async with session.get(server.base_url + "/metrics") as response:
                    samples = parse_metrics(await response.text())
                assert metric(samples, "kvscale_requests_rejected_total", reason="draining") == 1
                assert not any(t.done() for t in tasks), "the streams ended before the checks ran"
                return await asyncio.wait_for(asyncio.gather(*tasks), drain_timeout), signalled

        streams, signalled = asyncio.run(scenario())
        for s in streams:
            complete = Stream(s.chunks, completion_tokens=max_tokens, finish_reason="length", done=True)
            assert s == complete
        assert exit_code_by(server.proc, signalled + drain_timeout + 5) == 0, server.log()
        assert '"msg": "drained"' in server.whole_log()
    finally:
        server.stop()


def test_drain_timeout_ends_streams_and_exits(target_model, tmp_path):
    drain_timeout, num_requests, max_tokens = 1, 4, 1500  # ~20 s of decoding, far past the timeout
    server = start_server(target_model, tmp_path, *SMALL_POOL, "--drain-timeout", str(drain_timeout))
    try:

        async def scenario() -> tuple[list[Stream], float]:
            async with client() as session:
                tasks = await flowing_streams(session, server.base_url, num_requests, max_tokens)
                server.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                return await asyncio.wait_for(asyncio.gather(*tasks), drain_timeout + 10), signalled

        streams, signalled = asyncio.run(scenario())
        assert exit_code_by(server.proc, signalled + drain_timeout + 5) == 0, server.log()
        for s in streams:
            assert s == Stream(s.chunks, cut=True), "the server must close streams it cannot finish"
        assert "drain timeout" in server.whole_log()
    finally:
        server.stop()


class _RacyWake(threading.Event):
    """The engine thread's wake-up, armed to let shutdown() land at the worst moment: just before
    the thread clears the wake-up (once it has looked at _stop, in the loop this test guards)."""

    def __init__(self, llm: AsyncLLM) -> None:
        super().__init__()
        self.llm, self.armed, self.landed = llm, False, threading.Event()

    def clear(self) -> None:
        if self.armed:
            self.armed = False
            self.landed.wait(5)
        super().clear()

    def set(self) -> None:
        super().set()
        if self.llm._stop:
            self.landed.set()


def test_shutdown_never_loses_its_wake_up(target_model):
    async def scenario() -> None:
        llm = AsyncLLM(EngineArgs(model=target_model, device="cpu", num_kv_blocks=64), "m")
        wake = llm._wake = _RacyWake(llm)
        await llm.start()
        await asyncio.sleep(0.1)  # the engine thread is idle, waiting for work
        wake.armed = True
        wake.set()  # a spurious wake-up: the thread loops and stops in clear()
        await asyncio.sleep(0.1)
        try:
            await asyncio.wait_for(llm.shutdown(), 5)
        finally:
            wake.armed, llm._stop = False, True
            super(_RacyWake, wake).set()  # free a thread that did sleep through shutdown()

    asyncio.run(scenario())


def test_an_engine_thread_failure_outside_a_step_fails_streams_and_liveness(target_model):
    """A bug in add/abort handling must not leave a silently dead engine thread behind streams that
    wait forever and a liveness probe that stays green."""

    async def scenario() -> None:
        llm = AsyncLLM(EngineArgs(model=target_model, device="cpu", num_kv_blocks=64), "m")
        await llm.start()
        try:

            def broken_abort(request_id: str) -> None:
                raise RuntimeError("a bug in abort")

            llm.engine.abort_request = broken_abort
            params = SamplingParams(max_tokens=1000, ignore_eos=True)
            leaving, staying = (
                llm.generate(PROMPT, params, "leaving"),
                llm.generate(PROMPT, params, "staying"),
            )
            await anext(leaving)
            await anext(staying)
            await leaving.aclose()  # the client leaves: its abort hits the bug in the engine thread
            with pytest.raises(EngineDeadError):
                async with asyncio.timeout(10):
                    async for _ in staying:
                        pass
            assert isinstance(llm.dead, RuntimeError)
        finally:
            await llm.shutdown()

    asyncio.run(scenario())


def test_the_event_loop_is_woken_only_by_steps_with_outputs(target_model):
    """Under --stream-interval most steps send nothing: the engine thread then leaves the event loop
    asleep instead of waking it for an empty hand-off (each wake-up costs both threads the GIL)."""

    async def scenario() -> None:
        args = EngineArgs(model=target_model, device="cpu", num_kv_blocks=64, stream_interval=4)
        llm = AsyncLLM(args, "m")
        handed: list[int] = []
        dispatch = llm._dispatch

        def counted(outputs) -> None:
            handed.append(len(outputs))
            dispatch(outputs)

        llm._dispatch = counted
        await llm.start()
        try:
            params = SamplingParams(max_tokens=21, ignore_eos=True)
            deltas = [o async for o in llm.generate(PROMPT, params, "r")]
        finally:
            await llm.shutdown()
        assert sum(len(d.outputs[0].token_ids) for d in deltas) == 21
        assert len(deltas) == 6, [len(d.outputs[0].token_ids) for d in deltas]  # 1, 4 x 5
        assert handed == [1] * 6, handed  # 21 decode steps, six hand-offs

    asyncio.run(scenario())


def test_queued_requests_are_counted_once(target_model):
    """The queue cap (429) reads num_waiting: a request the engine thread has taken into its queue,
    while the event loop has not yet heard back, must not be counted twice."""

    async def scenario() -> None:
        args = EngineArgs(model=target_model, device="cpu", num_kv_blocks=64, max_num_seqs=2)
        llm = AsyncLLM(args, "m")
        await llm.start()
        step = llm.engine.step

        def slow_step():
            outputs = step()
            time.sleep(0.05)  # a long forward pass: the event loop runs meanwhile
            return outputs

        llm.engine.step = slow_step
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True)

            async def consume(i: int) -> None:
                async for _ in llm.generate(PROMPT, params, f"r{i}"):
                    pass

            tasks = [asyncio.create_task(consume(i)) for i in range(8)]
            # (waiting, alive), sampled on the event loop as the server would. Alive: requests not
            # yet over for their client, whether still being made off the loop (counted as
            # waiting, not yet unfinished) or in the engine. Counted twice, waiting exceeds it.
            seen = []
            while not all(t.done() for t in tasks):
                seen.append((llm.num_waiting, sum(not t.done() for t in tasks)))
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)
            assert all(waiting <= alive for waiting, alive in seen), max(seen)
            assert max(seen)[0] > 0 and llm.num_waiting == 0
        finally:
            await llm.shutdown()

    asyncio.run(scenario())
