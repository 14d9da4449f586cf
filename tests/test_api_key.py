"""The API key check: constant-time comparison, and 401 for every wrong key whatever its length."""

from __future__ import annotations

import asyncio
import hmac
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvscale.worker.server.api_server import ServerConfig, api_key_matches, api_middleware

KEY = "s3cret-key"


def _app() -> web.Application:
    """The real middleware in front of one /v1 route, with just the state it reads for a GET."""
    app = web.Application(middlewares=[api_middleware])
    app["state"] = SimpleNamespace(config=ServerConfig(api_key=KEY), in_flight=0, idle=asyncio.Event())

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app.router.add_get("/v1/models", models)
    return app


def _statuses(headers: list[dict[str, str]]) -> list[int]:
    async def go() -> list[int]:
        async with TestClient(TestServer(_app())) as client:
            out = []
            for h in headers:
                async with client.get("/v1/models", headers=h) as r:
                    out.append(r.status)
            return out

    return asyncio.run(go())


def test_api_key_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    wrong_same_length = "x" * len(KEY)
    statuses = _statuses(
        [
            {"Authorization": f"Bearer {KEY}"},
            {"Authorization": f"Bearer {wrong_same_length}"},
            {"Authorization": "Bearer short"},
            {"Authorization": f"Bearer {KEY}-and-more"},
            {},
        ]
    )
    assert statuses == [200, 401, 401, 401, 401]
    # Every request went through hmac.compare_digest (bytes, so non-ASCII headers cannot raise).
    assert len(calls) == 5
    assert all(isinstance(a, bytes) and b == f"Bearer {KEY}".encode() for a, b in calls)


@pytest.mark.parametrize(
    "header, ok",
    [
        (f"Bearer {KEY}", True),
        (f"bearer {KEY}", False),
        (f"Bearer {KEY[:-1]}X", False),  # same length, last byte differs
        (KEY, False),
        ("", False),
        ("Bearer sécret\udcff", False),  # not ASCII, even a lone surrogate: False, not TypeError
    ],
)
def test_api_key_matches(header, ok):
    assert api_key_matches(header, KEY) is ok
