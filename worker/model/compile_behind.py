"""Compile behind: build the compiled forward's package while the worker serves eagerly.

The build is `kvscale-worker compile` in a child process, not a thread: exporting and lowering the
graphs is a minute of Python that would hold the GIL against the engine thread's own Python
(scheduling, sampling, the server), and a process can be made nice as a whole, g++ included
(`compile_nice`; docs/engine.md has the measurement behind the default). The child needs the model's
config only (weights are never read: the package holds code). Its progress lines go to this
worker's log. When it exits, a thread here loads the package (a fraction of a second, no forward
runs) and leaves it in `result`; the engine thread installs it between two steps.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def compile_command(
    model: str, dtype: str, block_size: int, cache_dir: Path, nice: int, lora: bool = False
) -> list[str]:
    return [
        sys.executable, "-m", "kvscale.worker.cli", "--log-format", "text", "compile",
        "--model", model, "--dtype", dtype, "--block-size", str(block_size),
        "--compile-cache-dir", str(cache_dir), "--nice", str(nice),
        *(["--enable-lora"] if lora else []),
    ]  # fmt: skip


class BackgroundCompile:
    """One child building the package and a thread that waits for it, then calls load(folder)
    (-> the compiled forward) and keeps what it returns in `result`."""

    def __init__(self, command: list[str], load) -> None:
        self.command = command
        self.load = load
        self.started = time.monotonic()
        self.result = None  # the compiled forward, once built and loaded
        self.seconds: float | None = None  # start of the build to loaded
        self.error: str | None = None
        self.done = threading.Event()
        self.on_done = None  # called (from the waiting thread) once done is set: wakes an idle engine
        env = dict(os.environ)
        # One g++ at a time, and no pool of compile workers to start (each a Python process): the
        # build is one .so per graph, and it is meant to take the cores serving leaves over.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, text=True, start_new_session=True,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._wait, name="kvscale-compile", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        last = ""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip()
            if line:
                last = line
                logger.info("compile: %s", line)
        code = self.process.wait()
        try:
            if code != 0:
                raise RuntimeError(f"kvscale-worker compile exited {code}: {last}")
            folder = Path(last.rsplit(" ", 1)[-1])  # its last line names the package's folder
            self.result = self.load(folder)
            self.seconds = time.monotonic() - self.started
        except Exception as e:  # a broken toolchain must not keep the worker from serving
            self.error = str(e)
            logger.warning("the compiled forward could not be built; the forward stays eager: %s", e)
        finally:
            self.done.set()
            if self.on_done is not None:
                self.on_done()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def stop(self) -> None:
        """End the child (the worker is going away)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
