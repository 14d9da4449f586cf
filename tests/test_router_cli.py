"""`kvscale-router` as a process: the console script serves, drains on SIGTERM, loads no torch."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from test_router_server import BODY, SSE, StandInWorker, serving

from kvscale.router.main import build_parser, build_router


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_router_package_loads_no_torch():
    code = (
        "import sys, kvscale.router.main, kvscale.router.server\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_flags_reach_the_picker_and_the_server():
    args = build_parser().parse_args(
        ["--endpoints", "http://a:1,http://b:1", "--prefix-weight", "5", "--load-factor", "1.5",
         "--max-queued", "7", "--policy", "round-robin", "--block-chars", "32"]
    )  # fmt: skip
    r = build_router(args)
    assert r.state.config.weights.prefix == 5 and r.state.config.load_factor == 1.5
    assert r.state.policy == "round-robin" and r.config.max_queued == 7 and r.config.block_chars == 32
    assert r.source.urls == ["http://a:1", "http://b:1"]


def test_the_console_script_serves_and_exits_0_on_sigterm():
    async def main():
        w = StandInWorker()
        async with serving(w.app()) as wurl:
            port = _free_port()
            exe = Path(sys.executable).with_name("kvscale-router")
            cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "kvscale.router.main"]
            proc = subprocess.Popen(
                [
                    *cmd,
                    "--endpoints",
                    wurl,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-format",
                    "text",
                ],
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                base = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession() as s:
                    deadline = time.monotonic() + 30
                    while True:
                        try:
                            async with s.get(base + "/ready") as r:
                                if r.status == 200:
                                    break
                        except aiohttp.ClientError:
                            pass
                        assert proc.poll() is None and time.monotonic() < deadline
                        await asyncio.sleep(0.1)
                    async with s.post(base + "/v1/completions", json=BODY) as r:
                        assert r.status == 200 and await r.read() == b"".join(SSE)
            finally:
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            assert "Traceback" not in err, err

    asyncio.run(main())
