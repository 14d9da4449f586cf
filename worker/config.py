"""Engine arguments: one dataclass shared by the offline API (`LLM(**kwargs)`) and the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ENFORCE_EAGER_ENV = "KVSCALE_ENFORCE_EAGER"


def enforce_eager_default() -> bool:
    """EngineArgs.enforce_eager's default: off, unless KVSCALE_ENFORCE_EAGER=1. The test suite sets it,
    so that a thousand short-lived engines do not each compile; the compiled path has its own tests."""
    return os.environ.get(ENFORCE_EAGER_ENV, "0") not in ("", "0")


@dataclass
class EngineArgs:
    model: str = ""
    tokenizer: str | None = None  # defaults to the model folder
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    seed: int = 0
    block_size: int = 16
    # KV pool size, first match wins: an explicit block count, a byte budget, or a fraction of the
    # device memory still free after the weights (default 0.9 on CUDA; 4 GiB, at most half the
    # available memory, on CPU).
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | torch | triton
    # Always run the model eagerly: no compiled CPU forward, no CUDA graphs (model/compilation.py).
    enforce_eager: bool = field(default_factory=enforce_eager_default)
    # The compiled CPU forward's packages (model/aot_package.py): where they are kept (default
    # $KVSCALE_COMPILE_CACHE, else ~/.cache/kvscale/compiled), whether the worker serves eagerly
    # while one is built (off: start-up waits for it), and the build's niceness (0-19; docs/engine.md).
    # compile_reserve_core: while it is built, serving runs torch on one thread fewer, leaving the
    # build a core of its own (an OpenMP team whose threads share cores with it stalls at every op).
    compile_cache_dir: str | None = None
    compile_in_background: bool = True
    compile_nice: int = 10
    compile_reserve_core: bool = True
    # Schedule and launch each step before the previous one's tokens reach the host, so the host's
    # work hides behind the device's (vLLM's --async-scheduling; docs/engine.md). For GPUs: on a
    # CPU the forward holds the cores itself and nothing overlaps.
    async_scheduling: bool = False
    # Run the engine (scheduler, forward, sampler, detokenizer) in a process of its own, the server's
    # HTTP side in this one (vLLM V1's engine core; engine/core_proc.py, docs/engine.md).
    engine_process: bool = False
    # Hand a sequence's tokens out every stream_interval tokens (its first and last at once): fewer,
    # larger SSE events, for hosts where the HTTP side's CPU per event competes with the forward
    # (vLLM's and SGLang's --stream-interval; docs/server.md).
    stream_interval: int = 1
    # Structured outputs (docs/server.md, Limits): grammar-compile threads (each client may hold half
    # of them), and the byte budget of the compiled-grammar cache.
    grammar_compile_workers: int = 2
    grammar_cache_bytes: int = 512 * 2**20
    # Seconds a server request may wait for its grammar (queue and compile): past it, a 408.
    grammar_compile_timeout: float | None = 10.0
    # Speculative decoding (docs/speculative.md): a draft model or n-gram prompt lookup proposes up to
    # num_speculative_tokens per step; the target verifies them all in one forward.
    speculative_method: str | None = None  # draft | ngram; a draft_model alone implies draft
    draft_model: str | None = None
    num_speculative_tokens: int | None = None  # the most tokens proposed per step; default 4
    # n-gram lookup: match the last n tokens (longest n first) against the request's own tokens.
    ngram_prompt_lookup_max: int = 4
    ngram_prompt_lookup_min: int = 2
    # Per request and per step, choose the lookahead from measured acceptance and step costs
    # (off: always propose num_speculative_tokens).
    speculative_adaptive: bool = True
    # Tensor parallelism (docs/parallelism.md): tensor_parallel_size ranks in all, over nnodes hosts
    # of tensor_parallel_size / nnodes ranks each; this host is node_rank, node 0 (which runs the
    # scheduler and the API) hosts the rendezvous at master_addr:master_port.
    # LoRA adapters (docs/lora.md; vLLM's flags): up to max_loras adapters in one
    # batch, resident in device slots at rank max_lora_rank (smaller ranks are zero-padded), and up
    # to max_cpu_loras (default max_loras) kept in host memory; beyond that they are read again.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # KV events for routers (docs/router.md): vLLM's --kv-events-config JSON, e.g.
    # {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    #  "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}
    kv_events_config: str | None = None
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        checks = [
            (
                self.block_size in (8, 16, 32, 64, 128),
                f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}",
            ),
            (self.max_num_seqs >= 1, f"max_num_seqs must be positive, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be positive"),
            (self.grammar_compile_workers >= 1, "grammar_compile_workers must be positive"),
            (self.stream_interval >= 1, f"stream_interval must be at least 1, got {self.stream_interval}"),
            (self.grammar_cache_bytes >= 0, "grammar_cache_bytes must not be negative"),
            (
                self.grammar_compile_timeout is None or self.grammar_compile_timeout > 0,
                "grammar_compile_timeout must be positive",
            ),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be positive"),
            (
                self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
                "kv_cache_memory_bytes must be positive",
            ),
            (
                self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 1,
                "kv_cache_memory_fraction must be in (0, 1]",
            ),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be positive"),
            (0 <= self.compile_nice <= 19, f"compile_nice must be in [0, 19], got {self.compile_nice}"),
            (
                self.attention_backend in ("auto", "torch", "triton"),
                "attention_backend must be auto, torch or triton",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_speculative()
        self._check_parallel()
        self._check_lora()

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters are not served under tensor parallelism yet")
        if self.enable_lora and self.speculative_method is not None:
            # The draft model (or n-gram proposals) would guess the base model's tokens while the
            # target verifies the adapter's: refused rather than served at a hidden cost.
            raise ValueError(
                "speculative decoding with LoRA adapters is not supported: use --enable-lora or "
                f"--speculative-method {self.speculative_method}, not both"
            )

    def _check_parallel(self) -> None:
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {tp}")
        if nodes < 1 or tp % nodes:
            raise ValueError(
                f"tensor_parallel_size {tp} must be a multiple of nnodes {nodes} (each node runs "
                "tensor_parallel_size / nnodes ranks)"
            )
        if not 0 <= self.node_rank < nodes:
            raise ValueError(f"node_rank must be in [0, {nodes}), got {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def _check_speculative(self) -> None:
        if self.speculative_method is None and self.draft_model:
            self.speculative_method = "draft"
        method = self.speculative_method
        if method not in (None, "draft", "ngram"):
            raise ValueError(f"speculative_method must be draft or ngram, got {method!r}")
        if method == "draft" and not self.draft_model:
            raise ValueError(
                "speculative_method 'draft' needs draft_model (a model folder with the same tokenizer)"
            )
        if method == "ngram" and self.draft_model:
            raise ValueError("draft_model is only used with speculative_method 'draft'")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if method is not None and self.num_speculative_tokens is None:
            self.num_speculative_tokens = 4
        if not 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max:
            raise ValueError("need 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max")

    @property
    def num_lookahead_tokens(self) -> int:
        """The most tokens a request may propose per step (0: no speculation)."""
        return (self.num_speculative_tokens or 0) if self.speculative_method else 0

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_required: bool = True) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if f.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            else:
                kind = {"int": int, "int | None": int, "float | None": float}.get(f.type, str)
                parser.add_argument(
                    flag, type=kind, default=f.default, required=f.name == "model" and model_required
                )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


def fit_max_model_len(max_model_len: int, num_blocks: int, block_size: int, explicit: bool) -> int:
    """The model length to serve once the KV pool is sized. The default (the model's
    max_position_embeddings) is lowered, with a warning, to what the whole pool holds: a
    long-context model (131,072 positions) on a small pool then serves what it can, where vLLM
    refuses to start. An explicit max_model_len is kept, with a warning: requests without
    max_tokens are clipped to the pool, and one that asks for more than the pool holds is a 400."""
    pool_tokens = num_blocks * block_size
    if pool_tokens >= max_model_len:
        return max_model_len
    more = "give the cache more memory (--kv-cache-memory-bytes, --num-kv-blocks) to serve the full length"
    if explicit:
        logger.warning(
            "the KV cache (%d blocks of %d tokens) cannot hold one sequence of max_model_len=%d tokens; "
            "requests are limited to %d tokens: %s",
            num_blocks, block_size, max_model_len, pool_tokens, more,
        )  # fmt: skip
        return max_model_len
    logger.warning(
        "max_model_len lowered from %d to %d: the KV cache (%d blocks of %d tokens) cannot hold one "
        "sequence of %d tokens; %s",
        max_model_len, pool_tokens, num_blocks, block_size, max_model_len, more,
    )  # fmt: skip
    return pool_tokens
