"""Tensor-parallel workers as real processes (`kvscale-worker serve`, gloo on CPU): TP = 2 across
two "hosts" (two servers with --nnodes 2 --node-rank 0/1 on 127.0.0.1) matches TP = 1, and a killed
rank makes the worker unhealthy and exit (and a killed worker its rank), with no process and nothing
in /dev/shm left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from process_fixtures import descendants, wait_gone
from server_fixtures import free_port, start_server

from kvscale.worker import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
NEW_TOKENS = 64
FLAGS = ("--num-kv-blocks", "64", "--max-model-len", "512")


def rank_pids(pid: int) -> list[int]:
    """The spawned rank processes under a worker (not multiprocessing's resource tracker)."""
    return [
        p
        for p in descendants(pid)
        if "spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
    ]


def complete(base_url: str, prompt: str, max_tokens: int = NEW_TOKENS) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["text"]


def wait_exit(server, timeout: float = 30.0) -> int:
    server.proc.wait(timeout)
    return server.proc.returncode


def test_two_hosts_match_tp1_and_a_killed_follower_rank_ends_both(target_model, tmp_path, shm_before):
    reference = LLM(target_model, device="cpu", num_kv_blocks=64, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].text for o in reference.generate(PROMPTS, params)]
    group = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(free_port()))
    follower = start_server(target_model, tmp_path, *FLAGS, *group, "--node-rank", "1", wait=False)
    try:
        leader = start_server(target_model, tmp_path, *FLAGS, *group, "--node-rank", "0")
    except BaseException:
        follower.stop()
        raise
    pids = (
        {leader.proc.pid, follower.proc.pid} | descendants(leader.proc.pid) | descendants(follower.proc.pid)
    )
    try:
        follower.wait_ready(60)
        assert follower.get("/health")[0] == 200
        assert follower.get("/v1/models")[0] == 404  # a follower serves the probes only
        assert rank_pids(leader.proc.pid) == []  # one rank per node: the leader is rank 0 itself
        assert [complete(leader.base_url, p) for p in PROMPTS] == expected

        (rank1,) = rank_pids(follower.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert wait_exit(follower) == 1, follower.log()
        # The idle leader learns at its next ping of the ranks (a broadcast to a closed socket fails
        # at once): no request needed.
        assert wait_exit(leader, timeout=15) == 1, leader.log()
        assert "tensor-parallel group broken" in leader.whole_log()
        wait_gone(pids)
    finally:
        follower.stop()
        leader.stop()


# Rank 0 in the server's thread, or in its engine process (engine/core_proc.py): the ranks are then
# the engine process's children, and a dead rank ends it, then the server.
ENGINE = pytest.mark.parametrize(
    "engine", [(), ("--engine-process",)], ids=["engine-thread", "engine-process"]
)


@ENGINE
def test_killed_rank_fails_health_and_the_worker_exits(target_model, tmp_path, shm_before, engine):
    server = start_server(target_model, tmp_path, *FLAGS, "--tensor-parallel-size", "2",
                          "--master-port", str(free_port()), *engine)  # fmt: skip
    try:
        pids = {server.proc.pid} | descendants(server.proc.pid)
        (rank1,) = rank_pids(server.proc.pid)
        assert server.get("/health")[0] == 200
        assert complete(server.base_url, PROMPTS[0])
        # Mid-run: a long request is decoding when the rank dies; it fails, it does not hang.
        outcome = []

        def long_request():
            try:
                outcome.append(complete(server.base_url, PROMPTS[1], max_tokens=400))
            except (urllib.error.URLError, OSError) as e:
                outcome.append(e)

        client = threading.Thread(target=long_request)
        client.start()
        time.sleep(1.5)
        os.kill(rank1, signal.SIGKILL)
        deadline, status = time.monotonic() + 10, 200
        while status == 200 and time.monotonic() < deadline:  # no request needed: the monitor sees it
            try:
                status = server.get("/health")[0]
            except OSError:  # already exited
                break
            time.sleep(0.05)
        assert status != 200
        assert wait_exit(server) == 1, server.log()
        client.join(30)
        assert outcome and isinstance(outcome[0], Exception), outcome
        wait_gone(pids)
    finally:
        server.stop()


@ENGINE
def test_sigterm_stops_every_rank_and_exits_0(target_model, tmp_path, shm_before, engine):
    server = start_server(target_model, tmp_path, *FLAGS, "--tensor-parallel-size", "2",
                          "--master-port", str(free_port()), *engine)  # fmt: skip
    try:
        pids = {server.proc.pid} | descendants(server.proc.pid)
        assert len(rank_pids(server.proc.pid)) == 1
        assert complete(server.base_url, PROMPTS[1])
    finally:
        code = server.stop()
    assert code == 0, server.log()
    wait_gone(pids)
    log = server.log_path.read_text()
    assert "tensor-parallel rank 1 stopped" in log  # it left, not killed
    # ... having read its steps from rank 0's shared-memory ring (one host), none over gloo.
    steps = re.search(r"tensor-parallel rank 1 stopped \(steps (\d+) over shared memory\)", log)
    assert steps and int(steps[1]) >= NEW_TOKENS, log[-3000:]


def test_killed_worker_takes_its_ranks_and_leaves_nothing(target_model, tmp_path, shm_before):
    """kill -9 of rank 0's process, mid-idle: its rank dies with it and nothing is left, in /dev/shm
    either (the step ring has no name to leave)."""
    server = start_server(target_model, tmp_path, *FLAGS, "--tensor-parallel-size", "2",
                          "--master-port", str(free_port()))  # fmt: skip
    try:
        pids = {server.proc.pid} | descendants(server.proc.pid)
        assert len(rank_pids(server.proc.pid)) == 1
        assert complete(server.base_url, PROMPTS[0], max_tokens=8)
        os.kill(server.proc.pid, signal.SIGKILL)
        assert wait_exit(server) == -signal.SIGKILL
        wait_gone(pids)  # rank 1 and multiprocessing's resource tracker too
    finally:
        server.stop()
