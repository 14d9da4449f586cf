"""Programs the e2e tests run on the host beside the control plane (Flux's controllers, KEDA's
operator and metrics adapter): started together, ready when each answers its readiness URL,
stopped when the block ends."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    """Whether url answers 200 (https: a local readiness probe, the certificate not checked)."""
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=insecure) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def processes(
    programs: dict[str, tuple[list[str], str]], env: dict[str, str], logs: Path, timeout: float = 90
) -> Iterator[dict[str, Path]]:
    """Each program (name -> (argv, readiness URL)) started with its output in logs/NAME.log;
    yields those paths once every URL answers 200 (raises with the log's tail when one exits or
    is not ready in `timeout` s); terminated, then killed, when the block ends."""
    logs.mkdir(parents=True, exist_ok=True)
    paths = {name: logs / f"{name}.log" for name in programs}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, (argv, _) in programs.items():
            with paths[name].open("wb") as log:
                procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        for name, (_, ready) in programs.items():
            while not answers(ready):
                for other, proc in procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{other} exited {proc.returncode}: {tail(paths[other])}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not ready in {timeout} s: {tail(paths[name])}")
                time.sleep(0.5)
        yield paths
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def tail(path: Path, size: int = 3000) -> str:
    return path.read_bytes()[-size:].decode(errors="replace")
