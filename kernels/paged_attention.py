"""Attention over a paged KV cache, plain torch.

The cache of one layer is `[num_kv_heads, num_blocks, block_size, head_dim]` (see kv_cache.py);
a sequence's tokens live in the blocks its block table lists, in order. Query heads are grouped
over KV heads (GQA; MHA is the group size 1 case). The keys/values of the tokens being computed
are already written to the cache (write_kv_cache runs first), so one code path covers fresh
prompts, chunked prefill, prefix-cache hits and several query tokens per sequence (speculative
verification).
"""

import torch
import torch.nn.functional as F


def _gather_context(query, k_cache, v_cache, block_tables):
    """(query [KVH, B, G, D], keys and values [KVH, B, L, D]): each sequence's pages per KV head,
    contiguous in one copy, L = max_blocks * block_size."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    max_len = block_tables.shape[1] * block_size
    flat = block_tables.reshape(-1)
    keys = k_cache.index_select(1, flat).view(num_kv_heads, num_seqs, max_len, head_dim)
    values = v_cache.index_select(1, flat).view(num_kv_heads, num_seqs, max_len, head_dim)
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    return q, keys, values


def paged_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim]: one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64, padded with any valid block id
    seq_lens: torch.Tensor,  # [B] int64: tokens in the cache per sequence, the query's own included
    scale: float,
    sliding_window: int | None = None,
    invalid: torch.Tensor | None = None,  # decode_key_mask(...) of these arguments, when the caller has it
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """Batched over sequences by padding every block table to the longest; callers that mix very
    different lengths should bucket sequences by length to bound the padding work. The mask is the
    same for every layer of a step, so the engine computes it once (`invalid`)."""
    num_seqs, num_heads, head_dim = query.shape
    q, keys, values = _gather_context(query, k_cache, v_cache, block_tables)
    max_len = keys.shape[2]

    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scale)  # [KVH, B, G, L]
    if invalid is None:
        invalid = decode_key_mask(seq_lens, max_len, sliding_window)
    scores.masked_fill_(invalid[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def paged_decode_attention_unwritten(
    query: torch.Tensor,  # [B, num_heads, head_dim]: one query token per sequence
    key: torch.Tensor,  # [B, num_kv_heads, head_dim]: its own key, NOT in the cache yet
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B]: context including the query's own token
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """Decode attention before the step's own K/V are written: the cached context (positions below
    seq_len - 1) and the token's own key/value share one softmax. Pure tensor code with no side
    effect, so that the compiled decode graph holds attention too; the graph writes the cache after
    every layer has read it. Same result as write_kv_cache + paged_decode_attention, up to float rounding.

    Under torch.compile the context is read through the block table in place: the products with
    the indexed cache are written as broadcast multiply-and-sum, which inductor fuses into one loop
    nest per layer that loads each key and value once, where gather + bmm first copies every
    context (measured at 32 streams: the copies were half the step). Eagerly that form would
    materialise [KVH, B, G, L, D] products, so eager callers get the gather + bmm form."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    max_len = block_tables.shape[1] * block_size
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    if torch.compiler.is_compiling():
        keys = k_cache[:, block_tables].view(num_kv_heads, num_seqs, 1, max_len, head_dim)
        values = v_cache[:, block_tables].view(num_kv_heads, num_seqs, 1, max_len, head_dim)
        scores = (q[..., None, :].float() * keys.float()).sum(-1) * scale  # [KVH, B, G, L]
    else:
        _, keys, values = _gather_context(query, k_cache, v_cache, block_tables)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    own_k = key.transpose(0, 1).unsqueeze(2)  # [KVH, B, 1, D]
    own_v = value.transpose(0, 1).unsqueeze(2)
    own = (q * own_k).sum(-1, keepdim=True).float() * scale  # [KVH, B, G, 1]
    current = seq_lens[:, None] - 1  # the query's position; its cache slot is not written yet
    key_pos = torch.arange(max_len, device=query.device)[None, :]
    invalid = key_pos >= current
    if sliding_window is not None:
        invalid = invalid | (key_pos <= current - sliding_window)
    scores = scores.masked_fill(invalid[None, :, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
    if torch.compiler.is_compiling():  # the casts fuse into the loads: float accumulation throughout
        context = (probs[..., :max_len, None] * values.float()).sum(-2).to(query.dtype)  # [KVH, B, G, D]
    else:
        context = torch.matmul(probs[..., :max_len].to(query.dtype), values)
    out = context + probs[..., max_len:].to(query.dtype) * own_v
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def decode_key_mask(seq_lens: torch.Tensor, max_len: int, sliding_window: int | None) -> torch.Tensor:
    """[B, max_len] bool: True where a padded key position is not attended (past the sequence, or
    before its sliding window)."""
    key_pos = torch.arange(max_len, device=seq_lens.device)
    invalid = key_pos[None, :] >= seq_lens[:, None]
    if sliding_window is not None:
        invalid |= key_pos[None, :] <= (seq_lens[:, None] - 1 - sliding_window)
    return invalid


def paged_prefill_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]: the flat batch of query tokens
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    query_start_loc: torch.Tensor,  # [B + 1] int64: sequence i owns query rows [loc[i], loc[i+1])
    seq_lens: torch.Tensor,  # [B]: cached context + this chunk; the chunk is the tail of the sequence
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each chunk over its whole context, one sequence at a time."""
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    out = torch.empty_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_q = q_end - q_start
        blocks = block_tables[i, : -(-seq_len // block_size)]
        k = k_cache[:, blocks].view(num_kv_heads, -1, head_dim)[None, :, :seq_len]  # [1, KVH, L, D]
        v = v_cache[:, blocks].view(num_kv_heads, -1, head_dim)[None, :, :seq_len]
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        mask = None
        if num_q != seq_len or sliding_window is not None:
            q_pos = torch.arange(seq_len - num_q, seq_len, device=query.device)[:, None]
            k_pos = torch.arange(seq_len, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out[q_start:q_end] = o.squeeze(0).transpose(0, 1)
    return out
