"""A PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) read into this engine's
fused layout, or refused with a message that says why.

What is served exactly as PEFT computes it: LoRA (`peft_type` LORA) on any of the attention and MLP
projections (q/k/v/o, gate/up/down) of any layers, `lora_alpha / r` or, with `use_rslora`,
`lora_alpha / sqrt(r)` scaling. What is refused, because serving it as plain LoRA would be
silently wrong: DoRA, `modules_to_save` (whole trained copies of other modules), LoRA biases,
per-module rank or alpha patterns, layer replication, adapters on other modules (embeddings,
lm_head), `fan_in_fan_out` (GPT-2's Conv1D), pickled `adapter_model.bin`.

Everything read is bounded before it is read: the config's size, the safetensors header's size,
and the weights' size (no larger than an adapter of rank `max_lora_rank` on every projection of
every layer could be). Paths are resolved (symlinks followed) and, when the caller names allowed
roots, every file must resolve inside one: a folder of symlinks pointing elsewhere is refused.
Only regular files are opened (a FIFO or a device would block or never end).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from kvscale.worker.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_MAX_BYTES = 64 * 1024
HEADER_MAX_BYTES = 4 * 2**20
# PEFT's module name -> (our fused projection, slice index).
MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# How PEFT names a causal LM's LoRA tensors (the adapter's own name is stripped when saved).
TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
FLOAT_DTYPES = {"F32", "F16", "BF16"}
# Config keys whose non-default values change what the adapter computes in ways plain LoRA does not.
REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (trained copies of whole modules) is not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) is not supported",
}


class AdapterError(ValueError):
    """An adapter this engine will not serve; the message says why (a 400 at the server)."""


@dataclass(frozen=True)
class ProjectionShape:
    in_features: int
    slices: tuple[tuple[int, int], ...]  # (output offset, size) per slice, in MODULES' slice order

    @property
    def out_features(self) -> int:
        return sum(size for _, size in self.slices)


def projection_shapes(spec) -> dict[str, ProjectionShape]:
    """Our fused projections' shapes for a DecoderSpec (one process: LoRA is not served under
    tensor parallelism)."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "qkv": ProjectionShape(hidden, ((0, q), (q, kv), (q + kv, kv))),
        "o": ProjectionShape(q, ((0, hidden),)),
        "gate_up": ProjectionShape(hidden, ((0, inter), (inter, inter))),
        "down": ProjectionShape(inter, ((0, hidden),)),
    }


def module_shape(shapes: dict[str, ProjectionShape], module: str) -> tuple[int, int]:
    """(in, out) of one PEFT module."""
    projection, index = MODULES[module]
    shape = shapes[projection]
    return shape.in_features, shape.slices[index][1]


def max_weights_bytes(shapes: dict[str, ProjectionShape], num_layers: int, max_rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of rank <= max_rank can be for this model:
    float32 A and B on every module of every layer, plus the largest header we read."""
    per_layer = sum(max_rank * sum(module_shape(shapes, m)) for m in MODULES)
    return per_layer * num_layers * 4 + 8 + HEADER_MAX_BYTES


@dataclass
class LoRAAdapter:
    """An adapter in our fused layout, in host memory: per (layer, projection) it targets, A
    [n_slices * rank, in] and B [out, rank] with the scaling folded into B (slices it does not
    target are zeros)."""

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    # SHA-256 of the weights file and the scaling: the prefix cache's key (two loads of the same
    # adapter share KV blocks; different ones never do, whatever their names).
    digest: str
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


# -- paths -------------------------------------------------------------------------------------
def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def resolve_folder(path: str, allowed_roots: list[str] | None) -> tuple[Path, list[Path] | None]:
    """The adapter folder with symlinks resolved, checked against the allowed roots (resolved too);
    returns it with the resolved roots (None: unrestricted)."""
    if not path or "\0" in path:
        raise AdapterError("the adapter path is empty or not a path")
    folder = Path(os.path.realpath(path))
    roots = None if allowed_roots is None else [Path(os.path.realpath(r)) for r in allowed_roots]
    if roots is not None and not _inside(folder, roots):
        raise AdapterError(f"adapter path {path!r} is outside the allowed roots (--lora-allowed-roots)")
    if not folder.is_dir():
        raise AdapterError(f"adapter path {path!r} is not a folder")
    return folder, roots


def read_bounded(folder: Path, name: str, limit: int, roots: list[Path] | None) -> bytes:
    """A file of the adapter folder: it must resolve inside the allowed roots, be a regular file
    and hold at most `limit` bytes (checked on the open file, then read)."""
    target = Path(os.path.realpath(folder / name))
    if roots is not None and not _inside(target, roots):
        raise AdapterError(f"{name} resolves outside the allowed roots (--lora-allowed-roots)")
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AdapterError(f"the adapter folder has no {name}") from None
    except OSError as e:
        raise AdapterError(f"{name} cannot be opened: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise AdapterError(f"{name} is not a regular file")
        if info.st_size > limit:
            raise AdapterError(f"{name} is {info.st_size} bytes, more than the {limit} this model allows")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew since fstat
        raise AdapterError(f"{name} is more than the {limit} bytes this model allows")
    return data


# -- config ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    target_modules: frozenset[str] | None  # None: a pattern; the tensors say what is targeted


def parse_config(raw: bytes, max_rank: int) -> AdapterConfig:
    """adapter_config.json's fields that decide what the adapter computes, or AdapterError. Pure."""
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported; kvscale serves LoRA adapters")
    for key, message in REFUSED.items():
        if config.get(key):
            raise AdapterError(message)
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"bias {bias!r} is not supported (trained biases); only 'none'")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"use_rslora must be true or false, got {rslora!r}")
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    targets = config.get("target_modules")
    if isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            raise AdapterError("target_modules must be a list of module names or a pattern")
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise AdapterError(
                f"target_modules {unknown} are not supported; kvscale serves LoRA on {', '.join(MODULES)}"
            )
        return AdapterConfig(rank, scaling, frozenset(targets))
    if targets is not None and not isinstance(targets, str):
        raise AdapterError("target_modules must be a list of module names or a pattern")
    return AdapterConfig(rank, scaling, None)


