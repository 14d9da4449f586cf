"""LoRA adapters over one base model, many in one batch (docs/lora.md)."""
