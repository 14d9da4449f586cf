"""The worker's HTTP server (aiohttp): OpenAI endpoints, probes, metrics, and the pod lifecycle.

Life of a worker process:
  start listening at once (liveness answers, readiness says 503 "loading") -> load the model in a
  thread -> ready -> on SIGTERM: drain (readiness 503, new requests 503, in-flight requests run
  to completion for up to --drain-timeout) -> exit 0.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hmac
import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvscale.common.request_body import MAX_BODY_BYTES
from kvscale.worker.config import EngineArgs
from kvscale.worker.engine.async_llm import AsyncLLM
from kvscale.worker.engine.core_client import MPAsyncLLM, make_async_llm
from kvscale.worker.engine.core_launch import EngineProcess
from kvscale.worker.executor.launcher import group_failure, on_group_failure
from kvscale.worker.server.loop_watchdog import LoopWatchdog
from kvscale.worker.server.lora_serving import LoRAServing, LoRAServingConfig
from kvscale.worker.server.openai_serving import OpenAIServing, ServingConfig
from kvscale.worker.server.protocol import APIError

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    # None: every interface, IPv4 and IPv6 (asyncio binds one socket per family); "0.0.0.0" would
    # leave a pod on an IPv6 or IPv6-first dual-stack cluster unreachable, probes included.
    host: str | None = None
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int = 256
    tool_call_parser: str | None = None  # `tool_choice: "auto"`: worker/server/tool_parsers.py
    max_unstreamed_entries: int | None = None  # a non-streamed answer's bound (None: its default)
    drain_timeout: float = 30.0
    # Liveness fails while one pass of the engine loop (a step, with its commands and metrics) has
    # run longer than this (seconds; 0: never), so the kubelet restarts a worker whose engine thread
    # is stuck (vLLM: VLLM_ENGINE_ITERATION_TIMEOUT_S).
    engine_iteration_timeout: float = 60.0
    # LoRA adapters: --lora-modules, --lora-allowed-roots, --enable-lora-runtime-updating.
    lora: LoRAServingConfig = field(default_factory=LoRAServingConfig)


@dataclass
class ServerState:
    llm: AsyncLLM
    serving: OpenAIServing
    config: ServerConfig
    model_name: str
    lora: LoRAServing | None = None
    draining: bool = False
    # serve()'s own start-up after the engine's (the prompt-size scan, the heap frozen): until it
    # is done, "loading", so that no request or probe meets it after /ready said yes.
    starting: bool = False
    load_error: BaseException | None = None
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.time)
    tokenizer_json: bytes | None = None  # GET /v1/kvscale/tokenizer's answer, made once


def freeze_startup_heap() -> None:
    """Move everything alive now (torch, the model, the tokenizer: millions of objects, alive as
    long as the process) out of the cyclic collector's sight, so that a full collection, which
    holds the GIL and so every thread, scans only what serving allocates. Measured (bench hostile,
    the loop watchdog): full collections held the loop 0.2-0.7 s before (vLLM freezes too)."""
    gc.collect()
    gc.freeze()


def _error(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


def _unavailable(state: ServerState) -> APIError | None:
    if state.draining:
        return APIError(503, "the server is shutting down", type="server_error", code="draining")
    if state.llm.dead is not None:
        return APIError(503, "the engine has failed", type="server_error", code="engine_dead")
    if state.starting or not state.llm.is_ready:
        return APIError(
            503,
            "the model is still loading",
            type="server_error",
            code="loading",
            headers={"Retry-After": "5"},
        )
    return None


def api_key_matches(authorization: str, api_key: str) -> bool:
    """Whether an Authorization header carries `Bearer <api_key>`, compared in constant time: a
    plain `==` returns at the first differing byte, so response timing would leak the key's prefix."""
    expected = f"Bearer {api_key}".encode()
    # surrogatepass: any str a header can decode to is encodable, so a hostile header cannot raise.
    return hmac.compare_digest(authorization.encode("utf-8", "surrogatepass"), expected)


def _http_error(request: web.Request, e: web.HTTPException) -> web.Response:
    """aiohttp's own errors (unknown path, wrong method) in the OpenAI shape too, on every path."""
    allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status)
    message = f"{e.reason}: {request.method} {request.path}"
    return _error(APIError(e.status, message, code=code, headers=allow))


