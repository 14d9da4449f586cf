"""LoRA adapters at the HTTP edge, vLLM's way: `--lora-modules name=path ...` loaded at start, the
request's `model` naming an adapter, `/v1/models` listing the adapters with the base model as
their `parent`, and, behind `--enable-lora-runtime-updating` (off by default, like vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) and the API key, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`.

A path a client names must resolve, every file of it, inside `--lora-allowed-roots`; without roots
runtime loading refuses every path. Reading and checking an adapter runs in the default executor
(never on the event loop), one load at a time. A bad adapter is a 400 in OpenAI's error shape and
changes nothing: the adapters already loaded and the requests running keep going.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from kvscale.common.request_body import parse_body
from kvscale.worker.engine.async_llm import AsyncLLM
from kvscale.worker.lora.request import LoRARequest
from kvscale.worker.server.protocol import APIError

# A name is a metric label value and one item of vllm:lora_requests_info's comma-separated lists:
# no commas, spaces or quotes.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
MAX_ADAPTERS = 1024  # names one server keeps (each a label value of the per-adapter metrics)
BODY_LIMITS = (64 * 1024, 64 * 1024)  # a load request is a name and a path


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """`--lora-modules` entries: `name=path`, or vLLM's JSON form `{"name": ..., "path": ...}`."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: JSON needs 'name' and 'path'") from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
        check_name(name)
        if not path:
            raise ValueError(f"--lora-modules {value!r}: the path is empty")
        modules.append((name, path))
    names = [n for n, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError("--lora-modules names an adapter twice")
    return modules


def check_name(name: object) -> str:
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        raise ValueError(
            f"adapter name {name!r} is not allowed: 1-128 characters of letters, digits and ._:/@+- "
            "(no commas or spaces), starting with a letter or digit"
        )
    return name


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(max_length=128)
    lora_path: str = Field(max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(max_length=128)


@dataclass
class LoRAServingConfig:
    modules: list[tuple[str, str]] = field(default_factory=list)  # --lora-modules
    allowed_roots: list[str] | None = None  # --lora-allowed-roots (None: runtime loads refused)
    runtime_updating: bool = False  # --enable-lora-runtime-updating


class LoRAServing:
    """The adapters this server knows by name; one LoRARequest (and lora_int_id) per load."""

    def __init__(self, llm: AsyncLLM, config: LoRAServingConfig, base_names: tuple[str, ...]) -> None:
        self.llm = llm
        self.config = config
        self.base_names = base_names  # the names that select the base model
        self.adapters: dict[str, LoRARequest] = {}
        self.digests: dict[str, str] = {}  # each adapter's content digest (its KV's hash root)
        self.created: dict[str, int] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()  # one load or unload at a time

    def resolve(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def cards(self, base: dict) -> list[dict]:
        """/v1/models' entries of the adapters: vLLM's shape, the base model as `parent`."""
        return [
            {
                "id": name,
                "object": "model",
                "created": self.created[name],
                "owned_by": base["owned_by"],
                "root": request.lora_path,
                "parent": base["id"],
                "max_model_len": base.get("max_model_len"),
            }
            for name, request in self.adapters.items()
        ]

    async def load(self, name: str, path: str, allowed_roots: list[str] | None) -> LoRARequest:
        """Read, check and register an adapter; ValueError says why not (nothing changes then)."""
        check_name(name)
        if name in self.base_names:
            raise ValueError(f"{name!r} is the base model's name")
        async with self._lock:
            if name in self.adapters:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            if len(self.adapters) >= MAX_ADAPTERS:
                raise ValueError(f"this server already has {MAX_ADAPTERS} adapters; unload one first")
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
            digest = await self.llm.add_lora(request, allowed_roots)
            self.adapters[name] = request
            self.digests[name] = digest
            self.created[name] = int(time.time())
            self.llm.metrics.set_served_adapters(self.digests)
            return request

    async def unload(self, name: str) -> None:
        async with self._lock:
            request = self.adapters.pop(name, None)
            if request is None:
                raise KeyError(name)
            self.created.pop(name, None)
            self.digests.pop(name, None)
            await self.llm.remove_lora(request.lora_int_id)  # requests running on it finish on it
            self.llm.metrics.set_served_adapters(self.digests)

    async def load_modules(self) -> None:
        """--lora-modules, at start-up (a bad one fails the start, with its reason)."""
        for name, path in self.config.modules:
            try:
                await self.load(name, path, self.config.allowed_roots)
            except ValueError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None

    # -- the endpoints -------------------------------------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body: LoadLoRAAdapterRequest = await parse_body(request, LoadLoRAAdapterRequest, BODY_LIMITS)
        roots = self.config.allowed_roots
        if not roots:
            raise APIError(
                400,
                "loading adapters at run time needs --lora-allowed-roots (the folders adapters may be "
                "read from)",
                param="lora_path",
            )
        try:
            await self.load(body.lora_name, body.lora_path, roots)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_lora_adapter") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body: UnloadLoRAAdapterRequest = await parse_body(request, UnloadLoRAAdapterRequest, BODY_LIMITS)
        try:
            await self.unload(body.lora_name)
        except KeyError:
            raise APIError(
                404,
                f"The lora adapter '{body.lora_name}' cannot be found.",
                param="lora_name",
                code="not_found",
            ) from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def add_routes(self, app: web.Application) -> None:
        if self.config.runtime_updating:
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
