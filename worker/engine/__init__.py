"""The step loop (LLMEngine), its async front (AsyncLLM), detokenization, outputs and stats."""