@web.middleware
async def api_middleware(request: web.Request, handler):
    """Auth, admission (loading / draining) and the OpenAI error shape for everything under /v1."""
    state: ServerState = request.app["state"]
    if not request.path.startswith("/v1/"):
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _http_error(request, e)
    key = state.config.api_key
    if key is not None and not api_key_matches(request.headers.get("Authorization", ""), key):
        return _error(APIError(401, "Incorrect or missing API key.", code="invalid_api_key"))
    if request.method == "POST":
        unavailable = _unavailable(state)
        if unavailable is not None:
            state.llm.metrics.rejected.inc(reason=unavailable.code or "unavailable")
            return _error(unavailable)
    state.in_flight += 1
    state.idle.clear()
    try:
        return await handler(request)
    except APIError as e:
        if e.status == 400:
            state.llm.metrics.rejected.inc(reason="invalid")
        return _error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _http_error(request, e)
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client left; its engine request is already aborted
    except Exception:
        logger.exception("unexpected error", extra={"path": request.path})
        return _error(APIError(500, "internal server error", type="server_error", code="internal_error"))
    finally:
        state.in_flight -= 1
        if state.in_flight == 0:
            state.idle.set()


def engine_stuck(stalled_since: float | None, now: float, timeout: float) -> bool:
    """Whether the engine thread has owed progress (a loop pass that has not ended, an add it has
    not taken) since `stalled_since` (None: it owes none) for longer than `timeout`."""
    return timeout > 0 and stalled_since is not None and now - stalled_since > timeout


