"""Reading a request body without letting it hurt the other requests.

A body is refused as soon as it is known not to fit the model (413), before it is buffered whole
when Content-Length says so, and always before JSON parsing, which holds the GIL (and with it the
event loop, the probes and every stream's output) for ~10 ms per MB; then it is parsed and
validated into its pydantic model (400 naming the first bad field).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvscale.common.errors import APIError

MAX_BODY_BYTES = 16 * 2**20  # aiohttp's client_max_size: no body is ever read past it


def _bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of text one token can stand for: the longest vocabulary
    entry in its stored form, which is never shorter than the text it decodes to (byte-level BPE
    stores each byte as one character of 1-2 bytes, SentencePiece's '▁' is 3 bytes for a space,
    byte fallback's '<0x41>' 6 for one byte)."""
    return max(len(t.encode()) for t in tokenizer.get_vocab())


def body_limits(num_prompts: int, max_prompt_bytes: int, max_model_len: int) -> tuple[int, int]:
    """(the largest body, the longest run of bytes without a double quote) that a request of up to
    `num_prompts` prompts can have and still fit the model. A prompt's text is at most
    max_prompt_bytes, JSON-escaped at most 6x (\\u0001); a token-id prompt at most max_model_len
    ids of a few digits; 1 MiB covers every other field. The body never exceeds MAX_BODY_BYTES."""
    token_ids = 16 * max_model_len
    body = min(MAX_BODY_BYTES, num_prompts * (6 * max_prompt_bytes + token_ids) + 2**20)
    return body, 6 * max_prompt_bytes + num_prompts * token_ids + 2**20


def has_quote_free_run(body: bytes, n: int) -> bool:
    """Whether `body` has a run of at least n bytes without a double quote (found for every run of
    2n or more: it holds one whole aligned window). Such a run lies inside one JSON string or
    between two, so past body_limits' run it is a prompt that cannot fit, or absurd padding. A few
    memchr calls: the JSON parser holds the GIL (and so the event loop) for ~10 ms per MB."""
    return any(body.find(b'"', start, start + n) == -1 for start in range(0, len(body) - n + 1, n))


def _too_large(what: str, limit: int) -> APIError:
    return APIError(
        413,
        f"the request {what} is over {limit} bytes, more than any request that fits this model's "
        "context can need",
        code="request_too_large",
    )


async def read_body(request: web.Request, limits: tuple[int, int]) -> bytes:
    """The body, refused (413) as soon as it is known not to fit: from Content-Length before reading
    anything, else while reading; then by its longest quote-free run, before any parsing."""
    limit, max_run = limits
    if request.content_length is not None and request.content_length > limit:
        raise _too_large("body", limit)
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise _too_large("body", limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    if len(body) > max_run and has_quote_free_run(body, max_run):
        raise _too_large("body has a string that", max_run)
    return body


async def parse_body(request: web.Request, model: type[BaseModel], limits: tuple[int, int]) -> Any:
    try:
        body = await read_body(request, limits)
        payload = json.loads(body.decode(request.charset or "utf-8"))
    except web.RequestPayloadError as e:  # e.g. a body that does not match its Content-Encoding
        raise _bad_request(f"the request body cannot be read: {e}") from None
    except LookupError as e:  # an unknown charset in Content-Type
        raise _bad_request(f"the request body's charset is unknown: {e}") from None
    except (ValueError, RecursionError) as e:  # also: not UTF-8, an int over 4300 digits, nested too deep
        raise _bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise _bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise _bad_request(f"{param}: {message}" if param else message, param=param) from None
