"""EngineInfo: what the API side needs to know of a loaded engine (limits, sizes, how it started).

The in-process AsyncLLM reads it off its engine; the engine process sends it once, with Ready
(engine/core_proc.py), so the server validates requests without asking the engine anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvscale.worker.core.scheduler import default_max_tokens

if TYPE_CHECKING:
    from kvscale.worker.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineInfo:
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    # Seconds loading a compiled package before Ready (None: Ready on the eager forward).
    compile_seconds: float | None
    forward_kind: str  # the forward it started with: "eager", "compiled", "cuda_graphs"...

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(
            engine.max_model_len,
            engine.vocab_size,
            engine.kv_cache_manager.num_blocks,
            engine.args.block_size,
            engine.runner.compile_seconds,
            engine.runner.forward_kind,
        )

    def max_tokens_for(self, prompt_len: int) -> int:
        """The engine's default max_tokens for a prompt of this length (Scheduler.max_tokens_for)."""
        return default_max_tokens(self.max_model_len, self.num_kv_blocks * self.block_size, prompt_len)
