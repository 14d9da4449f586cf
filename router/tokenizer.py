"""The request's prompt as the worker's token ids, for the precise prefix index (kv_index.py).

The worker hashes token ids, so the router must produce the very ids the worker will: the same
tokenizer, loaded by the same library (transformers' AutoTokenizer, from the model's tokenizer
files given with `--tokenizer`), called the same way (worker/server/openai_serving.py: `encode`
for a text prompt, `apply_chat_template` for messages with the request's tools, generation prompt
flag and template kwargs). A prompt of token ids needs no tokenizer. Where the router's rendering
could differ from the worker's (messages the worker's protocol models normalize first), the
match is shorter, never wrong: a hash is of the whole prefix.

Cost: tokenizing runs in a thread (the fast tokenizer releases the GIL); the router's CPU per
request is measured by `bench route`'s precise policy. A prompt over `max_chars` characters (the
body limit bounds it anyway) is matched on its first `max_chars` only.
"""

from __future__ import annotations

import asyncio
from typing import Any


class PromptTokenizer:
    def __init__(self, path: str, max_chars: int = 1 << 20) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # the router image installs it with the precise index
            raise SystemExit(f"--tokenizer needs the transformers package: {e}") from None
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_chars = max_chars

    def token_ids(self, chat: bool, payload: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None (nothing to match: a batch, a malformed prompt, a
        conversation the template refuses; the worker answers those)."""
        if not chat:
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if isinstance(prompt, str) and prompt:
                return self.tokenizer.encode(prompt[: self.max_chars])
            return None
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        kwargs = payload.get("chat_template_kwargs")
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages,
                tools=payload.get("tools") or None,
                add_generation_prompt=payload.get("add_generation_prompt", True) is not False,
                tokenize=True,
                **(kwargs if isinstance(kwargs, dict) else {}),
            )
        except Exception:  # the worker's 400 is the client's answer
            return None
        return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)

    async def token_ids_async(self, chat: bool, payload: dict[str, Any]) -> list[int] | None:
        return await asyncio.get_running_loop().run_in_executor(None, self.token_ids, chat, payload)
