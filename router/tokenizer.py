"""The request's prompt as the worker's token ids, for the precise prefix index (kv_index.py).

The worker hashes token ids, so the router must produce the very ids the worker will: the same
tokenizer, loaded by the same library (transformers' AutoTokenizer, without torch), from the
model's tokenizer files: a folder (`--tokenizer DIR`), or, with `--tokenizer workers`, the files a
ready worker serves at GET /v1/kvscale/tokenizer (so the router needs no model volume: what the
operator deploys). Called the same way (worker/server/openai_serving.py: `encode`
for a text prompt, `apply_chat_template` for messages with the request's tools, generation prompt
flag and template kwargs). A prompt of token ids needs no tokenizer. Where the router's rendering
could differ from the worker's (messages the worker's protocol models normalize first), the
match is shorter, never wrong: a hash is of the whole prefix.

Cost: tokenizing runs in a thread (the fast tokenizer releases the GIL); the router's CPU per
request is measured by `bench route`'s precise policy. A prompt over `max_chars` characters (the
body limit bounds it anyway) is matched on its first `max_chars` only.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from kvscale.common.capped_body import TooLarge, read_capped

logger = logging.getLogger(__name__)

FROM_WORKERS = "workers"
# The answer's cap (base64 of the worker's 64 MiB cap, and the JSON around it), the file names it
# may carry (plain names: a worker is a network peer, and a name is a path here), and how many.
MAX_ANSWER_BYTES = 90 << 20
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MAX_FILES = 32


class PromptTokenizer:
    def __init__(self, path: str, max_chars: int = 1 << 20) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # the router image installs it with the precise index
            raise SystemExit(f"--tokenizer needs the transformers package: {e}") from None
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_chars = max_chars

    def token_ids(self, chat: bool, payload: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None (nothing to match: a batch, a malformed prompt, a
        conversation the template refuses; the worker answers those)."""
        if not chat:
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if isinstance(prompt, str) and prompt:
                return self.tokenizer.encode(prompt[: self.max_chars])
            return None
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        kwargs = payload.get("chat_template_kwargs")
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages,
                tools=payload.get("tools") or None,
                add_generation_prompt=payload.get("add_generation_prompt", True) is not False,
                tokenize=True,
                **(kwargs if isinstance(kwargs, dict) else {}),
            )
        except Exception:  # the worker's 400 is the client's answer
            return None
        return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)

    async def token_ids_async(self, chat: bool, payload: dict[str, Any]) -> list[int] | None:
        return await asyncio.get_running_loop().run_in_executor(None, self.token_ids, chat, payload)


def write_tokenizer_files(answer: bytes, folder: Path) -> None:
    """GET /v1/kvscale/tokenizer's answer into `folder`; ValueError for anything but plain file
    names and base64 contents (no path leaves the folder)."""
    try:
        files = json.loads(answer)["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a tokenizer answer: {e}") from None
    if not isinstance(files, dict) or not 0 < len(files) <= MAX_FILES:
        raise ValueError(f"a tokenizer answer has 1 to {MAX_FILES} files")
    for name, data in files.items():
        if not isinstance(name, str) or not FILE_NAME.fullmatch(name) or not isinstance(data, str):
            raise ValueError(f"refused tokenizer file name {name!r}")
        try:
            (folder / name).write_bytes(base64.b64decode(data, validate=True))
        except binascii.Error as e:
            raise ValueError(f"{name}: not base64: {e}") from None


async def fetch_from_worker(
    session: aiohttp.ClientSession, endpoint: str, headers: dict[str, str], timeout_s: float = 30.0
) -> PromptTokenizer:
    """The tokenizer a worker serves, loaded (in a thread) from a temp folder removed after."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(endpoint + "/v1/kvscale/tokenizer", headers=headers, timeout=timeout) as r:
        if r.status != 200:
            raise ValueError(f"HTTP {r.status}")
        answer = await read_capped(r, MAX_ANSWER_BYTES)

    def load() -> PromptTokenizer:
        with tempfile.TemporaryDirectory(prefix="kvscale-router-tokenizer-") as tmp:
            write_tokenizer_files(answer, Path(tmp))
            return PromptTokenizer(tmp)

    return await asyncio.get_running_loop().run_in_executor(None, load)


async def tokenizer_from_workers(
    session: aiohttp.ClientSession,
    endpoints: Callable[[], Iterable[str]],
    headers: dict[str, str],
    retry_s: float = 5.0,
) -> PromptTokenizer:
    """The first ready worker's tokenizer: each endpoint in turn, again every retry_s until one
    answers (until then, text and chat prompts are matched by the approximate index only)."""
    while True:
        for endpoint in sorted(endpoints()):
            try:
                tokenizer = await fetch_from_worker(session, endpoint, headers)
                logger.info("tokenizer loaded", extra={"endpoint": endpoint})
                return tokenizer
            except (aiohttp.ClientError, TimeoutError, TooLarge, ValueError, OSError) as e:
                logger.warning("tokenizer fetch failed", extra={"endpoint": endpoint, "error": repr(e)})
        await asyncio.sleep(retry_s)
