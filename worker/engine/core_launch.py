"""Starting the engine process (engine/core_proc.py), as early as the worker can.

`kvscale-worker serve --engine-process` calls `EngineProcess.spawn` before it imports the server
(torch, transformers, aiohttp: ~3 s here), so the engine process imports and loads the model while
the API process imports its own side; started from the server instead, the two imports ran one
after the other and Ready came 3 s later. Nothing heavy is imported here.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from kvscale.common.json_logging import JsonFormatter

ENGINE_MODULE = "kvscale.worker.engine.core_proc"


def log_settings() -> tuple[str, str]:
    """This process's log level and format, for the engine process to log the same way."""
    root = logging.getLogger()
    json_format = any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    return logging.getLevelName(root.getEffectiveLevel()), "json" if json_format else "text"


@dataclass
class EngineProcess:
    """A started engine process and the two ipc sockets of its private folder: it binds
    `to_engine` (its inbox) and connects to `from_engine` (the API process's inbox). ZMQ queues
    what either side sends before the other has bound."""

    proc: subprocess.Popen
    folder: str
    to_engine: str
    from_engine: str

    @classmethod
    def spawn(cls, args) -> EngineProcess:
        folder = tempfile.mkdtemp(prefix="kvscale-engine-")  # 0700: only this user reaches the sockets
        to_engine, from_engine = f"ipc://{folder}/in", f"ipc://{folder}/out"
        proc = subprocess.Popen([sys.executable, "-m", ENGINE_MODULE], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        level, fmt = log_settings()
        proc.stdin.write(pickle.dumps((args, to_engine, from_engine, os.getpid(), level, fmt)))
        proc.stdin.close()
        return cls(proc, folder, to_engine, from_engine)

    def remove_folder(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
