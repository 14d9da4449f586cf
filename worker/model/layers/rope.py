"""Rotary-embedding tables (cos/sin per position) for every RoPE variant a Hugging Face config names.

The scaled variants (linear, dynamic, yarn, longrope, llama3) take their inverse frequencies and
attention factor from transformers' own functions, so our tables match the reference model.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    return params


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, CPU) and the attention scaling folded into cos/sin."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        dim = int(head_dim_of(config) * params.get("partial_rotary_factor", 1.0))
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    # "dynamic" rescales only past the trained length; kvscale caps max_model_len at that length
    # unless told otherwise, where the table equals the unscaled one, as in the reference.
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_factor)


def max_rope_positions(config) -> tuple[int | None, str]:
    """The longest context the config's RoPE supports, with the reason (for error messages).

    default: max_position_embeddings. linear: factor x max_position_embeddings (positions are
    divided by the factor). yarn: factor x original_max_position_embeddings. llama3: the config's
    max_position_embeddings, which already states the extended length (131,072 for Llama 3.1,
    more than factor x original = 65,536). dynamic and longrope rescale with the live sequence
    length in transformers, which fixed tables cannot follow: up to max_position_embeddings for
    dynamic (where its table equals the unscaled one) and original_max_position_embeddings for
    longrope (its short factors). None when the config names no limit.
    """
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    declared = getattr(config, "max_position_embeddings", None)
    factor = params.get("factor") or 1.0
    original = params.get("original_max_position_embeddings") or declared
    if rope_type == "linear" and declared is not None:
        return int(
            factor * declared
        ), f"rope_type linear: factor {factor} x max_position_embeddings {declared}"
    if rope_type == "yarn" and original is not None:
        return int(
            factor * original
        ), f"rope_type yarn: factor {factor} x original_max_position_embeddings {original}"
    if rope_type == "longrope" and original is not None:
        return original, (
            f"rope_type longrope: original_max_position_embeddings {original} (kvscale's tables use the "
            "short factors; transformers switches to the long ones past that length)"
        )
    if declared is None:
        return None, "the config has no max_position_embeddings"
    if rope_type == "dynamic":
        return declared, (
            f"rope_type dynamic: max_position_embeddings {declared} (transformers rescales past it with "
            "the live length, which fixed tables cannot follow)"
        )
    return declared, f"rope_type {rope_type}: max_position_embeddings {declared}"


def rope_cos_sin(config, max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_position, rotary_dim // 2] float32 tables, scaled by the variant's attention factor."""
    inv_freq, scaling = rope_inv_freq(config)
    positions = torch.arange(max_position, dtype=torch.float)
    freqs = positions[:, None] * inv_freq[None, :]
    return (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)
