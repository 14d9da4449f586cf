"""The OpenAI endpoints: /v1/completions and /v1/chat/completions, plain JSON or SSE streams.

A request becomes one engine request per prompt (each fanning out to `n` sequences). The engine
hands back deltas: a stream sends each on as an SSE event (`stream: true`), a plain response
accumulates them into OpenAI's JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from aiohttp import web

from kvscale.common.request_body import body_limits, longest_token_bytes, parse_body
from kvscale.worker.engine.async_llm import AsyncLLM, EngineDeadError
from kvscale.worker.engine.llm_engine import RequestFailedError
from kvscale.worker.engine.outputs import (
    CompletionOutput,
    RequestOutput,
    RequestOutputAccumulator,
    add_delta,
    merge_completion,
)
from kvscale.worker.lora.request import LoRARequest
from kvscale.worker.sample.logprobs import TokenLogprobs
from kvscale.worker.sample.sampling_params import SamplingParams
from kvscale.worker.server.protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)
from kvscale.worker.server.tool_calls import (
    Extractor,
    NamedFunctionExtractor,
    RequiredExtractor,
    ToolCallStream,
)
from kvscale.worker.server.tool_calls import finish_reason as tool_finish_reason
from kvscale.worker.server.tool_parsers import TOOL_CALL_PARSERS
from kvscale.worker.structured_output.compile_pool import PoolFull
from kvscale.worker.structured_output.manager import GrammarHandle
from kvscale.worker.structured_output.request import GrammarCompileTimeout

logger = logging.getLogger("kvscale.worker.requests")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3, Qwen) writes each byte of a token as one printable character:
    printable Latin-1 bytes as themselves, the others as U+0100 onwards in byte order. The
    inverse map, character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shown = {b: b for b in printable}
    for b in range(256):
        if b not in shown:
            shown[b] = 256 + len(shown) - len(printable)
    return {chr(c): b for b, c in shown.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(tokenizer) -> set[str]:
    """The tokenizers decoder types of a fast tokenizer ("ByteLevel", "ByteFallback", ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return {d.get("type", "") for d in [decoder, *decoder.get("decoders", [])]}


def token_bytes(tokenizer, token_id: int, kinds: set[str]) -> bytes:
    """The raw bytes a token stands for, also when it is only part of a UTF-8 character (its
    decoded text is then U+FFFD, whose bytes say nothing). Byte-level BPE maps its alphabet back;
    SentencePiece byte fallback turns <0xNN> into the byte and the word marker into a space; added
    and special tokens are their text. Anything else falls back to the decoded text's UTF-8."""
    if token_id in getattr(tokenizer, "added_tokens_decoder", {}):
        return tokenizer.decode([token_id]).encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if "ByteLevel" in kinds and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if "ByteFallback" in kinds:
            m = _BYTE_FALLBACK.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()
    return tokenizer.decode([token_id]).encode()


def top_logprobs_by_text(top: list[tuple[int, float]], text: Callable[[int], str]) -> dict[str, float]:
    """Completions' top_logprobs maps token text to logprob. Distinct tokens can share a text (two
    halves of UTF-8 characters both decode to U+FFFD; a special token and the same characters as
    plain text): the most likely keeps the text as its key, later ones get vLLM's
    `token_id:<id>` spelling, so no entry is merged away."""
    out: dict[str, float] = {}
    for token_id, value in top:
        key = text(token_id)
        out[key if key not in out else f"token_id:{token_id}"] = value
    return out


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids: the tokenizer's chat template over the messages (tool calls and tool
    answers included), the tools (a template that does not read `tools` leaves them out) and the
    request's `chat_template_kwargs` as template variables (protocol.py refuses the reserved ones)."""
    try:
        encoded = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            **(template_kwargs or {}),
        )
    except Exception as e:  # a template that rejects the conversation (e.g. role order)
        raise _bad_request(f"the chat template cannot render these messages: {e}", param="messages") from None
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


