"""LoRA adapters over one base model, many in one batch (docs/engine.md#lora-adapters)."""
