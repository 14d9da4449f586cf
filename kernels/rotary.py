"""Rotary position embedding, "neox" layout (the rotated half is the second half of the head)."""

import torch


def apply_rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim // 2] float32, attention scaling folded in
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    rot = 2 * half
    # Cast like the HF reference: cos/sin computed in float32, applied in the model dtype.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:rot]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)  # partial rotary: the rest passes through
