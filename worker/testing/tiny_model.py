"""Build a small random Llama-family model folder locally (config, safetensors, tokenizer).

It is the built-in default of `kvscale-worker generate` and the fixture factory of the tests: a
real Hugging Face folder that goes through the same loader as any downloaded checkpoint, made
without touching the network. Its weights are random, so its text is noise; the tokenizer is a
byte-level BPE trained in a few seconds on the Python standard library's own sources.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def default_model_dir() -> Path:
    return Path.home() / ".cache" / "kvscale" / "tiny-llama"


def train_tokenizer(vocab_size: int = 2048, max_files: int = 200) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the stdlib's .py files, deterministic for a given Python install."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:max_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    path: str | Path,
    *,
    architecture: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    tokenizer_from: str | Path | None = None,
    initializer_range: float = 0.1,
    seed: int = 0,
    **config_overrides,
) -> Path:
    """Write a random model folder at `path` and return it. `tokenizer_from` copies the tokenizer
    of an existing folder (and takes its vocabulary size); otherwise one is trained locally."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_from, name)
            if src.is_file():
                shutil.copy(src, path / name)
        from transformers import AutoTokenizer

        vocab_size = len(AutoTokenizer.from_pretrained(path))
    else:
        tokenizer = train_tokenizer()
        tokenizer.save_pretrained(path)
        vocab_size = len(tokenizer)

    config = CONFIG_CLASSES[architecture](
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return path
