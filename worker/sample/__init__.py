"""Sampling parameters, the vectorised sampler and the speculative rejection sampler."""
