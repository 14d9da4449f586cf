"""Start the real worker server (`kvscale-worker serve`) as a subprocess on a free port."""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvscale.worker.bench.serve import ServerProcess as BenchServerProcess
from kvscale.worker.bench.serve import free_port, serve_args, server_command

__all__ = ["ServerProcess", "free_port", "start_server"]


@dataclass
class ServerProcess(BenchServerProcess):
    """The benchmark's server handle (start, wait for /ready, SIGTERM then kill), plus what tests
    read: a GET, and the log."""

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def log(self) -> str:
        """The log's tail, for a failed assertion's message."""
        return self.log_path.read_text(errors="replace")[-5000:]

    def whole_log(self) -> str:
        """All of it, for what a test looks for: a process that exits with a daemon thread still
        running (a drain timeout's) has its thread stacks and the native libraries' exit noise
        (triton's nanobind leak report, ~5 KB) after the line a test wants."""
        return self.log_path.read_text(errors="replace")


def start_server(
    model: str, log_dir: Path, *extra_args: str, wait: bool = True, env: dict | None = None
) -> ServerProcess:
    """`extra_args` are CLI flags (e.g. "--api-key", "k", "--num-kv-blocks", "256")."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [*server_command(), *serve_args(model, port, extra_args)]
    proc = subprocess.Popen(
        cmd,
        stdout=log_path.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    server = ServerProcess(proc, port, log_path)
    if wait:
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    return server
