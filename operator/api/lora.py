"""LoRA adapters on the workers' base model: which adapters (spec.adapters) and how the engine holds
them (spec.lora). docs/lora.md has the whole story, worker and operator."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from kvscale.operator.api.model import Uri
from kvscale.operator.api.validation import CamelModel, Rule

if TYPE_CHECKING:
    from kvscale.operator.api.spec import InferenceDeploymentSpec

# The worker's adapter names (worker/server/lora_serving.NAME): a metric label value and an item of
# vllm:lora_requests_info's comma-separated lists, so no commas, spaces or quotes.
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"
MAX_ADAPTERS = 64


class AdapterSpec(CamelModel):
    """One LoRA adapter: a PEFT folder (adapter_config.json and safetensors) for the base model."""

    rules = (
        Rule(
            "!self.uri.startsWith('builtin://')",
            "an adapter's uri is a PEFT folder: pvc://, hf:// or an absolute path, not builtin://",
            lambda a: not a.uri.startswith("builtin://"),
        ),
    )

    name: str = Field(
        pattern=ADAPTER_NAME,
        max_length=128,
        description="The name clients pass as `model` to use this adapter (vLLM's convention); "
        "/v1/models lists it with the base model as its parent. Letters, digits and ._:/@+-.",
    )
    uri: Uri = Field(
        description="Where the PEFT folder is, in the forms of model.uri: `pvc://CLAIM/PATH` (the "
        "claim mounted read-only), `hf://ORG/NAME[@REVISION]` (downloaded by an init container with "
        "model's hfTokenSecret, hfEndpoint and cache; the revision pins it), or an absolute path "
        "inside the worker image. `builtin://` is not an adapter source.",
    )


class LoRASpec(CamelModel):
    """How each worker holds its adapters (the engine's --max-loras, --max-lora-rank,
    --max-cpu-loras) and how a change of spec.adapters reaches running workers."""

    rules = (
        Rule(
            "!has(self.maxCpuLoras) || self.maxCpuLoras >= (has(self.maxLoras) ? self.maxLoras : 4)",
            "maxCpuLoras must be at least maxLoras (the adapters in device slots are kept in host "
            "memory too)",
            lambda s: s.max_cpu_loras is None or s.max_cpu_loras >= s.max_loras,
        ),
    )

    max_loras: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Adapters resident in device slots, usable in one batch; the least recently "
        "used is evicted to host memory when another is needed.",
    )
    max_lora_rank: int = Field(
        default=16, ge=1, le=512, description="The largest adapter rank (smaller ones are zero-padded)."
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Adapters kept in host memory; beyond it they are read from their folders "
        "again. Default: maxLoras.",
    )
    dynamic_loading: bool = Field(
        default=False,
        description="Add and remove adapters on running workers: the operator calls each ready "
        "worker's /v1/load_lora_adapter and /v1/unload_lora_adapter, and the base model is not "
        "restarted. Off: a change of spec.adapters rolls the workers out (new pods start with the "
        "new list). Either way an hf:// adapter, or one on a claim the workers do not mount yet, "
        "changes the pods (its download or its volume) and so rolls them out.",
    )


def adapter_name_clash(spec: InferenceDeploymentSpec, name: str) -> str | None:
    """Why an adapter's name cannot be used (None: it can): one named as the base model would shadow
    it (the worker refuses to start with it)."""
    served = spec.model.served_name or name
    if any(a.name == served for a in spec.adapters):
        return f"invalid spec: adapter {served!r} has the base model's served name (model.servedName)"
    return None
