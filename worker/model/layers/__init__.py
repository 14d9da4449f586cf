"""Layers the decoder is built from beyond torch.nn: RoPE tables, a CPU-aware Linear."""
