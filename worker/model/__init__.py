"""From a Hugging Face folder to logits: loader, the Llama-family decoder, runner, KV cache, attention."""
