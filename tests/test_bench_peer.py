"""The llama.cpp peer benchmark (worker/bench/peer.py) without llama-server: its refusal without
the binary, its run order, llama-server's command line, its arithmetic and goals, and the client
extensions it needs (no usage chunk, a connection per request) against a stand-in SSE server."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvscale.worker.bench.__main__ import main
from kvscale.worker.bench.peer import (
    KVSCALE,
    LLAMA,
    OFFLINE,
    agreement_figures,
    evaluate_goals,
    llama_context_size,
    llama_server_command,
    matching_prefix,
    schedule,
    split_flags,
    summarize_level,
)
from kvscale.worker.bench.serve import free_port, run_level
from kvscale.worker.bench.workload import Workload


def test_without_llama_server_and_gguf_it_says_what_is_missing_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["peer", "--model", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--llama-server PATH" in err and "--gguf PATH" in err and "docs/benchmarks.md" in err
    with pytest.raises(SystemExit) as exit_:
        main(["peer", "--model", str(tmp_path), "--llama-server", str(tmp_path / "nope"), "--gguf", "x.gguf"])
    assert exit_.value.code == 2
    assert "nope: no such file" in capsys.readouterr().err


def test_engines_alternate_round_by_round_within_each_level():
    order = schedule([1, 8], 2, (KVSCALE, LLAMA, OFFLINE))
    assert order == [
        (1, 1, KVSCALE), (1, 1, LLAMA), (1, 1, OFFLINE),
        (1, 2, KVSCALE), (1, 2, LLAMA), (1, 2, OFFLINE),
        (8, 1, KVSCALE), (8, 1, LLAMA), (8, 1, OFFLINE),
        (8, 2, KVSCALE), (8, 2, LLAMA), (8, 2, OFFLINE),
    ]  # fmt: skip


def test_llama_server_command_gives_each_slot_room_for_the_longest_request():
    assert llama_context_size(8, 929) == 65536  # the default pool already holds 8 x 929
    assert llama_context_size(64, 1536) == 64 * 1536  # 1,024 a slot would cut these short
    cmd = llama_server_command("/bin/llama-server", "m.gguf", 8123, 32, 2, 65536, 2048, ["-ub", "256"])
    flag = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert cmd[0] == "/bin/llama-server" and flag["-m"] == "m.gguf" and flag["--port"] == "8123"
    assert (flag["-np"], flag["-t"], flag["-c"], flag["-b"]) == ("32", "2", "65536", "2048")
    assert "-cb" in cmd and "--no-webui" in cmd
    assert cmd[-2:] == ["-ub", "256"]  # extra flags last: llama.cpp takes the last value given
    assert split_flags(["--block-size 32", "--enforce-eager"]) == ["--block-size", "32", "--enforce-eager"]


def _http(tps: float, tpot: float, errors: int = 0) -> dict:
    return {"output_tokens_per_s": tps, "tpot_ms_p50": tpot, "tpot_ms_p99": 2 * tpot, "ttft_ms_p50": 5.0,
            "errors": errors}  # fmt: skip


def test_level_ratio_is_the_median_of_the_rounds_ratios():
    rounds = [
        {KVSCALE: _http(100, 10), LLAMA: _http(200, 4), OFFLINE: {"output_tokens_per_s": 120}},
        {KVSCALE: _http(150, 9), LLAMA: _http(100, 6), OFFLINE: {"output_tokens_per_s": 160}},
        {KVSCALE: _http(120, 8), LLAMA: _http(150, 5), OFFLINE: {"output_tokens_per_s": 140}},
    ]
    level = summarize_level(rounds)
    assert [r["ratio"]["output_tokens_per_s"] for r in level["rounds"]] == [0.5, 1.5, 0.8]
    assert level["ratio"] == {"output_tokens_per_s": 0.8, "tpot_ms_p50": 1.6, "served_over_offline": 0.857}
    # not 120/150 nor 9/5; served over offline: 100/120, 150/160, 120/140
    assert level["median"][KVSCALE]["output_tokens_per_s"] == 120
    assert level["median"][LLAMA]["tpot_ms_p99"] == 10
    assert level["median"][OFFLINE] == {"output_tokens_per_s": 140, "errors": 0}


def test_goals_bound_tpot_at_one_stream_from_above_and_tokens_per_s_from_below():
    def level(tps_ratio: float, *tpot_ratios: float, errors: int = 0, offline: float | None = None) -> dict:
        extra = {} if offline is None else {OFFLINE: {"output_tokens_per_s": offline}}
        return summarize_level(
            [
                {KVSCALE: _http(100 * tps_ratio, 10 * t, errors), LLAMA: _http(100, 10), **extra}
                for t in tpot_ratios
            ]
        )

    goals = evaluate_goals(
        {"1": level(0.3, 1.2, 1.1, 1.0), "8": level(0.99, 0.5, offline=100), "32": level(1.2, 1.0, errors=1)}
    )
    assert goals["tpot_p50_at_1_stream"]["met"] is True and goals["tpot_p50_at_1_stream"]["value"] == 1.2
    assert goals["tpot_p50_at_1_stream"]["goal"] == "<= 1.25 in every round"
    assert goals["tokens_per_s_at_8_streams"]["met"] is False
    assert goals["served_over_offline_at_8_streams"]["value"] == 0.99  # 99 served / 100 offline
    assert goals["served_over_offline_at_8_streams"]["met"] is True
    assert goals["tokens_per_s_at_32_streams"]["met"] is False  # faster, but a request failed
    assert goals["tokens_per_s_at_64_streams"] == {
        "concurrency": 64, "ratio": "output_tokens_per_s", "goal": ">= 1.0", "value": None, "met": None
    }  # fmt: skip
    assert goals["served_over_offline_at_64_streams"]["met"] is None
    # One round of three past the bound fails the one-stream goal, though the median is under it.
    assert evaluate_goals({"1": level(1.0, 1.0, 1.3, 1.1)})["tpot_p50_at_1_stream"]["met"] is False


def test_agreement_counts_the_matching_prefix_of_each_prompt():
    assert matching_prefix(["a", "b", "c"], ["a", "b", "d"]) == 2
    figures = agreement_figures([["a", "b", "c"], ["x", "y", "z"]], [["a", "b", "c"], ["x", "q", "z"]])
    assert figures["identical_prompts"] == 1 and figures["matching_prefix_per_prompt"] == [3, 1]
    assert figures["matching_prefix_tokens"] == 4 and figures["matching_prefix_fraction"] == round(4 / 6, 4)


async def _level_against_a_stream_without_usage(
    force_close: bool, probe_interval: float = 0.0
) -> tuple[dict, set]:
    """A stand-in server streaming one token per chunk and no usage chunk, with a /health and a
    /metrics; records the client port of each completion request (one port per connection)."""
    from aiohttp import web

    ports: set[int] = set()

    async def completions(request: web.Request) -> web.StreamResponse:
        ports.add(request.transport.get_extra_info("peername")[1])
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"text": f"t{i}", "index": 0, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)  # a token every 10 ms: the probes get their turns
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", lambda _: web.Response(text="ok"))
    app.router.add_get("/metrics", lambda _: web.Response(text="# no metrics\n"))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        workload = Workload([[0, 5], [0, 6], [0, 7], [0, 8]], [3, 5, 2, 4])
        level = await run_level(f"http://127.0.0.1:{port}", workload, 1, force_close, probe_interval)
    finally:
        await runner.cleanup()
    return level, ports


def test_client_counts_chunks_without_usage_and_can_open_a_connection_per_request():
    level, ports = asyncio.run(_level_against_a_stream_without_usage(force_close=True))
    assert level["errors"] == 0, level["error_samples"]
    assert level["output_tokens"] == 14 and level["tokens_counted_from_chunks"] == 4
    assert len(ports) == 4  # each request on its own connection
    _, ports = asyncio.run(_level_against_a_stream_without_usage(force_close=False))
    assert len(ports) == 1  # one at a time, kept alive: the default reuses it


def test_probes_run_only_when_asked():
    level, _ = asyncio.run(_level_against_a_stream_without_usage(False, probe_interval=0.01))
    assert level["errors"] == 0, level["error_samples"]
    assert set(level["probe_ms"]) == {"/health", "/metrics"}
    assert all(p["n"] >= 3 for p in level["probe_ms"].values()), level["probe_ms"]  # ~140 ms of streams
    level, _ = asyncio.run(_level_against_a_stream_without_usage(False, probe_interval=0.0))
    assert "probe_ms" not in level


def test_offline_engines_build_the_compiled_forward_before_any_round():
    """On a machine with no cached package, a compile behind ran through the measured rounds of a
    run (its llama.cpp round fell to an eighth): the benchmark's engines compile in the foreground."""
    from types import SimpleNamespace

    from kvscale.worker.bench.serve import offline_engine_args

    args = SimpleNamespace(
        max_num_batched_tokens=2048, num_kv_blocks=None, device="cpu", dtype="auto", stream_interval=1
    )
    assert offline_engine_args(args, 8)["compile_in_background"] is False
