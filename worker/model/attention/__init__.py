"""Attention backends behind one interface: plain torch (CPU, reference) and Triton (GPU)."""
