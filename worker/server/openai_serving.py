"""The OpenAI endpoints: /v1/completions and /v1/chat/completions, plain JSON or SSE streams.

A request becomes one engine request per prompt (each fanning out to `n` sequences). The engine
hands back deltas: a stream sends each on as an SSE event (`stream: true`), a plain response
accumulates them into OpenAI's JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvscale.worker.core.request import TokenLogprobs
from kvscale.worker.engine.async_llm import AsyncLLM, EngineDeadError
from kvscale.worker.engine.outputs import (
    CompletionOutput,
    RequestOutput,
    RequestOutputAccumulator,
    merge_completion,
)
from kvscale.worker.sample.sampling_params import SamplingParams
from kvscale.worker.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("kvscale.worker.requests")


@dataclass
class ServingConfig:
    served_model_name: str
    model_path: str
    max_queued_requests: int


def _bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


async def parse_body(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        payload = await request.json(loads=json.loads)
    except web.RequestPayloadError as e:  # e.g. a body that does not match its Content-Encoding
        raise _bad_request(f"the request body cannot be read: {e}") from None
    except web.HTTPClientError as e:  # aiohttp's own refusal, e.g. 413 for a body over client_max_size
        raise APIError(e.status, e.text or e.reason) from None
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


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, config: ServingConfig) -> None:
        self.llm = llm
        self.config = config
        self._token_text: dict[int, str] = {}

    @property
    def tokenizer(self):
        assert self.llm.engine is not None
        return self.llm.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        assert self.llm.engine is not None
        return self.llm.engine.max_model_len

    # -- shared checks -------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.config.served_model_name, self.config.model_path):
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_capacity(self, num_sequences: int) -> None:
        if self.llm.num_waiting + num_sequences > self.config.max_queued_requests:
            self.llm.metrics.rejected.inc(reason="queue_full")
            raise APIError(
                429,
                f"the server is at capacity ({self.llm.num_waiting} requests waiting); retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        limit = self.max_model_len
        if prompt_len > limit:
            raise _bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt_len} input tokens. Please reduce the length of the input.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return max(1, limit - prompt_len)
        if prompt_len + max_tokens > limit:
            raise _bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} for the "
                "completion). Please reduce the length of the input or the completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def make_params(self, build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except ValueError as e:
            raise _bad_request(str(e)) from None

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode()
            except UnicodeEncodeError as e:  # a lone surrogate: JSON can carry "\ud800"
                raise _bad_request(f"prompt is not valid Unicode: {e}", param="prompt") from None
            ids = self.tokenizer.encode(prompt)
        else:
            vocab = self.llm.engine.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise _bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = prompt
        if not ids:
            raise _bad_request("prompt must not be empty", param="prompt")
        return ids

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    # -- running the engine --------------------------------------------------------------------
    async def run(
        self, prompts: list[list[int]], params: list[SamplingParams], request_id: str
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts of one API request as they come: (prompt index, output)."""
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        gens = [self.llm.generate(p, sp, rid) for p, sp, rid in zip(prompts, params, ids, strict=True)]
        if len(gens) == 1:
            async with contextlib.aclosing(gens[0]) as gen:
                async for out in gen:
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        queue.put_nowait((i, out, None))
            except BaseException as e:
                queue.put_nowait((i, None, e))
                raise

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        try:
            done = 0
            while done < len(tasks):
                i, out, error = await queue.get()
                if error is not None:
                    raise error
                if out.finished:
                    done += 1
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        self.check_model(body.model)
        prompts = [self.encode(p) for p in body.prompts()]
        params = [
            self.make_params(
                lambda p=p: body.sampling_params(
                    self.resolve_max_tokens(len(p), body.max_tokens, "prompt"), body.logprobs
                )
            )
            for p in prompts
        ]
        self.check_capacity(len(prompts) * body.n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        echo_text = [self.tokenizer.decode(p, skip_special_tokens=True) if body.echo else "" for p in prompts]

        def choice(i: int, c: CompletionOutput, text: str, offset: int) -> dict[str, Any]:
            """`offset`: the text_offset of c's first token (from the start of the choice's text,
            echoed prompt included)."""
            logprobs = None
            if body.logprobs is not None and c.logprobs is not None:
                logprobs = self.completion_logprobs(c.logprobs, offset)
            return {
                "index": i * body.n + c.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }

        base = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.config.served_model_name,
        }
        if not body.stream:
            finals = await self._collect(self.run(prompts, params, request_id), len(prompts))
            choices = [
                choice(i, c, echo_text[i] + c.text, len(echo_text[i]))
                for i, out in enumerate(finals)
                for c in out.outputs
            ]
            choices.sort(key=lambda ch: ch["index"])
            self._log(request_id, "completions", finals)
            return web.json_response({**base, "choices": choices, "usage": usage(finals)})

        def first_delta(i: int, c: CompletionOutput) -> dict[str, Any] | None:
            # With echo, the prompt text goes out first, on its own.
            return (
                {**choice(i, c, echo_text[i], 0), "logprobs": None, "finish_reason": None}
                if body.echo
                else None
            )

        offsets: dict[tuple[int, int], int] = {}  # per choice: the text_offset of its next token

        def delta(i: int, c: CompletionOutput) -> dict[str, Any]:
            key = (i, c.index)
            offset = offsets.get(key, len(echo_text[i]))
            if c.logprobs:  # a running offset: each delta costs what it carries
                offsets[key] = offset + sum(len(self.token_text(lp.token_id)) for lp in c.logprobs)
            return choice(i, c, c.text, offset)

        return await self._stream(
            request, request_id, prompts, params, body.include_usage, base, first_delta, delta
        )

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        tokens = [self.token_text(lp.token_id) for lp in lps]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else [],
        }

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self.check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=True
            )
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise _bad_request(
                f"the chat template cannot render these messages: {e}", param="messages"
            ) from None
        prompt = list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)
        max_tokens = self.resolve_max_tokens(len(prompt), body.requested_max_tokens, "messages")
        params = self.make_params(lambda: body.sampling_params(max_tokens, body.num_logprobs))
        self.check_capacity(body.n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": request_id, "created": int(time.time()), "model": self.config.served_model_name}

        def logprobs(c: CompletionOutput) -> dict[str, Any] | None:
            if not body.logprobs or c.logprobs is None:
                return None
            return {"content": [self.chat_logprob(lp, body.top_logprobs or 0) for lp in c.logprobs]}

        if not body.stream:
            finals = await self._collect(self.run([prompt], [params], request_id), 1)
            choices = [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs(c),
                    "finish_reason": c.finish_reason,
                }
                for c in finals[0].outputs
            ]
            self._log(request_id, "chat", finals)
            return web.json_response(
                {**base, "object": "chat.completion", "choices": choices, "usage": usage(finals)}
            )

        def first_delta(i: int, c: CompletionOutput) -> dict[str, Any]:
            return {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }

        def delta(i: int, c: CompletionOutput) -> dict[str, Any]:
            return {
                "index": c.index,
                "delta": {"content": c.text} if c.text else {},
                "logprobs": logprobs(c),
                "finish_reason": c.finish_reason,
            }

        chunk = {**base, "object": "chat.completion.chunk"}
        return await self._stream(
            request, request_id, [prompt], [params], body.include_usage, chunk, first_delta, delta
        )

    def chat_logprob(self, lp: TokenLogprobs, top: int) -> dict[str, Any]:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}

    # -- plumbing ------------------------------------------------------------------------------
    async def _collect(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], n: int
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * n
        running: list[RequestOutputAccumulator | None] = [None] * n
        try:
            async for i, out in outputs:
                acc = running[i]
                if acc is None:
                    acc = running[i] = RequestOutputAccumulator(out)
                else:
                    acc.add(out)
                if out.finished:
                    finals[i] = acc.get()
        except EngineDeadError as e:
            raise APIError(500, str(e), type="server_error", code="engine_dead") from None
        except ValueError as e:  # the engine refused the request (it can never run)
            raise _bad_request(str(e)) from None
        return finals  # type: ignore[return-value]

    async def _stream(
        self,
        request: web.Request,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        include_usage: bool,
        base: dict[str, Any],
        first_delta: Callable[[int, CompletionOutput], dict[str, Any] | None],
        delta: Callable[[int, CompletionOutput], dict[str, Any]],
    ) -> web.StreamResponse:
        """SSE: one `data:` event per step with each choice's delta (new text, its logprobs), then
        `data: [DONE]`."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": request_id,
            }
        )
        opened: set[tuple[int, int]] = set()  # choices whose opening delta went out
        # Per choice, tokens whose text is still held back (an incomplete character, a possible
        # stop string): their logprobs go out with the text.
        held: dict[tuple[int, int], CompletionOutput] = {}
        closed: set[tuple[int, int]] = set()  # choices whose finish_reason went out
        finals: list[RequestOutput | None] = [None] * len(prompts)
        running: list[RequestOutputAccumulator | None] = [None] * len(prompts)  # for usage and the log

        async def write(data: bytes) -> None:
            # Headers go out with the first event, so a request the engine refuses is still a 400.
            if not response.prepared:
                await response.prepare(request)
            await response.write(data)

        async def send(payload: dict[str, Any]) -> None:
            await write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        try:
            async for i, out in self.run(prompts, params, request_id):
                firsts, choices = [], []
                for c in out.outputs:
                    key = (i, c.index)
                    if key not in opened:
                        opened.add(key)
                        first = first_delta(i, c)
                        if first is not None:
                            firsts.append(first)
                    if key in held:
                        c = merge_completion(held.pop(key), c)
                    if c.text or (c.finished and key not in closed):
                        choices.append(delta(i, c))
                        if c.finished:
                            closed.add(key)
                    else:
                        held[key] = c
                for group in (firsts, choices):  # the opening delta (role / echo) is a chunk of its own
                    if group:
                        await send({**base, "choices": group, **({"usage": None} if include_usage else {})})
                acc = running[i]
                if acc is None:
                    acc = running[i] = RequestOutputAccumulator(out)
                else:
                    acc.add(out)
                if out.finished:
                    finals[i] = acc.get()
        except EngineDeadError as e:
            await send(APIError(500, str(e), type="server_error", code="engine_dead").body())
            return response
        except ValueError as e:  # the engine refused the request before any output
            if response.prepared:
                raise
            raise _bad_request(str(e)) from None
        if include_usage:
            await send({**base, "choices": [], "usage": usage(finals)})
        await write(b"data: [DONE]\n\n")
        await response.write_eof()
        self._log(request_id, "stream", finals)
        return response

    def _log(self, request_id: str, endpoint: str, finals: list[RequestOutput | None]) -> None:
        done = [o for o in finals if o is not None]
        comps = [c for o in done for c in o.outputs]
        logger.info(
            "request finished",
            extra={
                "request_id": request_id,
                "endpoint": endpoint,
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in done),
                "completion_tokens": sum(len(c.token_ids) for c in comps),
                "finish_reasons": [c.finish_reason for c in comps],
                "ttft_s": min((c.metrics.time_to_first_token or 0.0 for c in comps), default=None),
                "e2e_s": max((c.metrics.e2e_latency or 0.0 for c in comps), default=None),
            },
        )


def usage(finals: list[RequestOutput | None]) -> dict[str, Any]:
    done = [o for o in finals if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in done)
    completion = sum(len(c.token_ids) for o in done for c in o.outputs)
    proposed = sum(c.num_draft_tokens for o in done for c in o.outputs)
    accepted = sum(c.num_accepted_tokens for o in done for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in done)},
        # OpenAI's fields for tokens a prediction supplied: here, speculative proposals.
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": proposed - accepted,
        },
    }
