"""kvscale worker: a paged-KV, continuously batching inference engine and its server.

The public names load lazily, so light modules of this package (the server's protocol models, for
one) can be imported without importing torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "kvscale.worker.llm",
    "CompletionOutput": "kvscale.worker.engine.outputs",
    "EngineArgs": "kvscale.worker.config",
    "LLMEngine": "kvscale.worker.engine.llm_engine",
    "LoRARequest": "kvscale.worker.lora.request",
    "RequestOutput": "kvscale.worker.engine.outputs",
    "SamplingParams": "kvscale.worker.sample.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
