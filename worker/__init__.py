"""kvscale worker: a paged-KV, continuously batching inference engine and its server."""

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine import LLMEngine
from kvscale.worker.llm import LLM
from kvscale.worker.outputs import CompletionOutput, RequestOutput
from kvscale.worker.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "RequestOutput", "SamplingParams"]