async def health(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP, its engine loop has not died and no step is stuck."""
    state: ServerState = request.app["state"]
    if state.llm.dead is not None or state.load_error is not None:
        return web.json_response({"status": "dead"}, status=500)
    if group_failure() is not None:  # a tensor-parallel rank died: this worker exits
        return web.json_response({"status": "rank failed"}, status=500)
    if engine_stuck(state.llm.stalled_since, time.monotonic(), state.config.engine_iteration_timeout):
        return web.json_response({"status": "stuck"}, status=500)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Readiness: the model is loaded and the server is not draining."""
    state: ServerState = request.app["state"]
    unavailable = _unavailable(state)
    if unavailable is not None:
        return web.json_response({"status": unavailable.code}, status=503)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    return web.Response(body=state.llm.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app["state"]
    info = state.llm.info
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "kvscale",
        "root": state.serving.config.model_path,
        "max_model_len": info.max_model_len if info is not None else None,
    }
    adapters = state.lora.cards(card) if state.lora is not None else []
    return web.json_response({"object": "list", "data": [card, *adapters]})


MAX_TOKENIZER_BYTES = 64 << 20  # tokenizer files; the largest common ones (Llama 3, Qwen) are ~10 MB


def tokenizer_files(tokenizer) -> dict[str, str]:
    """The tokenizer as transformers saves it (tokenizer.json, its config, the chat template...),
    each file base64: what a router needs to produce this worker's token ids (router/tokenizer.py)."""
    with tempfile.TemporaryDirectory(prefix="kvscale-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {f.name: f.read_bytes() for f in sorted(Path(tmp).iterdir()) if f.is_file()}
    size = sum(len(b) for b in files.values())
    if size > MAX_TOKENIZER_BYTES:
        raise APIError(500, f"the tokenizer's files are {size} bytes, over {MAX_TOKENIZER_BYTES}")
    return {name: base64.b64encode(data).decode() for name, data in files.items()}


async def tokenizer(request: web.Request) -> web.Response:
    """GET /v1/kvscale/tokenizer: {"model": served name, "files": {name: base64}} (made once)."""
    state: ServerState = request.app["state"]
    if state.llm.info is None:
        raise APIError(503, "the model is still loading", code="loading")
    if state.tokenizer_json is None:
        files = await asyncio.get_running_loop().run_in_executor(
            None, tokenizer_files, state.serving.tokenizer
        )
        state.tokenizer_json = json.dumps({"model": state.model_name, "files": files}).encode()
    return web.Response(body=state.tokenizer_json, content_type="application/json")


def build_app(llm: AsyncLLM, engine_args: EngineArgs, config: ServerConfig) -> web.Application:
    model_name = config.served_model_name or engine_args.model
    serving = OpenAIServing(
        llm,
        ServingConfig(
            model_name,
            engine_args.model,
            config.max_queued_requests,
            config.tool_call_parser,
            config.max_unstreamed_entries,
        ),
    )
    state = ServerState(llm, serving, config, model_name)
    if engine_args.enable_lora:
        state.lora = serving.lora = LoRAServing(llm, config.lora, (model_name, engine_args.model))
    elif config.lora.modules or config.lora.runtime_updating:
        raise ValueError("--lora-modules and --enable-lora-runtime-updating need --enable-lora")
    state.idle.set()
    app = web.Application(middlewares=[api_middleware], client_max_size=MAX_BODY_BYTES)
    app["state"] = state
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/kvscale/tokenizer", tokenizer)
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_post("/v1/chat/completions", serving.chat)
    if state.lora is not None:
        state.lora.add_routes(app)
    return app


# After a rank's failure, /health answers 500 this long before the process exits (a probe may see it).
FAILURE_EXIT_DELAY = 1.0


def exit_soon(reason: str, cause: str = "tensor-parallel group broken") -> None:
    """A tensor-parallel rank or the engine process died: exit 1 shortly, whatever the engine
    thread is blocked in (the monitor has already killed this host's other ranks; a collective with
    a dead peer may not return). Until then /health answers 500."""
    logger.error("exiting: %s", cause, extra={"reason": reason})
    threading.Timer(FAILURE_EXIT_DELAY, os._exit, (1,)).start()


async def serve(engine_args: EngineArgs, config: ServerConfig, engine: EngineProcess | None = None) -> int:
    """Run until SIGTERM/SIGINT, then drain and return the exit code. `engine`: the engine
    process, when the caller started it already (--engine-process)."""
    model_name = config.served_model_name or engine_args.model
    if engine_args.tensor_parallel_size > 1:
        on_group_failure(exit_soon)
    llm = make_async_llm(engine_args, model_name, engine)
    if isinstance(llm, MPAsyncLLM):
        llm.on_dead = lambda: exit_soon(str(llm.dead), "the engine process died")
    app = build_app(llm, engine_args, config)
    state: ServerState = app["state"]
    state.starting = True
    # auto_decompress=False: aiohttp 3.14 can hang on a deflate body that breaks at its end; a
    # compressed body is then simply not JSON (a clear 400). Clients send plain JSON anyway.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0, auto_decompress=False
    )
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    logger.info("listening", extra={"host": config.host, "port": config.port, "model": model_name})
    watchdog = LoopWatchdog(llm.metrics.registry)  # logs what holds the loop past 100 ms
    watchdog.start()

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    load = asyncio.create_task(llm.start())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        state.load_error = load.exception()
        logger.error("model load failed", exc_info=state.load_error)
        await runner.cleanup()
        watchdog.stop()
        return 1
    if load.done() and state.lora is not None:
        try:
            await state.lora.load_modules()
        except ValueError as e:
            state.load_error = e
            logger.error("LoRA adapters failed to load: %s", e)
            await llm.shutdown()
            await runner.cleanup()
            watchdog.stop()
            return 1
    if load.done():
        # Scans the vocabulary (128k entries for Llama 3): once, and off the event loop.
        await loop.run_in_executor(None, lambda: state.serving.max_prompt_bytes)
        # The last collection holds the loop as long as a full one (0.66 s measured), so it runs
        # while /ready still says "loading": after Ready it met the first probes (bench hostile's
        # /health p100).
        freeze_startup_heap()
        state.starting = False
        assert llm.info is not None
        compile_s = llm.info.compile_seconds
        logger.info(
            "ready",
            extra={
                "model": model_name,
                "kv_blocks": llm.info.num_kv_blocks,
                # Seconds loading a compiled package before Ready (None: Ready on the eager forward,
                # the compiled one built behind: model/compile_behind.py).
                "compile_s": None if compile_s is None else round(compile_s, 1),
            },
        )
        await stopper

    state.draining = True
    logger.info("draining", extra={"in_flight": state.in_flight, "timeout_s": config.drain_timeout})
    try:
        await asyncio.wait_for(state.idle.wait(), timeout=config.drain_timeout)
        logger.info("drained")
    except TimeoutError:
        logger.warning(
            "drain timeout: aborting the requests still running", extra={"in_flight": state.in_flight}
        )
    await runner.cleanup()  # closes connections; cancelled handlers abort their engine requests
    if not load.done():
        load.cancel()
    await llm.shutdown()
    watchdog.stop()
    return 0