# -- weights -----------------------------------------------------------------------------------
def check_header(data: bytes) -> None:
    """The safetensors header is bounded, JSON and describes float tensors within the file."""
    if len(data) < 8:
        raise AdapterError(f"{WEIGHTS_FILE} is too short to be safetensors")
    (length,) = struct.unpack("<Q", data[:8])
    if length > HEADER_MAX_BYTES or 8 + length > len(data):
        raise AdapterError(f"{WEIGHTS_FILE}'s header is {length} bytes: not a safetensors file this size")
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(f"{WEIGHTS_FILE}'s header is not JSON") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE}'s header is not a JSON object")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in FLOAT_DTYPES:
            raise AdapterError(f"tensor {name!r} is not a float16/bfloat16/float32 tensor")


def fused_weights(
    tensors: dict[str, torch.Tensor],
    config: AdapterConfig,
    shapes: dict[str, ProjectionShape],
    num_layers: int,
    dtype: torch.dtype,
) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], frozenset[str]]:
    """PEFT's per-module A/B pairs, checked against the model, stacked into our fused projections
    (scaling folded into B). Pure."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = TENSOR_NAME.fullmatch(name)
        if m is None:
            raise AdapterError(
                f"unexpected tensor {name!r}: only LoRA A/B weights of the attention and MLP projections "
                "are supported (no embeddings, lm_head or biases)"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise AdapterError(
                f"tensor {name!r} targets {module!r}; kvscale serves LoRA on {', '.join(MODULES)}"
            )
        if config.target_modules is not None and module not in config.target_modules:
            raise AdapterError(f"tensor {name!r} targets {module!r}, which target_modules does not list")
        if layer >= num_layers:
            raise AdapterError(f"tensor {name!r} is for layer {layer}; the model has {num_layers}")
        in_features, out_features = module_shape(shapes, module)
        want = (config.rank, in_features) if which == "A" else (out_features, config.rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want} for this model "
                "(an adapter trained for another base model?)"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = config.rank
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module} has lora_{next(iter(pair))} without its other half")
        projection, index = MODULES[module]
        shape = shapes[projection]
        if (layer, projection) not in weights:
            a = torch.zeros(len(shape.slices) * rank, shape.in_features, dtype=dtype)
            b = torch.zeros(shape.out_features, rank, dtype=dtype)
            weights[layer, projection] = (a, b)
        a, b = weights[layer, projection]
        offset, size = shape.slices[index]
        a[index * rank : (index + 1) * rank] = pair["A"].to(dtype)
        b[offset : offset + size] = (pair["B"].float() * config.scaling).to(dtype)
    return weights, frozenset(module for _, module in pairs)


def load_adapter(
    request: LoRARequest,
    spec,
    max_rank: int,
    dtype: torch.dtype,
    allowed_roots: list[str] | None = None,
) -> LoRAAdapter:
    """Read and check a PEFT folder for the model `spec` (a DecoderSpec); AdapterError says why not."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    folder, roots = resolve_folder(request.lora_path, allowed_roots)
    if not (folder / WEIGHTS_FILE).exists() and (folder / "adapter_model.bin").exists():
        raise AdapterError("adapter_model.bin (a pickle) is not loaded; save the adapter as safetensors")
    config = parse_config(read_bounded(folder, CONFIG_FILE, CONFIG_MAX_BYTES, roots), max_rank)
    shapes = projection_shapes(spec)
    data = read_bounded(folder, WEIGHTS_FILE, max_weights_bytes(shapes, spec.num_layers, max_rank), roots)
    check_header(data)
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from None
    weights, targets = fused_weights(tensors, config, shapes, spec.num_layers, dtype)
    digest = hashlib.sha256(data)
    digest.update(repr(config.scaling).encode())
    return LoRAAdapter(
        name=request.lora_name,
        int_id=request.lora_int_id,
        path=request.lora_path,
        rank=config.rank,
        scaling=config.scaling,
        digest=digest.hexdigest(),
        target_modules=targets,
        weights=weights,
    )
