"""Our Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3 share one implementation.

RMSNorm, RoPE, SwiGLU MLP, grouped-query attention, over a flat batch of tokens (no padding):
every token carries its position and the cache slot its K/V goes to. Q/K/V and gate/up
projections are fused into one matmul each; the loader stacks the checkpoint's separate weights.
Under tensor parallelism (tp: a TensorParallelGroup) each rank builds the same model with its share
of heads, MLP features and vocabulary (layers/tp_layout.py); tp=None is the single-process model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kvscale.kernels.dispatch import apply_rotary_embedding, fused_add_rms_norm, rms_norm
from kvscale.kernels.paged_attention import paged_decode_attention_unwritten
from kvscale.worker.model.attention.backend import AttentionBackend
from kvscale.worker.model.attention.unified_attention import unified_attention
from kvscale.worker.model.forward_context import set_forward_context
from kvscale.worker.model.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from kvscale.worker.model.layers.rope import head_dim_of, rope_cos_sin
from kvscale.worker.model.layers.tp_layout import TPLayout, tp_layout
from kvscale.worker.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class DecoderSpec:
    """What differs between the supported families, read off a Hugging Face config."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_hf_config(cls, config) -> DecoderSpec:
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; kvscale runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; the SwiGLU MLP needs silu")
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias, o_bias = {
            "Qwen2ForCausalLM": (True, False),
            "MistralForCausalLM": (False, False),
        }.get(arch, (attention_bias, attention_bias))
        n = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None:
            windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
        else:
            windows = (window,) * n
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=n,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim_of(config),
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=windows,
        )

    def layout(self, rank: int = 0, size: int = 1) -> TPLayout:
        return tp_layout(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rank=rank,
            size=size,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, layout: TPLayout, tp) -> None:
        super().__init__()
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.sliding_window = spec.sliding_windows[layer_idx]
        qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, qkv_size, bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, spec.hidden_size, bias=spec.o_bias, tp=tp)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, step: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention output, and this step's keys and values (for the caller to cache when
        step.decode is set: the in-graph decode path reads the cache but does not write it)."""
        qkv = self.qkv_proj(hidden)
        if step.lora is not None:  # each row's adapter, added to the base projection (eager only)
            step.lora.apply(qkv, hidden, self.layer_idx, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_embedding(step.positions, q, k, step.cos, step.sin)
        if step.decode is None:
            out = unified_attention(q, k, v, self.layer_idx, self.scale, self.sliding_window)
        else:
            d = step.decode
            k_cache, v_cache = d.kv_caches[self.layer_idx]
            out = paged_decode_attention_unwritten(
                q, k, v, k_cache, v_cache, d.block_tables, d.seq_lens, self.scale, self.sliding_window
            )
        out = out.reshape(-1, self.q_size)  # reshape: a decode output may be strided
        o = self.o_proj(out)
        if step.lora is not None:
            step.lora.apply(o, out, self.layer_idx, "o")
        return o, k, v


class MLP(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, layout: TPLayout, tp) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate_size = size = layout.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, 2 * size, bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(size, spec.hidden_size, bias=spec.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(gate_up, x, self.layer_idx, "gate_up")
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = nn.functional.silu(gate) * up
        out = self.down_proj(h)
        if lora is not None:
            lora.apply(out, h, self.layer_idx, "down")
        return out


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, layer_idx: int, layout: TPLayout, tp) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer_idx, layout, tp)
        self.mlp = MLP(spec, layer_idx, layout, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, hidden, residual, step: StepInputs):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, k, v = self.self_attn(hidden, step)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, step.lora), residual, (k, v)


@dataclass
class DecodeInputs:
    """A decode-only step's attention inputs, for attention inside the compiled graph (no opaque op,
    no Python per layer): block tables padded to the longest sequence, context lengths, the caches,
    and the slots the graph writes the step's keys and values to."""

    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]: tokens incl. this step's one
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor | None = None  # [B]; None while tracing (the graph's own input)


@dataclass
class StepInputs:
    """What every layer reads: positions, the rotary tables and, on the in-graph decode path, the
    decode inputs (None: attention goes through the backend's opaque op)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    decode: DecodeInputs | None = None
    # The step's LoRA rows (lora/slots.py LoRABatch); None: every row runs the base model alone.
    lora: object | None = None


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, layout: TPLayout, tp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            layout.vocab_per_rank, spec.hidden_size, tp=tp, vocab_start=layout.vocab_start
        )
        self.layers = nn.ModuleList(DecoderLayer(spec, i, layout, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Checkpoint names -> (our fused parameter, shard index); the loader stacks shards in this order.
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config, max_position: int, tp=None) -> None:
        super().__init__()
        self.spec = spec = DecoderSpec.from_hf_config(hf_config)
        self.hf_config = hf_config
        self.max_position = max_position
        self.tp = tp
        self.layout = layout = spec.layout(tp.rank, tp.world_size) if tp is not None else spec.layout()
        self.model = DecoderModel(spec, layout, tp)
        self.lm_head = ParallelLMHead(spec.hidden_size, layout.vocab_per_rank, spec.vocab_size, tp=tp)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        # The compiled forward_tokens (model/compilation.py), installed between steps once it exists.
        self.compiled = None

    def init_rope(self, device: torch.device) -> None:
        self.rope_cos, self.rope_sin = rope_cos_sin(self.hf_config, self.max_position, device)

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        attn_metadata: object,
        lora=None,
        lora_inputs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the flat batch. Attention reaches the backend, its plan and the
        caches through the forward context; the rest is a function of the tokens and positions only,
        which `compiled` (model/compilation.py) may replace with its compiled version. The step's
        LoRA rows: `lora` (a LoRABatch) for the eager forward, or `lora_inputs` for the compiled
        one's LoRA graph (LoRASlotTable.graph_inputs)."""
        with set_forward_context(backend, attn_metadata, kv_caches):
            if lora is not None:
                return self.forward_tokens(input_ids, positions, lora=lora)
            if lora_inputs is not None:
                return self.compiled(input_ids, positions, lora=lora_inputs)
            return (self.compiled or self.forward_tokens)(input_ids, positions)

    def forward_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        compiled=None,
        lora: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Every row's logits of a decode-only step through the compiled graph, with attention,
        the LM head and the write of the step's keys and values into the cache inside it
        (model/compilation.py). `compiled`: the compiled forward the caller chose for the step
        (default: the model's); `lora`: the step's adapter rows as the LoRA graphs take them
        (LoRASlotTable.graph_inputs)."""
        decode = DecodeInputs(block_tables, seq_lens, kv_caches, slot_mapping)
        return (compiled or self.compiled)(input_ids, positions, decode, lora)

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        decode: DecodeInputs | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora=None,
    ):
        """Hidden states; with `decode`, also each layer's new (keys, values), not yet cached.
        `rope`: the (cos, sin) tables, when not the model's own (the compiled packages take them as
        inputs, so that max_model_len is not built into them). `lora`: the step's LoRA rows."""
        cos, sin = rope if rope is not None else (self.rope_cos, self.rope_sin)
        step = StepInputs(positions, cos, sin, decode, lora)
        hidden, residual, new_kv = self.model.embed_tokens(input_ids), None, []
        for layer in self.model.layers:
            hidden, residual, kv = layer(hidden, residual, step)
            new_kv.append(kv)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden if decode is None else (hidden, new_kv)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary; None on tensor-parallel ranks other than 0."""
        return self.lm_head.compute_logits(hidden)
