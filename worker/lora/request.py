"""LoRARequest: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a number unique among the adapters an engine knows (its identity in the
    engine: slots, pins, metrics) and its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
