"""Speculative decoding: proposers (draft model, n-gram), the per-step decoder, lookahead planning."""
