"""Load a Hugging Face model folder: config and tokenizer through transformers, weights straight
from its safetensors files into our decoder (no transformers model is ever built)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from kvscale.worker.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype on CUDA; float32 on CPU, where half-precision matmuls are slow."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved)
    return torch.bfloat16 if saved in (None, torch.float32) else saved


def load_config(model_path: str):
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(f"{model_path!r} is not a model folder: it has no config.json")
    return AutoConfig.from_pretrained(model_path)


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def _safetensors_files(model_path: str) -> list[Path]:
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_path!r}")
    return files


def load_model(model_path: str, hf_config, max_position: int, device: torch.device, dtype: torch.dtype):
    """Build the decoder on the meta device, then fill every parameter from the checkpoint."""
    started = time.monotonic()
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_position)
    model.to_empty(device=device)
    model.to(dtype)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = _safetensors_files(model_path)
    total_bytes, done_bytes, next_report = sum(p.stat().st_size for p in files), 0, 0.1
    for n, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_tensor(name)
                target = _load_one(model, params, name, tensor)
                if target:
                    loaded.add(target)
                done_bytes += tensor.numel() * tensor.element_size()
                if done_bytes >= next_report * total_bytes:  # progress every 10% for big checkpoints
                    logger.info(
                        "loading weights: %d%% (file %d/%d, %s)",
                        100 * done_bytes // total_bytes,
                        n,
                        len(files),
                        path.name,
                    )
                    next_report = (int(10 * done_bytes / total_bytes) + 1) / 10

    model.tie_weights()
    missing = sorted(_expected_keys(model) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_path!r} lacks weights for: {', '.join(missing[:8])}")
    model.init_rope(device)
    model.eval()
    logger.info("model loaded in %.1fs (%s, %s)", time.monotonic() - started, device, dtype)
    return model


FUSED_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}


def _expected_keys(model: LlamaForCausalLM) -> set[str]:
    """One key per plain parameter, one per shard of a fused one (see _load_one)."""
    keys = set()
    for name, _ in model.named_parameters():
        fused = next((f for f in FUSED_SHARDS if f".{f}." in name), None)
        keys.update([f"{name}#{i}" for i in range(FUSED_SHARDS[fused])] if fused else [name])
    if model.spec.tie_word_embeddings:
        keys.discard("lm_head.weight")
    return keys


def _load_one(model: LlamaForCausalLM, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter; returns the key it filled."""
    if "rotary_emb.inv_freq" in name:
        return None  # a buffer some old checkpoints carry; we compute our own tables
    if name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None
    for shard_name, (fused, shard) in model.stacked_params.items():
        part = f".{shard_name}."
        if part in name:
            target = name.replace(part, f".{fused}.")
            offset, size = _shard_range(model, fused, shard)
            _copy(params[target].data[offset : offset + size], tensor, name)
            return f"{target}#{shard}"
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in the checkpoint")
    _copy(params[name].data, tensor, name)
    return name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _shard_range(model: LlamaForCausalLM, fused: str, shard: int) -> tuple[int, int]:
    spec = model.spec
    if fused == "qkv_proj":
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return [(0, q), (q, kv), (q + kv, kv)][shard]
    return shard * spec.intermediate_size, spec.intermediate_size
