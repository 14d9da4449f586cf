"""The offline API, shaped like vLLM's: `LLM(model=PATH, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvscale.worker.config import EngineArgs
from kvscale.worker.engine.llm_engine import LLMEngine
from kvscale.worker.engine.outputs import RequestOutput, RequestOutputAccumulator, add_delta
from kvscale.worker.lora.request import LoRARequest
from kvscale.worker.sample.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json sampling defaults (vLLM's name). Fields a request's
        own SamplingParams leave unset take these values anyway."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, all in one continuous batch; outputs in prompt order.
        `lora_request`: one adapter for every prompt, or one per prompt (None: the base model), as
        in vLLM; the engine needs enable_lora."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: a string or a single list of token ids
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")

        engine = self.engine
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                ids.append(engine.add_request(prompt, p, lora_request=lora))
            ours = set(ids)  # the engine may also be running requests added through it directly
            # The engine's outputs are deltas; whole outputs are gathered here.
            running: dict[str, RequestOutputAccumulator] = {}
            while len(finished) < len(ids):
                for out in engine.step():
                    if out.request_id not in ours:
                        continue
                    running[out.request_id] = add_delta(running.get(out.request_id), out)
                    if out.finished:
                        finished[out.request_id] = running.pop(out.request_id).get()
                failed = [e for rid, e in engine.take_failed().items() if rid in ours]
                if failed:
                    raise failed[0]
        except BaseException:
            # All or nothing: a bad prompt (or an interrupt) leaves no half-run batch behind.
            engine.abort_request(ids)
            raise
        return [finished[i] for i in ids]