@dataclass
class ServingConfig:
    served_model_name: str
    model_path: str
    max_queued_requests: int
    tool_call_parser: str | None = None  # reads `tool_choice: "auto"` calls (tool_parsers.py)
    # A non-streamed answer's bound in token entries (unstreamed_entries); None: the default below.
    max_unstreamed_entries: int | None = None


def default_unstreamed_budget(max_model_len: int) -> int:
    """A non-streamed answer's default bound in token entries: n=1 with logprobs 5 over the whole
    context fits (6 x max_model_len), and never under 2^20 entries (~100 MB of JSON with top
    logprobs, chat's `bytes` lists included)."""
    return max(1 << 20, 8 * max_model_len)


def unstreamed_entries(max_tokens: list[int], n: int, logprobs: int) -> int:
    """What a non-streamed answer holds until its end, and serializes at once: every sequence's
    tokens, each with its logprobs entries (prompts x n x max_tokens x (1 + logprobs))."""
    return sum(max_tokens) * n * (1 + logprobs)


def bound_unstreamed(
    max_tokens: list[int], n: int, logprobs: int, given: bool, budget: int, param: str
) -> list[int]:
    """Each prompt's max_tokens for a non-streamed answer within `budget`: a default (not `given`)
    max_tokens is lowered to fit, as it is to fit the context; a given one past it is a 400 that
    asks for a stream (which holds one step's tokens at a time)."""
    if unstreamed_entries(max_tokens, n, logprobs) <= budget:
        return max_tokens
    if not given:
        per_sequence = max(1, budget // (len(max_tokens) * n * (1 + logprobs)))
        return [min(m, per_sequence) for m in max_tokens]
    raise _bad_request(
        f"a non-streamed answer of prompts x n x {param} x (1 + logprobs) = {len(max_tokens)} x {n} x "
        f"{max(max_tokens)} x {1 + logprobs} token entries is more than this server holds for one "
        f"answer ({budget}); send stream: true, or lower {param}, n or logprobs",
        param=param,
    )


def client_key(request: web.Request) -> str:
    """Whom a request's grammar compiles are counted against (fair share of the compile pool): its
    API key when it sends one (hashed: never kept in the clear), else its peer address. Behind the
    router every request shares the router's address unless it carries a key."""
    auth = request.headers.get("Authorization", "")
    if auth:
        return "key:" + hashlib.sha256(auth.encode()).hexdigest()[:16]
    return f"peer:{request.remote}"


def _bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, config: ServingConfig) -> None:
        self.llm = llm
        self.config = config
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._decoder_kinds: set[str] | None = None
        self._longest_token_bytes: int | None = None
        self.lora = None  # LoRAServing (lora_serving.py) when the engine serves adapters

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        assert self.llm.info is not None
        return self.llm.info.max_model_len

    @property
    def max_prompt_bytes(self) -> int:
        """A prompt of more UTF-8 bytes than this cannot fit max_model_len tokens: refused untokenized.
        (The server computes it off the event loop once the model is loaded.)"""
        if self._longest_token_bytes is None:
            self._longest_token_bytes = longest_token_bytes(self.tokenizer)
        return self.max_model_len * self._longest_token_bytes

    @property
    def unstreamed_budget(self) -> int:
        """Token entries one non-streamed answer may hold (bound_unstreamed)."""
        if self.config.max_unstreamed_entries is not None:
            return self.config.max_unstreamed_entries
        return default_unstreamed_budget(self.max_model_len)

    def body_limits(self, num_prompts: int) -> tuple[int, int]:
        return body_limits(num_prompts, self.max_prompt_bytes, self.max_model_len)

    # -- shared checks -------------------------------------------------------------------------
    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model), or a 404."""
        if name is None or name in (self.config.served_model_name, self.config.model_path):
            return None
        lora = self.lora.resolve(name) if self.lora is not None else None
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return lora

    def response_model(self, lora: LoRARequest | None) -> str:
        return self.config.served_model_name if lora is None else lora.lora_name

    def check_capacity(self, num_sequences: int, n: int) -> None:
        """429 while the queue is too full for the request's sequences (prompts x n), a 400 when it
        has more than the queue ever holds: it could not be admitted even on an idle server, and a
        429 would have clients retry it forever. (More sequences than --max-num-seqs is no such
        case: they are admitted one by one as others finish.)"""
        cap = self.config.max_queued_requests
        if num_sequences > cap:
            raise _bad_request(
                f"this request has {num_sequences} sequences (prompts x n), more than this server "
                f"queues at once ({cap}, --max-queued-requests); lower n or send fewer prompts per request",
                param="n" if n > 1 else "prompt",
            )
        if self.llm.num_waiting + num_sequences > cap:
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
            # The engine's default, the one the request would get offline (Scheduler.max_tokens_for).
            assert self.llm.info is not None
            return self.llm.info.max_tokens_for(prompt_len)
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
            params = build()
        except ValueError as e:
            raise _bad_request(str(e)) from None
        vocab = self.llm.info.vocab_size
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab:
            raise _bad_request(f"allowed_token_ids must be in [0, {vocab})", param="allowed_token_ids")
        return params

    async def prepare_grammar(
        self, request: web.Request, params: SamplingParams, param: str | None
    ) -> GrammarHandle | None:
        """The request's grammar, compiled (or from the cache) before it is queued: a 400 naming
        `param` for a constraint the engine cannot enforce (an unsupported JSON schema keyword, a
        malformed regex or grammar), a 429 while the compile queues are full, a 408 past the
        compile deadline. Nothing of it runs on the event loop, and the wait counts toward no
        admission cap. Compiles are shared fairly between clients (compile_pool.py)."""
        if params.structured_outputs is None:
            return None
        try:
            return await self.llm.prepare_grammar(params, client_key(request))
        except PoolFull as e:
            self.llm.metrics.rejected.inc(reason="grammar_queue_full")
            raise APIError(
                429, f"{e}; retry later", type="rate_limit_error", code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None  # fmt: skip
        except GrammarCompileTimeout as e:
            raise APIError(408, str(e), param=param, code="grammar_compile_timeout") from None
        except ValueError as e:
            raise _bad_request(str(e), param=param) from None

    def check_prompt_size(self, size: int, param: str) -> None:
        """Refuse a prompt that cannot fit before tokenizing it. `size` is its length in characters
        (a lower bound on its bytes, known in O(1)) or in UTF-8 bytes."""
        if size > self.max_prompt_bytes:
            limit = self.max_model_len
            raise _bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request's "
                f"{param} has {size} characters or bytes, more than {limit} tokens can hold. Please "
                "reduce the length of the input.",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt; text is tokenized off the event loop (a long prompt takes seconds)."""
        if isinstance(prompt, str):
            self.check_prompt_size(len(prompt), "prompt")
            ids = await asyncio.get_running_loop().run_in_executor(None, self._encode_text, prompt)
        else:
            vocab = self.llm.info.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise _bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = prompt
        if not ids:
            raise _bad_request("prompt must not be empty", param="prompt")
        return ids

    def _encode_text(self, prompt: str) -> list[int]:
        try:
            size = len(prompt.encode())
        except UnicodeEncodeError as e:  # a lone surrogate: JSON can carry "\ud800"
            raise _bad_request(f"prompt is not valid Unicode: {e}", param="prompt") from None
        self.check_prompt_size(size, "prompt")
        return self.tokenizer.encode(prompt)

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools, template_kwargs)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        raw = self._token_bytes.get(token_id)
        if raw is None:
            if self._decoder_kinds is None:
                self._decoder_kinds = _decoder_kinds(self.tokenizer)
            raw = self._token_bytes[token_id] = token_bytes(self.tokenizer, token_id, self._decoder_kinds)
        return raw

    # -- running the engine --------------------------------------------------------------------
    async def run(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        request_id: str,
        grammar: GrammarHandle | None = None,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all prompts of one API request as they come: (prompt index, output). The
        prompts share one constraint, and `grammar` is its compile, and one adapter (`lora`)."""
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        gens = [
            self.llm.generate(p, sp, rid, grammar, lora)
            for p, sp, rid in zip(prompts, params, ids, strict=True)
        ]
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
        body: CompletionRequest = await parse_body(request, CompletionRequest, self.body_limits(MAX_PROMPTS))
        lora = self.check_model(body.model)
        prompts = [await self.encode(p) for p in body.prompts()]
        max_tokens = [self.resolve_max_tokens(len(p), body.max_tokens, "prompt") for p in prompts]
        if not body.stream:
            max_tokens = bound_unstreamed(
                max_tokens, body.n, body.logprobs or 0, body.max_tokens is not None,
                self.unstreamed_budget, "max_tokens",
            )  # fmt: skip
        params = [self.make_params(lambda m=m: body.sampling_params(m, body.logprobs)) for m in max_tokens]
        grammar = await self.prepare_grammar(request, params[0], body.structured_outputs_param)
        self.check_capacity(len(prompts) * body.n, body.n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        loop = asyncio.get_running_loop()
        echo_text = [
            await loop.run_in_executor(None, lambda p=p: self.tokenizer.decode(p, skip_special_tokens=True))
            if body.echo
            else ""
            for p in prompts
        ]

        def choice(
            i: int, c: CompletionOutput, text: str, offset: int, out: RequestOutput | None = None
        ) -> dict[str, Any]:
            """`offset`: the text_offset of c's first token (from the start of the choice's text,
            echoed prompt included). `out`: the echoed prompt's logprobs go first (echo +
            logprobs), and vLLM's `prompt_logprobs` field, when asked, is filled from it."""
            logprobs = None
            if body.logprobs is not None and c.logprobs is not None:
                logprobs = self.completion_logprobs(c.logprobs, offset)
            extra: dict[str, Any] = {}
            if out is not None and out.prompt_logprobs is not None:
                if body.echo and body.logprobs is not None:
                    echoed = self.echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, body.logprobs)
                    logprobs = echoed if logprobs is None else _join_logprobs(echoed, logprobs)
                if body.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = self.vllm_prompt_logprobs(
                        out.prompt_logprobs, body.prompt_logprobs
                    )
            return {
                "index": i * body.n + c.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                **extra,
            }

        base = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.response_model(lora),
        }
        if not body.stream:
            finals = await self._collect(self.run(prompts, params, request_id, grammar, lora), len(prompts))
            choices = [
                choice(i, c, echo_text[i] + c.text, len(echo_text[i]), out)
                for i, out in enumerate(finals)
                for c in out.outputs
            ]
            choices.sort(key=lambda ch: ch["index"])
            self._log(request_id, "completions", finals)
            return web.json_response({**base, "choices": choices, "usage": usage(finals)})

        def first_delta(i: int, c: CompletionOutput, out: RequestOutput) -> dict[str, Any] | None:
            # With echo, the prompt text goes out first, on its own (with logprobs: theirs).
            if not body.echo:
                return None
            echoed = None
            if body.logprobs is not None and out.prompt_logprobs is not None:
                echoed = self.echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, body.logprobs)
            return {**choice(i, c, echo_text[i], 0), "logprobs": echoed, "finish_reason": None}

        offsets: dict[tuple[int, int], int] = {}  # per choice: the text_offset of its next token

        def delta(i: int, c: CompletionOutput) -> dict[str, Any]:
            key = (i, c.index)
            offset = offsets.get(key, len(echo_text[i]))
            if c.logprobs:  # a running offset: each delta costs what it carries
                offsets[key] = offset + sum(len(self.token_text(lp.token_id)) for lp in c.logprobs)
            return choice(i, c, c.text, offset)

        return await self._stream(
            request, request_id, prompts, params, body.include_usage, base, first_delta, delta, grammar, lora
        )

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        tokens = [self.token_text(lp.token_id) for lp in lps]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [top_logprobs_by_text(lp.top, self.token_text) for lp in lps],
            "text_offset": list(accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else [],
        }

    def echo_logprobs(
        self, prompt_ids: list[int], lps: list[TokenLogprobs | None], top: int
    ) -> dict[str, Any]:
        """Completions' logprobs of an echoed prompt: its first token has none (nothing predicts
        it), as in vLLM and OpenAI's legacy API. Offsets count special tokens as empty, as the
        echoed text (decoded without them) does."""
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        tokens = [self.token_text(t) for t in prompt_ids]
        widths = [0 if t in special else len(text) for t, text in zip(prompt_ids, tokens, strict=True)]
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [
                None if lp is None else top_logprobs_by_text(lp.top[:top], self.token_text) for lp in lps
            ],
            "text_offset": list(accumulate(widths[:-1], initial=0)),
        }

    def vllm_prompt_logprobs(self, lps: list[TokenLogprobs | None], top: int) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id -> its
        logprob, rank and text, for the token itself and the `top` most likely."""
        out: list[dict[str, Any] | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {
                str(lp.token_id): {
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                    "decoded_token": self.token_text(lp.token_id),
                }
            }
            for rank, (token_id, value) in enumerate(lp.top[:top], start=1):
                entry.setdefault(
                    str(token_id),
                    {"logprob": value, "rank": rank, "decoded_token": self.token_text(token_id)},
                )
            out.append(entry)
        return out

    # -- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, self.body_limits(1))
        lora = self.check_model(body.model)
        messages = [m.template_message() for m in body.messages]
        self.check_prompt_size(sum(len(m["content"]) for m in messages), "messages")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        make_extractor = self.tool_call_extractor(body)
        # Templating (Python) and tokenizing run off the event loop.
        prompt = await asyncio.get_running_loop().run_in_executor(
            None, self._render_chat, messages, body.add_generation_prompt, tools, body.chat_template_kwargs
        )
        max_tokens = self.resolve_max_tokens(len(prompt), body.requested_max_tokens, "messages")
        if not body.stream:
            param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            (max_tokens,) = bound_unstreamed(
                [max_tokens], body.n, body.num_logprobs or 0, body.requested_max_tokens is not None,
                self.unstreamed_budget, param,
            )  # fmt: skip
        params = self.make_params(lambda: body.sampling_params(max_tokens, body.num_logprobs))
        grammar = await self.prepare_grammar(request, params, body.structured_outputs_param)
        self.check_capacity(body.n, body.n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": request_id, "created": int(time.time()), "model": self.response_model(lora)}

        def logprobs(c: CompletionOutput) -> dict[str, Any] | None:
            if not body.logprobs or c.logprobs is None:
                return None
            return {"content": [self.chat_logprob(lp, body.top_logprobs or 0) for lp in c.logprobs]}

        def message(c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
            if make_extractor is None:
                return {"role": "assistant", "content": c.text}, c.finish_reason
            stream = ToolCallStream(make_extractor())
            stream.update(c.text, final=True)
            content, calls = stream.result()
            return (
                {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})},
                tool_finish_reason(c.finish_reason, stream),
            )

        if not body.stream:
            finals = await self._collect(self.run([prompt], [params], request_id, grammar, lora), 1)
            choices = []
            for c in finals[0].outputs:
                msg, reason = message(c)
                choices.append(
                    {"index": c.index, "message": msg, "logprobs": logprobs(c), "finish_reason": reason}
                )
            self._log(request_id, "chat", finals)
            extra = {}
            if body.prompt_logprobs is not None and finals[0].prompt_logprobs is not None:
                extra["prompt_logprobs"] = self.vllm_prompt_logprobs(
                    finals[0].prompt_logprobs, body.prompt_logprobs
                )
            return web.json_response(
                {**base, "object": "chat.completion", "choices": choices, "usage": usage(finals), **extra}
            )

        def first_delta(i: int, c: CompletionOutput, out: RequestOutput) -> dict[str, Any]:
            return {
                "index": c.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }

        streams: dict[int, ToolCallStream] = {}  # per choice, with tools

        def delta(i: int, c: CompletionOutput) -> dict[str, Any]:
            if make_extractor is None:
                d, reason = ({"content": c.text} if c.text else {}), c.finish_reason
            else:
                stream = streams.setdefault(c.index, ToolCallStream(make_extractor()))
                content, calls = stream.update(c.text, final=c.finished)
                d = {**({"content": content} if content else {}), **({"tool_calls": calls} if calls else {})}
                reason = tool_finish_reason(c.finish_reason, stream)
            return {"index": c.index, "delta": d, "logprobs": logprobs(c), "finish_reason": reason}

        chunk = {**base, "object": "chat.completion.chunk"}
        return await self._stream(
            request,
            request_id,
            [prompt],
            [params],
            body.include_usage,
            chunk,
            first_delta,
            delta,
            grammar,
            lora,
        )

    def tool_call_extractor(self, body: ChatCompletionRequest) -> Callable[[], Extractor] | None:
        """How this request's output becomes tool calls (None: it is plain content)."""
        choice = body.effective_tool_choice
        if not body.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return lambda: NamedFunctionExtractor(choice.function.name)
        if choice == "required":
            return RequiredExtractor
        parser = self.config.tool_call_parser
        if parser is None:
            raise _bad_request(
                'tool_choice "auto" needs a tool-call parser: start the server with --tool-call-parser '
                f"({', '.join(TOOL_CALL_PARSERS)}), or send tool_choice required or a named function",
                param=body.tool_choice_param,
            )
        # parallel_tool_calls: false: the first call only (vLLM's behaviour; required's grammar
        # allows one item).
        max_calls = 1 if body.parallel_tool_calls is False else None
        return lambda: TOOL_CALL_PARSERS[parser](max_calls=max_calls)

    def chat_logprob(self, lp: TokenLogprobs, top: int) -> dict[str, Any]:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(self.token_bytes(token_id))}

        return {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top]]}

    # -- plumbing ------------------------------------------------------------------------------
    async def _collect(
        self, outputs: AsyncIterator[tuple[int, RequestOutput]], n: int
    ) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * n
        running: list[RequestOutputAccumulator | None] = [None] * n
        try:
            async for i, out in outputs:
                acc = running[i] = add_delta(running[i], out)
                if out.finished:
                    finals[i] = acc.get()
        except EngineDeadError as e:
            raise APIError(500, str(e), type="server_error", code="engine_dead") from None
        except RequestFailedError as e:  # this request alone; the others go on
            raise APIError(500, str(e), type="server_error", code="request_failed") from None
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
        first_delta: Callable[[int, CompletionOutput, RequestOutput], dict[str, Any] | None],
        delta: Callable[[int, CompletionOutput], dict[str, Any]],
        grammar: GrammarHandle | None = None,
        lora: LoRARequest | None = None,
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
            async for i, out in self.run(prompts, params, request_id, grammar, lora):
                firsts, choices = [], []
                for c in out.outputs:
                    key = (i, c.index)
                    if key not in opened:
                        opened.add(key)
                        first = first_delta(i, c, out)
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
                acc = running[i] = add_delta(running[i], out)
                if out.finished:
                    finals[i] = acc.get()
        except EngineDeadError as e:
            await send(APIError(500, str(e), type="server_error", code="engine_dead").body())
            return response
        except RequestFailedError as e:
            error = APIError(500, str(e), type="server_error", code="request_failed")
            if not response.prepared:
                raise error from None
            await send(error.body())
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


def _join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Completions' logprobs of the echoed prompt followed by those of the completion."""
    return {key: first[key] + then[key] for key in first}


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
