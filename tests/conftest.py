"""Shared fixtures: the trained model pair from ../shared/models and tiny random models built in a
temporary folder through the same code path users take (Hugging Face folder -> our loader)."""

from __future__ import annotations

import os

import pytest
from model_fixtures import RANDOM_CONFIGS, TARGET

# Engines (and the servers tests start) run eagerly unless a test asks for the compiled forward:
# each compile takes tens of seconds on this CPU. tests/test_compiled_forward.py and the
# engine-vs-transformers tests run it (worker/model/compilation.py).
os.environ.setdefault("KVSCALE_ENFORCE_EAGER", "1")


@pytest.fixture
def shm_before():
    """Fails the test if it left anything in /dev/shm (a shared-memory segment, a named semaphore)."""
    before = set(os.listdir("/dev/shm"))
    yield before
    assert set(os.listdir("/dev/shm")) <= before, "left behind in /dev/shm"


@pytest.fixture(scope="session")
def target_model() -> str:
    if not TARGET.is_dir():
        pytest.skip(f"{TARGET} is missing")
    return str(TARGET)


@pytest.fixture(scope="session")
def random_model_factory(tmp_path_factory):
    """Builds (once per session) the random model named by a RANDOM_CONFIGS key."""
    from kvscale.worker.testing.tiny_model import build_tiny_model

    built: dict[str, str] = {}

    def build(name: str) -> str:
        if name not in built:
            tokenizer = TARGET if TARGET.is_dir() else None
            path = tmp_path_factory.mktemp(name)
            built[name] = str(
                build_tiny_model(path, tokenizer_from=tokenizer, seed=1, **RANDOM_CONFIGS[name])
            )
        return built[name]

    return build


@pytest.fixture(scope="session")
def server(target_model, tmp_path_factory):
    """One worker server on the target model for the whole session (tests must not break it)."""
    from server_fixtures import start_server

    proc = start_server(target_model, tmp_path_factory.mktemp("server"), "--num-kv-blocks", "1024")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    """The real `openai` client against the session's server (no retries: a failure shows)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(target_model) -> str:
    """The served model's name: the server serves the target under its path."""
    return target_model
