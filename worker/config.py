"""Engine arguments: one dataclass shared by the offline API (`LLM(**kwargs)`) and the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any


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

    def __post_init__(self) -> None:
        checks = [
            (
                self.block_size in (8, 16, 32, 64, 128),
                f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}",
            ),
            (self.max_num_seqs >= 1, f"max_num_seqs must be positive, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be positive"),
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
            (
                self.attention_backend in ("auto", "torch", "triton"),
                "attention_backend must be auto, torch or triton",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_required: bool = True) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type == "bool":
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
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
