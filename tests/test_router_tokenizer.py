"""The router's tokenizer for the precise index (router/tokenizer.py): fetched from a real worker's
GET /v1/kvscale/tokenizer, it gives the worker's own token ids (a completion's text, a chat
conversation with the generation prompt, as the worker renders them), so its block hashes are the
worker's. The worker is a network peer: an answer with a path for a file name, too many files,
contents that are not base64 or a body past the cap is refused, and nothing is written outside
the temp folder."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import pytest

from kvscale.router.tokenizer import MAX_FILES, fetch_from_worker, write_tokenizer_files
from kvscale.worker.model.loader import load_tokenizer
from kvscale.worker.server.openai_serving import render_chat


def test_the_fetched_tokenizer_gives_the_workers_token_ids(server, target_model):
    async def fetch():
        async with aiohttp.ClientSession() as session:
            return await fetch_from_worker(session, server.base_url, {})

    router_side = asyncio.run(fetch())
    worker_side = load_tokenizer(target_model)
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    assert router_side.token_ids(False, {"prompt": text}) == worker_side.encode(text)
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": text},
        {"role": "assistant", "content": "It is slow."},
        {"role": "user", "content": "Make it fast."},
    ]
    assert router_side.token_ids(True, {"messages": messages}) == render_chat(worker_side, messages, True)
    assert router_side.token_ids(True, {"messages": messages, "add_generation_prompt": False}) == (
        render_chat(worker_side, messages, False)
    )
    assert router_side.token_ids(False, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert router_side.token_ids(True, {"messages": "not a list"}) is None


@pytest.mark.parametrize(
    "files",
    [
        {"../escape.json": "e30="},
        {"/etc/kvscale-owned": "e30="},
        {".hidden": "e30="},
        {"sub/dir.json": "e30="},
        {"tokenizer.json": "not base64!"},
        {"tokenizer.json": 5},
        {f"f{i}": "e30=" for i in range(MAX_FILES + 1)},
        {},
    ],
)
def test_a_hostile_tokenizer_answer_is_refused_and_writes_nothing_outside(files, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    with pytest.raises(ValueError):
        write_tokenizer_files(json.dumps({"files": files}).encode(), folder)
    assert not (tmp_path / "escape.json").exists()
    assert [p.parent for p in tmp_path.rglob("*") if p.is_file()] in ([], [folder])


def test_garbage_is_refused(tmp_path):
    for answer in (b"not json", b"[]", b'{"files": "x"}'):
        with pytest.raises(ValueError):
            write_tokenizer_files(answer, tmp_path)
    good = {"files": {"a.json": base64.b64encode(b"{}").decode()}}
    write_tokenizer_files(json.dumps(good).encode(), tmp_path)
    assert (tmp_path / "a.json").read_bytes() == b"{}"
